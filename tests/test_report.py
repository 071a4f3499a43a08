"""A run's summary (aisrl.report): what `aisrl compare` reads to know a run is finished."""

import pytest

from aisrl.report import summarize


def test_summary_steps_is_the_last_step_so_a_deleted_row_leaves_a_run_finished():
    rows = [{"step": s, "reward": 0.1 * s, "accuracy": 0.5} for s in (1, 2, 4)]  # row 3 deleted by hand
    s = summarize(rows)
    assert s["steps"] == 4  # before: 3 rows, so compare took the run for unfinished and started it again
    assert s["reward_first_fifth"] == pytest.approx(0.1) and s["reward_last_fifth"] == pytest.approx(0.4)
    assert summarize([])["steps"] == 0


def test_summary_fifths_means_and_times_by_hand():
    # 10 rows: the fifths are rows 1-2 and 9-10; alpha and k3 absent from some rows; calibration timed at step 5 only
    rows = [{"step": s, "reward": 0.1 * s, "accuracy": 0.05 * s, "time_rollout": 1.0, "time_train": 2.0}
            for s in range(1, 11)]  # fmt: skip
    rows[4]["time_calibrate"] = 10.0
    for r in rows[:4]:
        r["alpha"], r["k3_kl"] = 0.5, 0.02
    rows[9]["eval_accuracy"] = 0.3
    s = summarize(rows)
    assert s["accuracy_first_fifth"] == pytest.approx(0.075) and s["accuracy_last_fifth"] == pytest.approx(0.475)
    assert s["reward_first_fifth"] == pytest.approx(0.15) and s["reward_last_fifth"] == pytest.approx(0.95)
    assert s["mean_alpha"] == pytest.approx(0.5) and s["mean_k3_kl"] == pytest.approx(0.02)  # over rows that have them
    t = s["seconds_per_step"]
    assert t["time_calibrate"] == pytest.approx(1.0)  # 10 s once in 10 steps: a skipped phase counts 0
    assert t["time_rollout"] == pytest.approx(1.0) and t["time_sync"] == 0.0 and s["eval_accuracy"] == [(10, 0.3)]
