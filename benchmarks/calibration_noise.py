"""How much of a pooled calibration distance is noise, in runs trained with it (issue 5; docs/ais.md section 5).

    python benchmarks/calibration_noise.py RUNS [steps=80,100] [tag=NAME]

RUNS is a folder of runs trained with `correction.calibrate_rule=pooled` or `mix` (e.g. an `aisrl compare` output
folder; every `checkpoints/step_*/state.pt` below it at `steps` is read). Each checkpoint holds the last
calibrations of the window, with their gradient differences d_c = g_c - g_ref. From them (aisrl.calibrate) it
computes per candidate c:
- pooled = |mean_r d_c(r)|^2 / mean_r |g_ref(r)|^2, what the pooled rule ranks by;
- noise = tr Cov_r(d_c(r)) / n in the same units (pooled_noise), whose expectation is the part of pooled that is
  noise: E[pooled] = persisting bias^2 + noise;
- debiased = pooled - noise, an unbiased estimate of the bias^2 that persists over the window.
It prints a row per checkpoint, the picks of the pooled rule and of the least debiased value, the median share of
noise in the pooled distances, and how often the debiased values of the best and second-best candidates lie
further apart than twice the jackknife standard error (over the calibrations) of that gap, i.e. how often the
window could tell its best candidate from the next. Writes benchmarks/results/calibration_noise_<tag>.json.
"""

import math
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch

from aisrl.bench.cli import command, numbers, options
from aisrl.bench.report import machine, write_json
from aisrl.calibrate import pooled_gram, pooled_noise
from aisrl.checkpoint import checkpoint_dir

ROOT = Path(__file__).resolve().parent.parent


def split(rounds: list[dict], names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(pooled (C,), noise (C,)) of the calibrations `rounds`, as the trainer computes them."""
    gram = pooled_gram(rounds)  # (C, C)
    return gram.diagonal(), pooled_noise(rounds, names, gram)


def checkpoint_figures(path: Path) -> dict | None:
    """Pooled, noise and debiased distance per candidate from one checkpoint's stored calibrations, and the
    jackknife standard error of the gap between the two least debiased (None if it holds fewer than three)."""
    rounds = torch.load(path, weights_only=True, map_location="cpu")["extra"].get("calibrations") or []
    rounds = [r for r in rounds if "diff" in r and 0 < r["calib_ref_norm"] < float("inf")]
    n = len(rounds)
    if n < 3:  # a jackknife of the noise estimate needs two left in
        return None
    names = [k.removeprefix("calib_dist_") for k in rounds[0] if k.startswith("calib_dist_")]
    pooled, noise = split(rounds, names)
    debiased = pooled - noise  # (C,)
    first, second = torch.nan_to_num(debiased, nan=math.inf).argsort()[:2].tolist()  # the two least, NaN last
    gaps = []
    for j in range(n):
        p, e = split(rounds[:j] + rounds[j + 1 :], names)
        gaps.append((p - e)[second] - (p - e)[first])
    gaps = torch.stack(gaps)  # (n,)
    se = ((n - 1) / n * ((gaps - gaps.mean()) ** 2).sum()).sqrt().item()
    figs = {f"{key}_{c}": v[i].item() for key, v in (("pooled", pooled), ("noise", noise), ("debiased", debiased))
            for i, c in enumerate(names)}  # fmt: skip
    return {"n": n, "names": names, **figs, "gap": (debiased[second] - debiased[first]).item(), "gap_se": se}


def main(runs: Path, steps: list[int], tag: str) -> dict:
    rows = []
    for step in steps:
        for path in sorted(runs.glob(str(checkpoint_dir("**", step) / "state.pt"))):
            fig = checkpoint_figures(path)
            if fig is not None:
                rows.append({"run": str(path.parent.parent.parent.relative_to(runs)), "step": step, **fig})
    if not rows:
        raise SystemExit(f"{runs}: no checkpoint at steps {steps} holds three or more pooled calibrations (a "
                         "jackknife of the noise leaves out one and needs two left in)")
    picks = {"pooled": Counter(), "debiased": Counter()}
    shares, apart = [], 0
    for r in rows:
        names, n = r["names"], r["n"]
        for key in picks:  # a candidate whose gradient was not finite (inf - inf) is never the pick
            finite = [c for c in names if math.isfinite(r[f"{key}_{c}"])]
            if finite:
                picks[key][min(finite, key=lambda c, k=key: r[f"{k}_{c}"])] += 1
        shares += [r[f"noise_{c}"] / r[f"pooled_{c}"] for c in names
                   if 0 < r[f"pooled_{c}"] < math.inf and math.isfinite(r[f"noise_{c}"])]  # fmt: skip
        apart += r["gap"] > 2 * r["gap_se"]
        cells = "  ".join(f"{c} {r[f'pooled_{c}']:.3f} = {r[f'debiased_{c}']:.3f} + {r[f'noise_{c}']:.3f}"
                          for c in names)  # fmt: skip
        print(f"{r['run']} step {r['step']} (n={n}; pooled = debiased + noise): {cells}; "
              f"gap {r['gap']:.3f} ± {r['gap_se']:.3f}")  # fmt: skip
    out = {"runs": str(runs), "steps": steps, "checkpoints": len(rows),
           "picks_pooled": dict(picks["pooled"]), "picks_debiased": dict(picks["debiased"]),
           "median_noise_share": statistics.median(shares) if shares else math.nan, "best_two_apart_by_2se": apart,
           "rows": rows, "machine": machine(),
           "command": command(__file__)}  # fmt: skip
    print(f"{len(rows)} checkpoints; picks by pooled {dict(picks['pooled'])}, by debiased {dict(picks['debiased'])}; "
          f"median noise share of the pooled distance {out['median_noise_share']:.2f}; best two debiased apart by "
          f"more than 2 SE at {apart}")  # fmt: skip
    write_json(ROOT / "benchmarks" / "results" / f"calibration_noise_{tag}.json", out)
    return out


if __name__ == "__main__":
    runs, kw = options(sys.argv[1:], ("steps", "tag"), positional=True)
    if len(runs) != 1:
        raise SystemExit(__doc__)
    main(Path(runs[0]), numbers(kw, "steps", [80, 100], low=1), kw.get("tag", "run"))
