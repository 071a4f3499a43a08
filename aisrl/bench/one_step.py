"""One GRPO step of the real trainer, observed from outside: its metrics row and its gradient.

The exact-gradient benchmark (aisrl.bench.estimator) knows the true policy gradient but lives on a toy policy.
Questions about the lab model itself (which tokens set the direction of a correction's gradient, how far its
expectation is from the full-precision gradient) are answered by training single steps of `aisrl.trainer.train` and
reading what they computed. At the first step after a start (the warm start, or a checkpoint) the PPO ratio is 1,
the policy gradient is linear in the per-token correction weights, and two runs that differ only in the correction
sample the same batch. Held-out evaluations are skipped, and gradient clipping, the calibrated end point and the
mismatch guard are off (whatever the base config says), so the gradient returned is the raw batch gradient of the
configured loss and correction.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

import aisrl.trainer as trainer
from aisrl.branch import start_from_checkpoint
from aisrl.runs import run_rows
from aisrl.train_config import load_config
from aisrl.update import flat_grad

Hook = Callable[..., object]  # (name, old_logp, rollout_logp, mask, result) -> the correction result to train on


def one_step(base: str, overrides: list[str], *, start: tuple[str | Path, int] | None = None,
             hook: Hook | None = None) -> tuple[dict, torch.Tensor]:  # fmt: skip
    """(metrics row, flat gradient) of one training step.

    base: a preset name or a run's config.json (aisrl.branch.recorded_base finds it); overrides: dotted
    `key=value` settings on top of it.
    start: (run folder, step) to start from that run's checkpoint instead of the initial weights; the step trained
    is then step + 1, with the run's own prompts for it (its sampling seeds move with `sample_salt`).
    hook: called with each correction's inputs and result; what it returns is trained on (to split a gradient).
    """
    correct, update, evaluate = trainer.correct, trainer.policy_update, trainer.evaluate
    grads: list[torch.Tensor] = []

    def hooked(name, old_logp, rollout_logp, mask, **kw):
        res = correct(name, old_logp, rollout_logp, mask, **kw)
        return res if hook is None else hook(name, old_logp, rollout_logp, mask, res)

    def capture(cfg, model, *args, **kw):
        out = update(cfg, model, *args, **kw)
        grads.append(flat_grad(model))
        return out

    trainer.correct, trainer.policy_update, trainer.evaluate = hooked, capture, lambda *a, **k: 0.0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            run = Path(tmp) / "run"
            step = 1
            if start is not None:
                src, at = Path(start[0]), int(start[1])
                start_from_checkpoint(src, at, run)
                step = at + 1
            off = ["grad_clip=0", "correction.calibrate_every=0", "correction.guard=0"]  # nothing but correction.name
            cfg = load_config(base, [*overrides, f"max_steps={step}", *off, f"output_dir={run}"])
            if cfg.epochs != 1:  # the gradient read after the update would be the last epoch's, past a step
                raise ValueError(f"epochs={cfg.epochs}: one_step reads the step's first gradient, which is the one "
                                 "policy_update leaves only with epochs=1; set epochs=1")  # fmt: skip
            trainer.train(cfg, log=lambda _: None)
            (row,) = [r for r in run_rows(run) if r["step"] == step]
    finally:
        trainer.correct, trainer.policy_update, trainer.evaluate = correct, update, evaluate
    return row, grads[-1]
