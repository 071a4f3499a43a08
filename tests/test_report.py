"""A run's summary (aisrl.report): what `aisrl compare` reads to know a run is finished."""

import pytest

from aisrl.report import summarize


def test_summary_steps_is_the_last_step_so_a_deleted_row_leaves_a_run_finished():
    rows = [{"step": s, "reward": 0.1 * s, "accuracy": 0.5} for s in (1, 2, 4)]  # row 3 deleted by hand
    s = summarize(rows)
    assert s["steps"] == 4  # before: 3 rows, so compare took the run for unfinished and started it again
    assert s["reward_first_fifth"] == pytest.approx(0.1) and s["reward_last_fifth"] == pytest.approx(0.4)
    assert summarize([])["steps"] == 0
