"""aisrl.runs: a run is finished only when its rows, its latest checkpoint and its summary all reach the end."""

import json

from aisrl.runs import finished


def test_a_run_is_finished_only_when_its_checkpoint_and_summary_reach_the_end(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward": 0.5}) + "\n" for i in (1, 2)))
    (run / "summary.json").write_text(json.dumps({"steps": 1}))  # from a first finish at max_steps=1
    (run / "checkpoints" / "latest").write_text("step_000001")  # extended to 2; killed while saving step 2
    assert finished(run, 1) and not finished(run, 2)
    (run / "checkpoints" / "latest").write_text("step_000002")  # saved, but killed before the summary
    assert not finished(run, 2)
    (run / "summary.json").write_text('{"steps": 2')  # a summary cut short
    assert not finished(run, 2)
    (run / "summary.json").write_text(json.dumps({"steps": 2}))
    assert finished(run, 2) and not finished(run, 3)
    (run / "checkpoints" / "latest").unlink()
    assert not finished(run, 2)
