import json

import torch

from aisrl.tracking import Tracker

ROW = {"step": 1, "reward": torch.tensor(0.75), "accuracy": 0.25, "alpha": 0.9, "k3_kl": torch.tensor(0.01),
       "ess": 0.8, "time_rollout": 0.5, "time_train": 0.25}  # fmt: skip


def test_plain_lines_and_jsonl(tmp_path):
    lines = []
    t = Tracker(tmp_path, max_steps=3, start=0, log=lines.append, progress=False)
    out = t.log_step(dict(ROW))
    t.close()
    assert out["reward"] == 0.75 and isinstance(out["k3_kl"], float)  # tensors became numbers here
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == out
    assert lines == ["step 1/3 reward 0.750 acc 0.25 alpha 0.90 k3 0.0100 ess 0.80 (0.5s rollout, 0.2s train)"]


def test_rich_progress_bar(tmp_path):
    lines = []
    t = Tracker(tmp_path, max_steps=3, start=0, log=lines.append, progress=True)
    t.log_step(dict(ROW))
    assert t.bar is not None and t.bar.tasks[0].completed == 1 and "reward 0.750" in t.bar.tasks[0].description
    t.close()
    assert lines == []  # the bar replaces the per-step lines


def test_a_resume_opens_its_event_file_in_a_later_second_than_the_earlier_starts(tmp_path):
    """TensorBoard reads a run's event files in name order (the second each was opened first): a resume opened in
    the same second as the start it continues sorted before it, and that start's purge marker hid the new steps."""
    import time

    import pytest

    pytest.importorskip("tensorboard")
    folder = tmp_path / "tensorboard"
    folder.mkdir()
    now = int(time.time())
    (folder / f"events.out.tfevents.{now}.zzz-host.99999.0").write_bytes(b"")  # sorts after this host's same second
    t = Tracker(tmp_path, max_steps=3, start=2, log=lambda _: None, progress=False)
    t.close()
    (mine,) = [p for p in folder.glob("events.out.tfevents.*") if "zzz-host" not in p.name]
    assert int(mine.name.split(".")[3]) > now and sorted(folder.iterdir())[-1] == mine
    ahead = tmp_path / "ahead"  # a file stamped far ahead (another machine's clock) is not waited for
    (ahead / "tensorboard").mkdir(parents=True)
    (ahead / "tensorboard" / f"events.out.tfevents.{now + 10**6}.h.1.0").write_bytes(b"")
    t0 = time.time()
    Tracker(ahead, max_steps=3, start=0, log=lambda _: None, progress=False).close()
    assert time.time() - t0 < 5  # waiting for that second would take 11 days


def _scalars(folder, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_gets_each_step_and_the_steps_a_branch_copied(tmp_path):
    import pytest

    pytest.importorskip("tensorboard")
    t = Tracker(tmp_path / "run", max_steps=3, start=0, log=lambda _: None, progress=False)
    for step in (1, 2):
        t.log_step({**ROW, "step": step, "reward": torch.tensor(0.5 * step), "k3_kl": float("nan")})
    t.close()
    assert _scalars(tmp_path / "run", "reward") == [(1, 0.5), (2, 1.0)]
    # a branch starts from copied metrics rows and no event file: its TensorBoard shows the steps before the branch
    # point too (it began at the branch point), and a resume of a folder that has events adds none twice
    branch = tmp_path / "branch"
    branch.mkdir()
    (branch / "metrics.jsonl").write_text((tmp_path / "run" / "metrics.jsonl").read_text())
    for folder in (branch, tmp_path / "run"):
        t = Tracker(folder, max_steps=3, start=2, log=lambda _: None, progress=False)
        t.log_step({**ROW, "step": 3, "reward": torch.tensor(2.0)})
        t.close()
        assert _scalars(folder, "reward") == [(1, 0.5), (2, 1.0), (3, 2.0)]


def test_a_metric_of_several_values_is_named_before_anything_is_written(tmp_path):
    import numpy as np
    import pytest

    t = Tracker(tmp_path, max_steps=3, start=0, log=lambda _: None, progress=False)
    with pytest.raises(ValueError, match=r"metric 'per_token' holds 3 values \(shape \(3,\)\).*reduce it"):
        t.log_step({**ROW, "per_token": torch.ones(3)})
    with pytest.raises(ValueError, match=r"metric 'hist' holds 2 values"):
        t.log_step({**ROW, "hist": np.zeros(2)})
    with pytest.raises(ValueError, match=r"metric 'none' holds 0 values"):  # an empty tensor is no number either
        t.log_step({**ROW, "none": torch.tensor([])})
    out = t.log_step({**ROW, "np_mean": np.float32(0.5)})  # a numpy number is a number (was not JSON)
    t.close()
    assert out["np_mean"] == 0.5 and type(out["np_mean"]) is float
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]
