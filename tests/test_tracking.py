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
    Tracker(ahead, max_steps=3, start=0, log=lambda _: None, progress=False).close()
