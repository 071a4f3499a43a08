"""Do low-precision runs that end with more rollout/trainer mismatch end worse? (issue 5; docs/ais.md section 5)

    python benchmarks/mismatch_vs_gap.py runs/ref runs/mxall format=mxfp4_w4a4 methods=none,tis,ais
        [metric=greedy_accuracy|held_accuracy|...] [steps=100] [tag=NAME]

For every finished run of the given methods that has a full-precision twin (same seed, same warm start;
benchmarks/paired_seeds.py pools the folders and pairs them), it takes
- y: the run's score minus its twin's (held-out greedy accuracy at the last step by default), and
- x: the mean k3 KL between the rollout copy and the trainer over the first fifth of the steps, and over the last.
A method shifts both (AIS and TIS keep the copy about as close; no correction ends far lower), and so may a seed
(its prompts), so both are taken out: x and y are demeaned by method and by seed together (alternating until the
means settle, a two-way fixed-effects fit), and the correlation of what is left says whether a run that ended with
more mismatch than its method and seed predict also ended worse. The first fifth is the control: a run's early
mismatch is set by the warm start and its first batches, before training could move the copy away. The p-value is
a permutation test's (the residuals re-paired at random), which ignores the degrees of freedom the two-way fit uses
up, so it errs a little towards significance. Writes
benchmarks/results/mismatch_vs_gap_<tag or format>_<metric>.json and its section of BENCHMARKS.md.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

from aisrl.bench.cli import choice, command, number, options, study_folders
from aisrl.bench.report import update_section, write_json
from aisrl.bench.seeds import METRICS, check_starts, collect, correlation, residuals
from aisrl.runs import finite_values, measured_value, per_step, run_rows

ROOT = Path(__file__).resolve().parent.parent


def k3_fifths(run: Path, steps: int) -> tuple[float, float]:
    """Mean k3 KL over the first and the last fifth of `steps` (over the steps that measured one: a step with no token
    the trainer could score logs 0; NaN where a fifth has none)."""
    rows = per_step(run_rows(run))[:steps]
    fifth = max(1, steps // 5)
    return tuple(_fmean([measured_value(r, "k3_kl") for r in part]) for part in (rows[:fifth], rows[-fifth:]))


def _fmean(xs: list) -> float:
    finite = finite_values(xs)
    return statistics.fmean(finite) if finite else math.nan


def section(out: dict, command: str) -> str:
    lines = [f"### Late mismatch against the gap to full precision: {out['format']}, {out['metric']}\n",
             f"`{command}`: {out['runs']} runs with a full-precision twin; x = mean k3 KL over a fifth of the steps, "
             f"y = {out['metric']} minus the twin's, both with method and seed means taken out.\n",
             "| k3 over | r | permutation p | slope (y per unit k3) |", "|---|---|---|---|"]  # fmt: skip
    for key, label in (("last_fifth_k3", "last fifth"), ("first_fifth_k3", "first fifth (control)")):
        c = out[key]
        if c["r"] is None:
            lines.append(f"| {label} | undefined (no spread left) | | |")
            continue
        lines.append(f"| {label} | {c['r']:+.3f} | {c['p']:.2g} | {c['slope']:+.3g} |")
    lines.append("\n| method | runs | last-fifth k3 | mean gap | r within the method |\n|---|---|---|---|---|")
    for m, c in out["per_method"].items():
        r = "undefined" if c["r"] is None else f"{c['r']:+.2f}"
        lines.append(f"| {m} | {c['runs']} | {c['k3_last']:.3f} | {c['gap']:+.3f} | {r} |")
    left = out.get("per_method_left_out") or {}
    if left:
        named = ", ".join(f"{m} ({n})" for m, n in left.items())
        lines.append(f"\nLeft out of the table, with fewer than 4 runs: {named}.")
    return "\n".join(lines)


def main(dirs: list[Path], fmt: str, methods: list[str], steps: int = 100, metric: str = "greedy_accuracy",
         tag: str = "") -> dict:  # fmt: skip
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose from {sorted(METRICS)}")
    dirs = study_folders(dirs)  # a misspelt folder is named, not read as a study without runs
    ref_where: dict[int, Path] = {}
    ref = collect(dirs, "reference", steps, metric, ref_where)
    y, first, last = {}, {}, {}
    for m in methods:
        where: dict[int, Path] = {}
        for seed, value in collect(dirs, f"{fmt}/{m}", steps, metric, where).items():
            if seed in ref:
                y[m, seed] = value - ref[seed]
                first[m, seed], last[m, seed] = k3_fifths(where[seed], steps)
        check_starts(ref_where, {s: w for s, w in where.items() if s in ref})  # a twin started from the same weights
    for key in [k for k in y if not (math.isfinite(first[k]) and math.isfinite(last[k]))]:  # a fifth without a
        del y[key], first[key], last[key]  # measured k3: out of both correlations, so both count the same runs
    methods_of = {seed: sum(k[1] == seed for k in y) for _, seed in y}
    for key in [k for k in y if methods_of[k[1]] < 2]:  # a seed under one method only: its seed mean is all of it
        del y[key], first[key], last[key]
    if len(y) < 4:
        raise ValueError(f"only {len(y)} runs of {methods} under {fmt} have a full-precision twin with a {metric} and "
                         "a seed shared with another method (the seed's mean is taken out); need a few per method, "
                         "on seeds run under at least two methods")  # fmt: skip
    result = {"dirs": [str(d) for d in dirs], "format": fmt, "metric": metric, "methods": methods, "runs": len(y),
              "last_fifth_k3": correlation(*residuals(last, y)), "first_fifth_k3": correlation(*residuals(first, y)),
              "per_method": {}, "per_method_left_out": {}, "command": command(__file__)}  # fmt: skip
    for m in methods:
        keys = [k for k in y if k[0] == m]
        if len(keys) < 4:  # too few for a correlation within the method: named in the section, not dropped silently
            result["per_method_left_out"][m] = len(keys)
        else:
            xm, ym = statistics.fmean(last[k] for k in keys), statistics.fmean(y[k] for k in keys)
            result["per_method"][m] = {"runs": len(keys), "k3_last": xm, "gap": ym, **correlation(
                {k: last[k] - xm for k in keys}, {k: y[k] - ym for k in keys})}  # fmt: skip
    text = section(result, command(__file__))
    print(text)
    name = "_".join([tag or fmt, metric])
    earlier = ROOT / f"benchmarks/results/mismatch_vs_gap_{name}.json"
    if tag and earlier.exists() and json.loads(earlier.read_text()).get("format", fmt) != fmt:
        raise SystemExit(f"tag={tag!r} names a study of format {json.loads(earlier.read_text())['format']!r} already "
                         f"({earlier}); give this one ({fmt}) a tag of its own")  # fmt: skip
    write_json(ROOT / f"benchmarks/results/mismatch_vs_gap_{name}.json", result)
    update_section(ROOT / "BENCHMARKS.md", f"mismatch_vs_gap_{name}", text)
    return result


if __name__ == "__main__":
    paths, kw = options(sys.argv[1:], ("format", "methods", "steps", "metric", "tag"), positional=True)
    metric = choice(kw, "metric", "greedy_accuracy", METRICS)
    main([Path(p) for p in paths], kw.get("format", "mxfp4_w4a4"), kw.get("methods", "none,tis,ais").split(","),
         number(kw, "steps", 100, low=1), metric, kw.get("tag", ""))  # fmt: skip
