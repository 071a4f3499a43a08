"""End-of-run report: summary.json, a printed summary table and report.png (reward/accuracy, alpha and the
three AIS diagnostics, KL and ESS over steps)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from aisrl.checkpoint import atomic_write_text, read_jsonl


def _mean(xs):
    """The mean of the finite values (None, NaN and inf left out, as aisrl.runs.finite_values does); None if there
    are none."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


TIMES = ("time_rollout", "time_logprob", "time_calibrate", "time_correction", "time_train", "time_sync")
"""Seconds a step spends in each phase (the trainer logs them; a phase it skipped counts 0, e.g. time_calibrate
outside calibration steps). time_correction includes the mismatch guard's undo copy (correction.guard > 0), and
time_sync a LoRA run's merge of its adapters."""
TRAIN_PARTS = ("time_forward", "time_backward", "time_optimizer")
"""The parts of time_train (aisrl.update): forward passes and loss, backward passes (with gradient averaging over
ranks), gradient clipping and optimizer steps; the rest of time_train is bookkeeping between micro-batches."""


def summarize(rows: list[dict]) -> dict:
    """A run's summary from its metrics rows. `steps` is the last step logged, not the row count: a row the user
    deleted (a corrupt line, as read_jsonl's error advises) leaves a finished run finished for `aisrl compare`."""
    n = len(rows)
    fifth = max(1, n // 5)
    evals = [r for r in rows if "eval_accuracy" in r]
    timing = {k: _mean([r.get(k, 0.0) for r in rows]) for k in TIMES + TRAIN_PARTS}
    return {
        "steps": rows[-1]["step"] if rows else 0,
        "reward_first_fifth": _mean([r["reward"] for r in rows[:fifth]]),
        "reward_last_fifth": _mean([r["reward"] for r in rows[-fifth:]]),
        "accuracy_first_fifth": _mean([r["accuracy"] for r in rows[:fifth]]),
        "accuracy_last_fifth": _mean([r["accuracy"] for r in rows[-fifth:]]),
        "eval_accuracy_start": rows[0].get("eval_accuracy_start") if rows else None,  # before the first update
        "eval_accuracy": [(r["step"], r["eval_accuracy"]) for r in evals],
        "mean_alpha": _mean([r.get("alpha") for r in rows]),
        "mean_k3_kl": _mean([r.get("k3_kl") for r in rows]),
        "seconds_per_step": timing,
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(1, 3, figsize=(14, 3.8))
    ax[0].plot(steps, [r["reward"] for r in rows], label="reward")
    ax[0].plot(steps, [r["accuracy"] for r in rows], label="train accuracy")
    ev = [r for r in rows if "eval_accuracy" in r]
    ax[0].plot([r["step"] for r in ev], [r["eval_accuracy"] for r in ev], "o-", label="held-out greedy accuracy")
    ax[0].set_title("reward and accuracy")
    applied = any(r.get("alpha") is not None for r in rows)  # an AIS run; other runs show the alpha AIS would choose
    for key in ("alpha" if applied else "alpha_batch", "weight_reliability", "divergence_severity",
                "variance_amplification"):  # fmt: skip
        if any(r.get(key) is not None for r in rows):
            ax[1].plot(steps, [r.get(key) for r in rows], label=key)
    ax[1].set_title("AIS: alpha and diagnostics")
    ax[2].plot(steps, [r["k3_kl"] for r in rows], label="k3 KL(mu||pi)")
    ax[2].plot(steps, [r["ess"] for r in rows], label="sequence ESS/N")
    ax[2].set_yscale("log")
    ax[2].set_title("rollout/trainer mismatch")
    for a in ax:
        a.set_xlabel("step")
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out: str | Path) -> dict:
    out = Path(out)
    rows = read_jsonl(out / "metrics.jsonl")
    summary = summarize(rows)
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1))  # compare reads it as "this run is done"
    try:
        plot(rows, out / "report.png")
        summary["report"] = str(out / "report.png")
    except ImportError:
        summary["report"] = None
    return summary
