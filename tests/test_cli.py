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


def test_the_main_job_is_one_preset_everywhere():
    """`make run`, the README and `aisrl train` with no preset all mean DEFAULT_PRESET; a first argument that is
    an override is not taken for a preset."""
    import argparse
    from pathlib import Path

    from aisrl.cli import _train_config
    from aisrl.train_config import DEFAULT_PRESET, load_config

    root = Path(__file__).resolve().parents[1]
    assert f"aisrl train {DEFAULT_PRESET}\n" in (root / "Makefile").read_text()
    assert f"`make run` runs `aisrl train {DEFAULT_PRESET}`" in (root / "README.md").read_text()
    cfg = _train_config(argparse.Namespace(preset="max_steps=3", overrides=["lr=1e-3"]))
    assert cfg == load_config(DEFAULT_PRESET, ["max_steps=3", "lr=1e-3"]) and cfg.max_steps == 3
    assert cfg.lab.trace == "columns" and cfg.lab.target is None  # a fixed-length warm start (the same on any CPU)
