"""Where the uncorrected gradient comes from under a harsh rollout format (issue 5; docs/ais.md section 5).

    OMP_NUM_THREADS=1 python benchmarks/first_step_gradients.py [preset=lab_columns] [quant=mxfp4_w4a4]
        [seeds=0,1,2,3,4,5] [below=0.5]

Every run of a seed samples the same first batch (same warm start, prompts and sampling seeds), and at the first
step the PPO ratio is 1, so the policy gradient is linear in the per-token weights. This script trains one step
per seed four times (aisrl.bench.one_step) and reads the gradient norm (clipping off):
- `none`: weight 1 on every token (the uncorrected gradient);
- `tis`: min(w, 2);
- `low`: weight 1 on the tokens whose w = pi/mu is below `below`, 0 elsewhere;
- `rest`: weight 1 on the others.
The loss keeps its denominator (every token stays in the mask), so g_none = g_low + g_rest exactly, and the three
norms give the angle between the two parts. Held-out evaluations are skipped (this measures gradients only).
Writes benchmarks/results/first_step_gradients_<preset>_<quant>.json (with `_<hash>` for seeds or a threshold other
than the defaults, which the published files hold).
"""

import math
import statistics
import sys
from pathlib import Path

import torch

from aisrl.bench.cli import command, number, numbers, options
from aisrl.bench.one_step import one_step
from aisrl.bench.report import machine, settings_tag, write_json

ROOT = Path(__file__).resolve().parent.parent


def first_step_norm(preset: str, quant: str, seed: int, name: str, select: str | None, below: float) -> dict:
    """{grad_norm, low_frac} of step 1 with correction `name`, its weights zeroed outside the `select`ed tokens;
    low_frac: the share of valid tokens with w below `below`."""
    seen = {}

    def selective(cname, old_logp, rollout_logp, mask, res):
        if select is None or cname != name:
            return res
        low = (old_logp - rollout_logp) < math.log(below)  # (N, T) tokens with w < below
        seen["low_frac"] = ((low & mask).sum() / mask.sum()).item()
        keep = low if select == "low" else ~low
        return res._replace(weights=torch.where(keep, res.weights, 0.0))  # same mask: same loss denominator

    _, grad = one_step(preset, [f"seed={seed}", f"rollout.quant={quant}", f"correction.name={name}"], hook=selective)
    return {"grad_norm": grad.norm().item(), **seen}


def main(preset: str, quant: str, seeds: list[int], below: float) -> dict:
    if not below > 0:  # checked before a model is built: the split takes log(below)
        raise SystemExit(f"below={below}: the weight threshold is above 0, e.g. 0.5")
    per_seed = {}
    for s in seeds:
        runs = {k: first_step_norm(preset, quant, s, name, sel, below)
                for k, name, sel in (("none", "none", None), ("tis", "tis", None), ("low", "none", "low"),
                                     ("rest", "none", "rest"))}  # fmt: skip
        n = {k: r["grad_norm"] for k, r in runs.items()}
        n["low_frac"] = runs["low"]["low_frac"]
        both = n["low"] * n["rest"]  # no token below the threshold: no angle
        n["cos_low_rest"] = (n["none"] ** 2 - n["low"] ** 2 - n["rest"] ** 2) / (2 * both) if both > 0 else None
        per_seed[s] = n
        print(f"seed {s}: " + "  ".join(f"{k} {v:.4f}" for k, v in n.items() if v is not None))
    keys = ("none", "tis", "low", "rest", "low_frac", "cos_low_rest")
    mean = {k: statistics.mean(x) if (x := [v[k] for v in per_seed.values() if v[k] is not None]) else None
            for k in keys}  # fmt: skip
    print("mean: " + "  ".join(f"{k} {v:.4f}" for k, v in mean.items() if v is not None))
    out = {"preset": preset, "quant": quant, "below": below, "seeds": per_seed, "mean": mean, "machine": machine(),
           "command": command(__file__)}  # fmt: skip
    changed = {k: v for k, v in {"seeds": list(seeds), "below": below}.items() if v != DEFAULTS[k]}
    digest = settings_tag(changed, [{}])  # the published files are the defaults' (a smoke run writes beside them)
    name = f"first_step_gradients_{preset}_{quant}" + (f"_{digest}" if digest else "")
    write_json(ROOT / "benchmarks" / "results" / f"{name}.json", out)
    return out


DEFAULTS = {"seeds": [0, 1, 2, 3, 4, 5], "below": 0.5}


if __name__ == "__main__":
    _, kw = options(sys.argv[1:], ("preset", "quant", "seeds", "below"))
    main(kw.get("preset", "lab_columns"), kw.get("quant", "mxfp4_w4a4"),
         numbers(kw, "seeds", DEFAULTS["seeds"], low=0),
         number(kw, "below", DEFAULTS["below"], float))  # fmt: skip
