"""aisrl.runs: a run is finished only when its rows, its latest checkpoint and its summary all reach the end; a
run's collapse and fall follow their definitions."""

import json

from aisrl.runs import finished, summarize_run


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


def _rows(accuracy, evals=None, start=None):
    """Rows of a run with training accuracies `accuracy` (steps 1..), held-out evaluations {step: value}."""
    rows = [{"step": i + 1, "accuracy": a} for i, a in enumerate(accuracy)]
    for step, v in (evals or {}).items():
        rows[step - 1]["eval_accuracy"] = v
    if start is not None:
        rows[0]["eval_accuracy_start"] = start
    return rows


def test_collapse_is_a_last_fifth_below_a_fraction_of_the_best_full_ten_step_mean():
    # one lucky first step: the only full 10-step windows average (0.9 + 9 x 0.3) / 10 = 0.36 at best, and a last
    # fifth of 0.3 is not below half of it (the partial window of step 1 alone, 0.9, is not a peak)
    assert summarize_run(_rows([0.9] + [0.3] * 19), 0.5)["collapsed"] is False
    # below, not at: a last fifth of exactly half the peak (0.25 of 0.5, exact in binary) has not collapsed
    assert summarize_run(_rows([0.5] * 10 + [0.25] * 10), 0.5)["collapsed"] is False
    assert summarize_run(_rows([0.5] * 10 + [0.125] * 10), 0.5)["collapsed"] is True


def test_a_fall_counts_from_the_best_evaluation_the_start_included_and_an_exact_drop_of_fall_counts():
    run = summarize_run(_rows([0.3] * 10, {5: 0.45, 10: 0.40}, start=0.5), 0.5, fall=0.08)
    assert (run["eval_start"], run["eval_best"], run["eval_final"]) == (0.5, 0.5, 0.40) and run["fell"] is True
    run = summarize_run(_rows([0.3] * 10, {5: 0.30, 10: 0.22}), 0.5, fall=0.08)
    assert 0.30 - 0.22 < 0.08 and run["fell"] is True  # 8 points is 0.0799.. in floats: still a fall
    assert summarize_run(_rows([0.3] * 10, {5: 0.30, 10: 0.23}), 0.5, fall=0.08)["fell"] is False
