"""Where a training step's metrics go: metrics.jsonl, TensorBoard, and the terminal (rich progress bar).

Rows arrive as dicts of floats and detached scalar tensors; this is the one place they become numbers
(`.item()`) and get written. TensorBoard event files are written when the `tensorboard` package is installed;
the rich progress bar is used when stdout is a terminal and `rich` is installed, otherwise one plain line
per step is printed (CI logs stay readable).

metrics.jsonl is written as Python's json module writes it: a metric that is not finite is the bare token NaN
or Infinity, which Python, pandas and aisrl's readers take, and a metric that does not apply is null (`alpha`
of a run without AIS). Strict readers (jq) need NaN mapped first; the published results files
(aisrl.bench.report.write_json) hold no such token.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def as_numbers(row: dict) -> dict:
    """The row with each tensor (or numpy number) as a Python number; a metric of more than one value is an error
    naming it (a per-token tensor logged unreduced, say), before anything is written."""
    out = {}
    for k, v in row.items():
        if torch.is_tensor(v) or (hasattr(v, "item") and hasattr(v, "size")):  # torch or numpy
            n = v.numel() if torch.is_tensor(v) else v.size
            if n != 1:
                raise ValueError(f"metric {k!r} holds {n} values (shape {tuple(v.shape)}); a metric is one number: "
                                 "reduce it (mean, sum) before logging")  # fmt: skip
            v = v.item()
        out[k] = v
    return out


def step_line(row: dict, max_steps: int) -> str:
    alpha = f" alpha {row['alpha']:.2f}" if row.get("alpha") is not None else ""
    ev = f" eval {row['eval_accuracy']:.2f}" if "eval_accuracy" in row else ""
    return (f"step {row['step']}/{max_steps} reward {row['reward']:.3f} acc {row['accuracy']:.2f}{alpha} "
            f"k3 {row['k3_kl']:.4f} ess {row['ess']:.2f}{ev} "
            f"({row['time_rollout']:.1f}s rollout, {row['time_train']:.1f}s train)")  # fmt: skip


def _after_earlier_event_files(folder: Path) -> None:
    """Wait until this second is later than that of every event file in `folder`. TensorBoard reads a run's event
    files in name order, which begins with the second the file was opened: a resume opened within the second of an
    earlier start (an automatic restart) could sort first, and the earlier file's purge marker, read last, hid every
    step trained since."""
    import time

    stamps = [int(p.name.split(".")[3]) for p in folder.glob("events.out.tfevents.*") if p.name.split(".")[3].isdigit()]
    newest = max(stamps, default=0)
    if newest - time.time() > 2:  # written by a machine whose clock runs ahead: waiting for it could take for ever
        return
    while int(time.time()) <= newest:
        time.sleep(0.05)  # a second at most


class Tracker:
    def __init__(self, out: Path, max_steps: int, start: int, log=print, progress: bool | None = None):
        self.path, self.max_steps, self.log = Path(out) / "metrics.jsonl", max_steps, log
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            folder = Path(out) / "tensorboard"
            fresh = not any(folder.glob("events.out.tfevents.*"))
            _after_earlier_event_files(folder)
            self.tb = SummaryWriter(log_dir=str(folder), purge_step=start + 1)
            if fresh and start > 0:  # steps logged without events (a branch's copied rows, a deleted folder): replayed
                from aisrl.checkpoint import read_jsonl

                for row in read_jsonl(self.path):
                    if row.get("step", start + 1) <= start:
                        self._scalars(row)
        except ImportError:
            pass
        self.bar = None
        if progress if progress is not None else sys.stdout.isatty():
            try:
                from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

                self.bar = Progress(TextColumn("[bold]GRPO"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                    TimeRemainingColumn(), TextColumn("{task.description}"))  # fmt: skip
                self.bar.start()
                self.task = self.bar.add_task("", total=max_steps, completed=start)
            except ImportError:
                self.bar = None

    def log_step(self, row: dict) -> dict:
        row = as_numbers(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())  # on disk before a checkpoint of this step can be: no gap after a power loss
        self._scalars(row)
        if self.bar is not None:
            alpha = f" alpha {row['alpha']:.2f}" if row.get("alpha") is not None else ""
            desc = f"reward {row['reward']:.3f} acc {row['accuracy']:.2f}{alpha} kl {row['k3_kl']:.4f}"
            self.bar.update(self.task, completed=row["step"], description=desc)
        else:
            self.log(step_line(row, self.max_steps))
        return row

    def _scalars(self, row: dict) -> None:
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, row["step"])

    def close(self) -> None:
        """Flush and close TensorBoard and stop the progress bar; closing again does nothing."""
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
