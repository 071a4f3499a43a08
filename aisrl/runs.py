"""One run's records and numbers: its per-step metrics, whether it finished, and its summary.

A run of `aisrl train` leaves metrics.jsonl (one row per step), checkpoints/ and, once finished, summary.json. The
comparison study (aisrl.compare) and the benchmark scripts read runs through these functions, so that "finished",
"the k3 KL of a step" (measured_value: none where the step scored no token) and "the held-out accuracy at the start,
the end and its best" mean one thing for both; branches (aisrl.branch) read their rows and k3 KL the same way.
`summarize_run` gives one run's numbers: held-out and training-prompt greedy accuracy, whether it collapsed
(last-fifth training accuracy below a fraction of its best 10-step mean) or fell (final held-out accuracy `fall`
below its best evaluation), its reward curve, alpha, the AIS diagnostics and the mismatch (k3 KL, sequence ESS/N)
early and late (first and last fifth of steps), and the share of step time per phase.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from aisrl.checkpoint import latest_step, read_jsonl
from aisrl.report import TIMES

DIAGNOSTICS = ("weight_reliability", "divergence_severity", "variance_amplification")
"""The AIS diagnostics a run logs per step (aisrl.ais), summarised early and late like alpha."""


def run_rows(path: Path) -> list[dict]:
    """The per-step metrics of the run in `path` (empty if it has none yet)."""
    return read_jsonl(path / "metrics.jsonl")


def per_step(rows: list[dict]) -> list[dict]:
    """One row per step from 1 to the last logged, so that index i is step i + 1: a step whose row is missing (a
    damaged line a user removed, as read_jsonl advises) is {"step": s}, and later steps keep their places."""
    by_step = {r["step"]: r for r in rows}
    return [by_step.get(s, {"step": s}) for s in range(1, (rows[-1]["step"] if rows else 0) + 1)]


def seed_runs(folder: Path) -> list[tuple[int, Path]]:
    """(seed, run folder) of the runs in a group folder of a study (`Run.path`: seed<N>, N as written by str(int)),
    in seed order; anything else there (seed07, seed_old, a copy) is not a run of the study."""
    runs = []
    for run in Path(folder).glob("seed*"):
        digits = run.name.removeprefix("seed")
        if run.is_dir() and digits.isdigit() and str(int(digits)) == digits:
            runs.append((int(digits), run))
    return sorted(runs)


def finished_rows(path: Path, max_steps: int) -> list[dict] | None:
    """The metrics rows of the run in `path` if it reached `max_steps` in them, in its latest checkpoint and in its
    summary (so the study need not start it again), else None. Rows alone can run ahead of a checkpoint a crash cut
    short (the trainer drops them on resume), and a summary can be left from an earlier, shorter finish of a run
    since extended."""
    rows = run_rows(path)
    if not rows or rows[-1]["step"] < max_steps or (latest_step(path) or 0) < max_steps:
        return None
    try:
        return rows if json.loads((path / "summary.json").read_text())["steps"] >= max_steps else None
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError):
        return None


def finished(path: Path, max_steps: int) -> bool:
    """Whether the run in `path` is finished at `max_steps` (finished_rows)."""
    return finished_rows(path, max_steps) is not None


def finite_values(xs: list) -> list[float]:
    """The numbers of a series (None, NaN and inf left out: a non-finite row must not decide a summary)."""
    return [x for x in xs if x is not None and math.isfinite(x)]


def mean_std(xs: list[float]) -> tuple[float | None, float | None]:
    xs = finite_values(xs)
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)  # one seed: no spread


def fifths(vals: list) -> tuple[float | None, float | None]:
    """Means of the first and the last fifth of a per-step series (None and non-finite values skipped)."""
    n = max(1, len(vals) // 5)
    return mean_std(vals[:n])[0], mean_std(vals[-n:])[0]


def _accuracies(rows: list[dict], name: str) -> dict:
    """Greedy accuracy `name` ('eval': held-out, 'fit': training prompts) at the start, the end and its best."""
    evals = finite_values([r.get(f"{name}_accuracy") for r in rows])
    start = (finite_values([rows[0].get(f"{name}_accuracy_start")]) or [None])[0] if rows else None
    best = max(finite_values([start, *evals]), default=None)
    return {f"{name}_start": start, f"{name}_final": evals[-1] if evals else None, f"{name}_best": best}


def summarize_run(rows: list[dict], collapse_fraction: float, fall: float = 0.08) -> dict:
    """One run's numbers: held-out accuracy (start, final, best; collapsed, fell), reward, mismatch, time shares.
    Per-step series hold one entry per step from 1: a step whose row is missing (a damaged line a user removed, as
    read_jsonl advises) is a None there, so later steps keep their places."""
    times = {k: statistics.fmean([r.get(k, 0.0) for r in rows]) if rows else 0.0 for k in TIMES}
    total = sum(times.values())  # 0: no phase timed (rows without timings), no time per step to report
    rows = per_step(rows)
    out = {
        "steps": len(rows),
        **_accuracies(rows, "eval"),
        **_accuracies(rows, "fit"),
        "reward": [r.get("reward") for r in rows],
        "eval_curve": [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r],
        "seconds_per_step": total or None,
        "time_share": {k: v / total if total else None for k, v in times.items()},
    }
    accuracy = finite_values([r.get("accuracy") for r in rows])  # share of correct samples
    curve = smooth(accuracy, 10)
    peak = max(curve[9:] or curve, default=0.0)  # full 10-step windows only (an early partial one is noise)
    late = fifths(accuracy)[1]
    out["collapsed"] = bool(late is not None and peak > 0 and late < collapse_fraction * peak)
    out["fell"] = out["eval_final"] is not None and out["eval_best"] - out["eval_final"] >= fall - 1e-9  # 8/100: 0.08
    for key in ("alpha", *DIAGNOSTICS, "k3_kl", "ess"):
        out[key] = [measured_value(r, key) for r in rows]
        out[f"{key}_early"], out[f"{key}_late"] = fifths(out[key])
    out["alpha_kl_corr"] = _corr(out["alpha"], out["k3_kl"])  # does alpha move with the mismatch?
    return out


def measured_value(row: dict, key: str):
    """A step's mismatch metric (k3_kl, ess, alpha, a diagnostic), None where the step measured nothing: with no token
    the trainer could score (num_tokens 0) the correction reports 0, which is no mismatch of 0."""
    return None if row.get("num_tokens", 1) == 0 else row.get(key)


def _corr(xs: list, ys: list) -> float | None:
    """Pearson correlation over the steps where both are numbers (None if undefined)."""
    pairs = [(x, y) for x, y in zip(xs, ys, strict=True) if finite_values([x]) and finite_values([y])]
    if len(pairs) < 3:
        return None
    try:
        return statistics.correlation(*zip(*pairs, strict=True))
    except statistics.StatisticsError:  # a constant series
        return None


def last_fifth(run: dict) -> float:
    return fifths(run["reward"])[1]


def smooth(xs: list, w: int) -> list[float]:
    """Trailing means over w steps of the numbers among them (NaN, a gap in a line, where there are none)."""
    return [_none_nan(mean_std(xs[max(0, i - w + 1) : i + 1])[0]) for i in range(len(xs))]


def _none_nan(x: float | None) -> float:
    return math.nan if x is None else x
