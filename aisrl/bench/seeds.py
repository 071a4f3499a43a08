"""Per-seed statistics of studies (`aisrl compare` output folders), shared by the scripts under benchmarks/.

A study's runs of one seed share prompts, sampling seeds and warm start, so corrections are compared seed by seed:
`collect` reads each seed's score (the last-fifth training reward, the held-out greedy accuracy at the last step, or
a final-model score of aisrl.final_eval), `check_starts` refuses a "pair" trained from different weights, and
`summary` gives the mean, standard deviation, standard error (sd / sqrt(n)) and an exact two-sided sign test of the
paired differences. For runs keyed by (method, seed), `residuals` takes the method and seed means out (a two-way
fixed-effects fit, by alternating demeaning) and `correlation` gives Pearson's r of what is left, with a
permutation p-value and the least-squares slope.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import torch

from aisrl.checkpoint import checkpoint_dir, same_start
from aisrl.final_eval import current, scores_of
from aisrl.runs import per_step, run_rows, seed_runs

METRICS = ("reward", "greedy_accuracy", "policy_reward", "sampler_reward", "held_accuracy", "held_reward")


def finite(x) -> bool:
    """Whether x is a finite number (not None, NaN or inf)."""
    return isinstance(x, (int, float)) and math.isfinite(x)


def last_fifth_reward(rows: list[dict], steps: int) -> float | None:
    """The mean training reward over the last fifth of `steps` (rows: per_step's, one per step)."""
    tail = [r["reward"] for r in rows[:steps][-max(1, steps // 5) :] if finite(r.get("reward"))]
    return sum(tail) / len(tail) if tail else None


def score(run: Path, steps: int, metric: str, rows: list[dict] | None = None) -> float | None:
    """The run's `metric`, or None if the run is unfinished or was not scored."""
    rows = per_step(run_rows(run)) if rows is None else rows  # (the caller's, if it read them already)
    if len(rows) < steps:
        return None  # unfinished
    if metric == "reward":
        return last_fifth_reward(rows, steps)
    if metric == "greedy_accuracy":
        return rows[steps - 1].get("eval_accuracy")  # None: no evaluation at the end
    final, pointer = run / "final_eval.json", run / "checkpoints" / "latest"
    if not final.exists():
        return None
    scores = json.loads(final.read_text())
    if not current(scores):
        return None  # scored by an older version of the scorer: `aisrl compare` scores it again
    scored = scores.get("settings", {}).get("checkpoint")
    if pointer.exists() and scored != pointer.read_text().strip():
        return None  # scores of an earlier checkpoint: the run went on after it was scored
    if scored != f"step_{steps:06d}":
        return None  # the final model of another step than the one the training scores are read at
    if not scores_of(scores, checkpoint_dir(run, steps)):
        return None  # its weights changed since (retrained in place): `aisrl compare` scores it again
    return scores.get(metric)


def collect(
    dirs: list[Path], kind: str, steps: int, metric: str = "reward", where: dict[int, Path] | None = None
) -> dict[int, float]:
    """{seed: score} of `kind` ('reference' or 'FORMAT/METHOD') over the directories: each seed's run is the first
    finished one, and every score of the seed comes from that run (None there: the seed is left out, never filled
    from another folder's run). `where`, if given, receives {seed: run folder}."""
    out, chosen = {}, set()
    for d in dirs:
        for seed, run in seed_runs(d / kind):  # not seed07, seed_old, ...: not runs of `aisrl compare`
            rows = [] if seed in chosen else per_step(run_rows(run))
            if len(rows) < steps:  # chosen already, or unfinished
                continue
            chosen.add(seed)
            value = score(run, steps, metric, rows)
            if finite(value):  # a final score is NaN where nothing was scorable: the seed is left out, as unscored
                out[seed] = value
                if where is not None:
                    where[seed] = run
    return out


def check_starts(a: dict[int, Path], b: dict[int, Path]) -> None:
    """Raise if two runs of one seed started from different weights (their start.json): not a pair."""
    for seed in sorted(a.keys() & b.keys()):
        if not same_start(a[seed], b[seed]):
            raise ValueError(f"{a[seed]} and {b[seed]} (seed {seed}) started from different weights (start.json "
                             "differs: a warm start rebuilt on another machine?), so their difference is not a "
                             "paired one; pool only runs trained from one warm start")  # fmt: skip


def sign_test(positive: int, negative: int) -> float | None:
    """Two-sided exact sign-test p-value over the untied seeds (None without any)."""
    n = positive + negative
    if n == 0:
        return None
    tail = sum(math.comb(n, i) for i in range(min(positive, negative) + 1)) / 2**n
    return min(1.0, 2 * tail)


def summary(values: list[float]) -> dict:
    n = len(values)
    if n == 0:  # e.g. no run of a method has the asked-for final-model score yet
        return {"n": 0, "mean": None, "std": None, "se": None, "positive": 0, "ties": 0, "sign_p": None}
    sd = statistics.stdev(values) if n > 1 else None  # one seed has no spread
    positive, ties = sum(v > 0 for v in values), sum(v == 0 for v in values)
    return {"n": n, "mean": statistics.mean(values), "std": sd, "se": None if sd is None else sd / n**0.5,
            "positive": positive, "ties": ties, "sign_p": sign_test(positive, n - positive - ties)}  # fmt: skip


def demean(values: dict[tuple[str, int], float], rounds: int = 200) -> dict[tuple[str, int], float]:
    """values keyed by (method, seed) with each method's and each seed's mean taken out (two-way, unbalanced)."""
    out = dict(values)
    for _ in range(rounds):
        moved = 0.0
        for axis in (0, 1):
            groups: dict = {}
            for key, v in out.items():
                groups.setdefault(key[axis], []).append(v)
            means = {g: statistics.fmean(v) for g, v in groups.items()}
            moved = max(moved, *(abs(m) for m in means.values()))
            out = {key: v - means[key[axis]] for key, v in out.items()}
        if moved < 1e-12:
            break
    return out


def residuals(x: dict, y: dict) -> tuple[dict, dict]:
    """x and y on the runs where both are finite (a fifth with no finite k3 is NaN) and whose seed another of them
    shares, each with method and seed means taken out: a NaN inside a mean would make every residual NaN."""
    keys = [k for k in x if math.isfinite(x[k]) and math.isfinite(y[k])]
    shared = {seed for _, seed in keys if sum(k[1] == seed for k in keys) >= 2}
    keys = [k for k in keys if k[1] in shared]
    return demean({k: x[k] for k in keys}), demean({k: y[k] for k in keys})


def correlation(x: dict, y: dict, permutations: int = 20000) -> dict:
    """Pearson correlation of the paired residuals, its two-sided permutation p-value (the share of random
    pairings of the same residuals with at least its |r|) and the least-squares slope of y on x."""
    keys = [k for k in sorted(x) if math.isfinite(x[k]) and math.isfinite(y[k])]  # (a NaN would make every p tiny)
    a = torch.tensor([x[k] for k in keys], dtype=torch.float64)
    b = torch.tensor([y[k] for k in keys], dtype=torch.float64)
    a, b = a - a.mean(), b - b.mean()
    if a.pow(2).sum() < 1e-24 or b.pow(2).sum() < 1e-24:  # nothing left to correlate: r is undefined, not tiny p
        return {"r": None, "p": None, "n": len(keys), "slope": None}
    r = ((a * b).sum() / (a.pow(2).sum() * b.pow(2).sum()).sqrt()).item()
    gen = torch.Generator().manual_seed(0)
    shuffled = torch.stack([b[torch.randperm(len(b), generator=gen)] for _ in range(permutations)])  # (P, n)
    r_perm = (shuffled @ a) / (a.pow(2).sum() * b.pow(2).sum()).sqrt()  # (P,)
    p = ((r_perm.abs() >= abs(r) - 1e-12).sum().item() + 1) / (permutations + 1)
    return {"r": r, "p": p, "n": len(keys), "slope": ((a * b).sum() / a.pow(2).sum()).item()}
