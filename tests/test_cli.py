import json

from aisrl.cli import main


def test_bench_estimator_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "e.json"
    args = ["bench", "estimator", "vocab=3", "length=2", "batches=5", "instances=1", "strengths=[0.2]",
            "sharpness=[1.0]", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert data["config"]["vocab"] == 3 and len(data["points"]) == 1 and "machine" in data
    assert "mean MSE / MSE(oracle alpha*)" in capsys.readouterr().out


def test_bad_override_is_one_clear_line(capsys):
    assert main(["bench", "estimator", "batchez=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("aisrl: error: unknown config key 'batchez'") and "Traceback" not in err
