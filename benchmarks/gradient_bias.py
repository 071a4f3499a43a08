"""Bias and noise of each correction's gradient on the lab model itself (issue 5; docs/ais.md section 5).

    OMP_NUM_THREADS=2 python benchmarks/gradient_bias.py [preset=lab_columns] [quant=mxfp4_w4a4] [seed=S]
        [salts=16] [methods=none,tis,prefix_tis,seq_tis] [start=RUN:STEP] [horizons=1,10,100] [choose=tis,seq_tis]
        [space=grad|adam] [alpha_max=1] [tag=NAME]

A method is a correction name, optionally with options: `tis:cap=100+floor=0.1` sets correction.cap and .floor.

The exact-gradient benchmark (section 4 of docs/ais.md) splits each estimator's error into bias and noise on a toy
policy. This script does the same on the trained lab model, where the true gradient is unknown but can be
estimated: it is the expectation of the gradient computed from full-precision rollouts with no correction.

For every salt k (other sampling seeds, same prompts: the step's prompt batch is fixed by `seed`, by default 0 at the
warm start and the run's own seed from a checkpoint), it trains one step
(aisrl.bench.one_step) from the same weights with full-precision rollouts (the reference, g_ref) and with rollouts in
`quant` under each method (g_m), and keeps the gradients. A reference run and a method's run of one salt use the same
sampling seeds, so their difference d_m = g_m - g_ref is much less noisy than either. Over K salts, with vectors in
units of the true gradient's squared norm |g|^2 (estimated by |mean g_ref|^2 - var_ref / K):
- bias2[m] = |mean d_m|^2 - tr Cov(d_m) / K: the squared distance between E[g_m] and g, unbiased;
- var[m] = tr Cov(g_m): the noise of one batch's gradient;
- err@h[m] = bias2[m] + var[m] / h: the error of a direction followed for h steps, where a bias adds up and noise
  averages out (section 4); the reference's is var[ref] / h;
- cos[m], norm_ratio[m]: the cosine between E[g_m] and g, and |E[g_m]| / |g|;
- scaled_err@h[m] = min_c E|c gbar_h - g|^2 / |g|^2, gbar_h the mean of h batch gradients: the error left once a
  common scale is undone, as Adam's normalisation largely does; a method that only shrinks the gradient loses nothing
  here, one that turns it does. The reference's is (var / h) / (1 + var / h);
- on the segment g(alpha) = (1 - alpha) g_none + alpha g_tis (AIS with a pinned alpha; exact at this step, where the
  gradient is linear in the weights and both runs train on the same samples), the alpha minimising each error.
  `alpha_max=2` searches the line beyond TIS too (alpha up to 2: omega = 1 + alpha (min(w, C) - 1), which turns
  negative where w < 1 - 1 / alpha): if TIS kept part of the uncorrected bias in the same direction, going past it
  would remove more.
- calibration: could a run tell these end points apart from a few full-precision batches of its own? With c of the
  salts as the calibration, pick the estimator among `choose` (by default the importance-weighted ones measured) with
  the least |mean d_m|^2 and judge the pick on the other salts (function `calibration`).
Every figure is a quadratic form in the gradients, so only their inner products are kept (class Gram); `<key>_se` is
its jackknife standard error over the salts.
`space=adam` measures all of this on each batch gradient as the trainer's AdamW would apply it at the step (function
`adam_space`) rather than on the raw gradient: Adam divides every coordinate by its own running scale, so an estimator
nearer the full-precision gradient in |.|^2 need not give a nearer update. The none-TIS segment is left out there, as
that transform is not linear; for the same reason the calibration's mix row there mixes the updates, not the
gradients (an approximation).
`start=RUN:STEP` measures at a checkpoint of a run (e.g. late in a full-precision run) instead of the warm start.
Writes benchmarks/results/gradient_bias_<preset>_<quant>[_<run>_<step>][_seed<S>][_adam][_<tag>].json and its section
of BENCHMARKS.md (`_seed<S>`: a seed other than the run's own, or than 0 at the warm start: another prompt batch);
`tag` keeps a study of other methods at a state from replacing the first one's results.
"""

import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from aisrl.bench.cli import command, number, numbers, options
from aisrl.bench.one_step import one_step
from aisrl.bench.report import machine, update_section, write_json
from aisrl.branch import recorded_base
from aisrl.calibrate import RULES
from aisrl.checkpoint import checkpoint_dir
from aisrl.correction import CORRECTIONS
from aisrl.quant import quant_config

ROOT = Path(__file__).resolve().parent.parent


def adam_space(g: torch.Tensor, start: tuple[str, int] | None) -> torch.Tensor:
    """(K, P) each batch gradient g(k) as the trainer's AdamW scales it at the next step, u = g / (sqrt(v_hat) + eps).

    v_hat = (beta2 v + (1 - beta2) g^2) / (1 - beta2^(t + 1)) is the second moment Adam's own update divides by, with
    v and t the optimizer state at `start` (zero at the warm start, where RL begins with a fresh optimizer, so that
    u = sign(g) there, exactly Adam's first step). The batch's own g^2 floors v_hat, so a coordinate the run rarely
    updated gets the bounded step Adam gives it, not 1 / eps. Adam's first moment adds beta1 m, the same for every
    estimator and salt, and the factor (1 - beta1) / (1 - beta1^(t + 1)) is common too: both are left out, as every
    figure is in units of the reference's own |E u|^2.
    """
    P = g.shape[1]
    v, t = torch.zeros(P, dtype=torch.float64), torch.zeros(P, dtype=torch.float64)  # (P,) each
    beta2, eps = 0.999, 1e-8  # torch.optim.AdamW's defaults, which the trainer uses
    if start is not None:
        path = checkpoint_dir(start[0], int(start[1])) / "state.pt"
        opt = torch.load(path, weights_only=True, map_location="cpu")["optimizer"]
        (group,) = opt["param_groups"]
        beta2, eps = group["betas"][1], group["eps"]
        sizes = [opt["state"][i]["exp_avg_sq"].numel() if i in opt["state"] else None for i in group["params"]]
        if None in sizes:
            raise ValueError(f"{path}: a parameter without optimizer state; space=adam needs every one stepped")
        if sum(sizes) != P:
            raise ValueError(f"{path}: optimizer state for {sum(sizes)} values, the gradient has {P}")
        v = torch.cat([opt["state"][i]["exp_avg_sq"].reshape(-1).double() for i in group["params"]])
        t = torch.cat([opt["state"][i]["step"].double().expand(n) for i, n in zip(group["params"], sizes, strict=True)])
    g = g.double()
    v_hat = (beta2 * v + (1 - beta2) * g**2) / (1 - beta2 ** (t + 1))  # (K, P)
    return (g / (v_hat.sqrt() + eps)).float()


@dataclass
class Gram:
    """Inner products of K per-salt gradients of several estimators: every figure here is a quadratic form in them,
    so linear combinations (the none-TIS segment) cost no further gradients."""

    G: torch.Tensor  # (len(index) K, len(index) K): block (a, b) holds <g_a(i), g_b(j)>
    K: int
    index: dict[str, int]

    @classmethod
    def of(cls, vecs: dict[str, torch.Tensor]) -> "Gram":
        flat = torch.cat(list(vecs.values())).double()  # (len(vecs) K, P)
        return cls(flat @ flat.T, next(iter(vecs.values())).shape[0], {n: i for i, n in enumerate(vecs)})

    def drop(self, *salts: int) -> "Gram":
        """The same products without the given salts (one for the jackknife, a group to judge a choice made on it)."""
        keep = torch.tensor([j for j in range(self.G.shape[0]) if j % self.K not in salts])
        return Gram(self.G[keep][:, keep], self.K - len(salts), self.index)

    def diff_block(self, name: str, other: str | None = None) -> torch.Tensor:
        """(K, K) inner products <d_name(i), d_other(j)> of the paired differences d_m(i) = g_m(i) - g_ref(i)
        (other: by default name itself)."""
        K, G = self.K, self.G
        a, b, r = self.index[name] * K, self.index[other or name] * K, self.index["ref"] * K
        return G[a : a + K, b : b + K] - G[a : a + K, r : r + K] - G[r : r + K, b : b + K] + G[r : r + K, r : r + K]

    def stats(self, x: dict[str, float], y: dict[str, float]) -> tuple[float, float]:
        """(<mean x, mean y>, tr Cov(x, y)) for the per-salt vectors x(i) = sum_n x[n] g_n(i) and y(i) alike; the
        covariance is unbiased."""
        K = self.K
        rows = {n: slice(i * K, (i + 1) * K) for n, i in self.index.items()}
        M = sum(cx * cy * self.G[rows[a], rows[b]] for a, cx in x.items() for b, cy in y.items())  # (K, K) <x(i), y(j)>
        dot_means = M.mean().item()
        return dot_means, (M.diagonal().sum().item() - K * dot_means) / (K - 1)


def figures(gram: Gram, m: dict[str, float], horizons: list[int]) -> dict:
    """Bias, noise and errors of the estimator m (a combination of the measured ones) against the reference."""
    K, ref = gram.K, {"ref": 1.0}
    d = {**m, "ref": m.get("ref", 0.0) - 1.0}  # d = g_m - g_ref, paired by salt
    rr, var_ref = gram.stats(ref, ref)
    g2 = rr - var_ref / K  # |g|^2, unbiased: the unit of every figure
    dd, var_d = gram.stats(d, d)
    mm, var_m = gram.stats(m, m)
    mr, cov_mr = gram.stats(m, ref)
    bias2 = (dd - var_d / K) / g2
    m2, mg = mm - var_m / K, mr - cov_mr / K  # |E g_m|^2 and <E g_m, g>, unbiased
    # the unbiased |E g_m|^2 (or |g|^2) can come out negative when the noise dwarfs the mean: no real norm then
    real = m2 > 0 and g2 > 0
    out = {"bias2": bias2, "var": var_m / g2, "cos": mg / (m2 * g2) ** 0.5 if real else math.nan,
           "norm_ratio": (m2 / g2) ** 0.5 if real else math.nan}  # fmt: skip
    for h in horizons:
        out[f"err@{h}"] = bias2 + var_m / g2 / h
        # Adam undoes a common scale: the error of the best multiple c of the h-step mean, min_c E|c gbar - g|^2
        out[f"scaled_err@{h}"] = 1 - mg**2 / (g2 * (m2 + var_m / h))
    return out


def measure(g_ref: torch.Tensor, g: dict[str, torch.Tensor], horizons: list[int], choose: list[str] | None = None,
            sizes: tuple[int, ...] = (1, 2, 4, 8), segment: bool = True, alpha_max: float = 1.0) -> dict:  # fmt: skip
    """The table of the module docstring from the stacked per-salt gradients (K, P) of the reference and methods;
    with two or more estimators to `choose` from (by default the importance-weighted end points measured), how well
    c full-precision batches pick among them (calibration). The none-TIS line is searched over alpha in [0,
    alpha_max], in steps of 0.01."""
    gram = Gram.of({"ref": g_ref, **g})
    rr, var_ref = gram.stats({"ref": 1.0}, {"ref": 1.0})
    out = {"true_grad_norm2": rr - var_ref / gram.K, "ref": figures(gram, {"ref": 1.0}, horizons)}
    out.update({name: figures(gram, {name: 1.0}, horizons) for name in g})
    dropped = [gram.drop(i) for i in range(gram.K)]
    for name in g:  # jackknife standard errors over salts
        loo = [figures(d, {name: 1.0}, horizons) for d in dropped]
        for key in list(out[name]):
            vals = torch.tensor([r[key] for r in loo], dtype=torch.float64)
            out[name][f"{key}_se"] = ((gram.K - 1) / gram.K * ((vals - vals.mean()) ** 2).sum()).sqrt().item()
    if segment and "none" in g and "tis" in g:  # AIS with a pinned alpha: (1 - alpha) g_none + alpha g_tis, exactly
        top = round(alpha_max * 100)
        seg = {a / 100: figures(gram, {"none": 1 - a / 100, "tis": a / 100}, horizons) for a in range(top + 1)}
        out["segment"] = {"alpha_max": alpha_max}
        for key in [f"{k}@{h}" for k in ("err", "scaled_err") for h in horizons]:
            best = min(seg, key=lambda a: seg[a][key])
            out["segment"][f"alpha*_{key}"], out["segment"][f"best_{key}"] = best, seg[best][key]
            out["segment"][f"{key}_alpha0.5"] = seg[0.5][key]
    if choose is None:
        choose = [m for m in ("tis", "prefix_tis", "seq_tis") if m in g]
    if len(choose) >= 2:
        out["calibration"] = calibration(gram, choose, [c for c in sizes if c <= gram.K // 2], horizons)
    return out


def calibration(gram: Gram, choose: list[str], sizes: list[int], horizons: list[int]) -> dict:
    """Could a run pick its end point from a few full-precision batches (aisrl.calibrate; docs/ais.md section 5)?

    The salts are cut into groups of c; d_m(i) = g_m(i) - g_ref(i), paired by salt (one full-precision batch of the
    step's prompts per low-precision one). On each group the estimator among `choose` is picked by each of the
    trainer's rules (aisrl.calibrate.RULES, given what c batches measure):
    - pooled: the least |mean_i d_m(i)|^2, which estimates bias2 + tr Cov(d_m) / c (c full-precision batches at
      one step);
    - window: the least mean_i |d_m(i)|^2, which estimates bias2 + tr Cov(d_m) (the trainer's default rule, its D
      averaged over `correction.calibrate_window` calibrations, while the weights barely move);
    - mix: not one end point but the mixture sum_m lambda_m g_m (lambda >= 0, sum 1) with the least
      |mean_i sum_m lambda_m d_m(i)|^2 (aisrl.calibrate.simplex_min).
    For c = 1 pooled and window agree. The pick is judged on the other salts: its bias2 and err@10 there, against
    each estimator kept fixed, on the same salts; `picks` are the mean lambda of each estimator.
    """
    out = {}
    cross = {(a, b): gram.diff_block(a, b) for a in choose for b in choose}  # (K, K) <d_a(i), d_b(j)>
    h = 10 if 10 in horizons else horizons[0]
    keys = ("bias2", f"err@{h}")

    def measured(g: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """What the trainer's rules (aisrl.calibrate.RULES) judge by, from the group's batches: the mean |d_m|^2 (n,)
        and the Gram matrix (n, n) <mean_i d_a(i), mean_j d_b(j)>."""
        dist = torch.tensor([cross[m, m][g, g].diagonal().mean().item() for m in choose], dtype=torch.float64)
        pooled = torch.tensor([[cross[a, b][g, g].mean().item() for b in choose] for a in choose], dtype=torch.float64)
        return dist, pooled

    rules = {name: RULES[name] for name in ("pooled", "window", "mix")}
    for c in sizes:
        picks = {r: [] for r in rules}
        chosen = {r: {k: [] for k in keys} for r in rules}
        fixed = {m: {k: [] for k in keys} for m in choose}
        for start in range(0, gram.K - c + 1, c):
            group = slice(start, start + c)
            rest = gram.drop(*range(start, start + c))
            for m in choose:
                fig = figures(rest, {m: 1.0}, [h])
                for k in keys:
                    fixed[m][k].append(fig[k])
            dist, pooled = measured(group)
            for r, rule in rules.items():
                lam = rule(dist, pooled)  # (n,): every gradient here is finite
                picks[r].append(lam)
                fig = figures(rest, {m: lam[i].item() for i, m in enumerate(choose) if lam[i] > 0}, [h])
                for k in keys:
                    chosen[r][k].append(fig[k])
        out[c] = {"groups": len(picks["pooled"]),
                  **{r: {"picks": dict(zip(choose, torch.stack(picks[r]).mean(0).tolist(), strict=True)),
                         **{k: statistics.fmean(v) for k, v in chosen[r].items()}} for r in rules},
                  "fixed": {m: {k: statistics.fmean(v) for k, v in f.items()} for m, f in fixed.items()}}  # fmt: skip
    return out


def _pm(r: dict, key: str) -> str:
    return f"{r[key]:.3g}" + (f" ± {r[key + '_se']:.2g}" if key + "_se" in r else "")


def section(out: dict) -> str:
    """BENCHMARKS.md block of one measurement: command, machine and a row per method."""
    res, m = out["results"], out["machine"]
    lines = [f"Command: `{out['command']}` ({out['seconds']:.0f} s; {m['cpu']}, {m['cpus']} CPUs, torch {m['torch']}). "
             f"State: {out['start']}; rollouts {out['quant']}; {out['salts']} salts of seed {out['seed']}'s prompts. "
             + ("Units: |g|^2, the true gradient's squared norm" if out.get("space", "grad") == "grad" else
              "Space: each batch gradient as AdamW applies it at this step (`adam_space`); units: the squared norm of "
              "the full-precision update's expectation") + "; ± is the jackknife standard error over salts.", "",
             "| method | cos(E g_m, g) | bias^2 | noise per batch | err@10 | mean k3 KL | ESS/N | alpha |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in res.items():
        if name in ("true_grad_norm2", "segment", "calibration"):
            continue
        extra = " | ".join(f"{r[k]:.3g}" if k in r else "-" for k in ("k3_kl", "ess", "alpha"))
        label = "full precision (reference)" if name == "ref" else f"`{name}`"
        cells = " | ".join(_pm(r, k) for k in ("cos", "bias2", "var", "err@10"))
        lines.append(f"| {label} | {cells} | {extra} |")
    if "segment" in res:
        seg = res["segment"]
        top = seg.get("alpha_max", 1.0)
        where = "segment" if top == 1.0 else f"line, searched over alpha in [0, {top:g}],"
        far = (f"; at 100 steps, alpha {seg['alpha*_err@100']:.2f} and err@100 {seg['best_err@100']:.3g}"
               if "alpha*_err@100" in seg else "")
        best = f"{seg['alpha*_err@10']:.2f} (err@10 {seg['best_err@10']:.3g}{far})"
        lines.append(f"\nOn the none-TIS {where} the alpha with the least err@10 is {best}; "
                     f"alpha 0.5 gives {seg['err@10_alpha0.5']:.3g}.")  # fmt: skip
    if "calibration" in res:
        cal = res["calibration"]
        names = list(next(iter(cal.values()))["fixed"])
        lines += ["", "End point picked from c full-precision batches (`calibration`: pooled = least |mean d_m|^2, "
                  "c batches at one step; window = least mean |d_m|^2; mix = the mixture of least |mean d|^2, picked "
                  "= mean weights), judged on the other salts; bias^2 / err@10, mean over groups:", "",
                  "| c | rule | picked | the pick | " + " | ".join(f"`{n}` fixed" for n in names) + " |",
                  "|---" * (4 + len(names)) + "|"]  # fmt: skip
        for c, r in cal.items():
            fixed = " | ".join(f"{v['bias2']:.3g} / {v['err@10']:.3g}" for v in r["fixed"].values())
            for rule in ("pooled", "window", "mix") if int(c) > 1 else ("pooled", "mix"):
                if rule not in r:  # results written before the mix rule
                    continue
                x = r[rule]
                picked = ", ".join(f"{n} {f:.0%}" for n, f in x["picks"].items() if f > 0.005)
                label = rule if int(c) > 1 or rule == "mix" else "one batch"
                lines.append(f"| {c} | {label} | {picked} | {x['bias2']:.3g} / {x['err@10']:.3g} | {fixed} |")
    return "\n".join(lines)


def _state(start: str) -> str:
    """A measured state, as `start` names it (RUN:STEP, or 'warm start'), with the run's folder resolved."""
    run, sep, step = start.rpartition(":")
    return f"{Path(run).resolve()}:{step}" if sep else start


def main(preset: str | None, quant: str, seed: int | None, salts: int, methods: list[str], start: str,
         horizons: list[int], choose: list[str] | None = None, space: str = "grad",
         label: str = "", alpha_max: float = 1.0) -> dict:  # fmt: skip
    """preset: the warm start's (default lab_columns); with `start`, only for a run whose config.json does not load.
    space: `grad` (the raw gradients) or `adam` (each as the optimizer would apply it: adam_space).
    label: appended to the results' name (the `tag=` argument).
    alpha_max: how far along the none-TIS line to look for the best alpha (1: the segment AIS draws from)."""
    if space not in ("grad", "adam"):
        raise ValueError(f"space={space!r}: choose grad (the raw gradient) or adam (the update AdamW makes of it)")
    if not 1.0 <= alpha_max <= 10.0:
        raise ValueError(f"alpha_max={alpha_max}: the none-TIS line is searched over [0, alpha_max]; give 1 to 10")
    if salts < 3:  # a variance needs two draws, and its jackknife one more
        raise ValueError(f"salts={salts}: need at least 3 (32 give standard errors of a useful size)")
    if not horizons or min(horizons) < 1 or 10 not in horizons:  # the tables report err@10
        raise ValueError(f"horizons={horizons}: steps the error is averaged over, each >= 1, 10 among them")
    unknown = sorted({m.partition(":")[0] for m in methods} - set(CORRECTIONS))
    if unknown:
        raise ValueError(f"unknown correction(s) {unknown} in methods; choose from {sorted(CORRECTIONS)}")
    if len(set(methods)) < len(methods):  # one method's gradients would pair with another salt's reference
        raise ValueError(f"methods={methods} names a method twice; name each once")
    quant_config(quant)  # an unknown format, named before the warm start is built
    if choose and not set(choose) <= set(methods):
        raise ValueError(f"choose={choose}: the end points to choose from must be among methods={methods}")
    preset_name = preset or "lab_columns"  # names the results; the warm start's preset
    base, at = preset_name, None
    if start:
        run, _, step = start.rpartition(":")
        if not run or not step.isdigit():
            raise ValueError(f"start={start!r}: give RUN:STEP, a run folder and one of its checkpoint steps")
        base, at = recorded_base(Path(run), preset or ""), (run, int(step))
    recorded = json.loads(Path(base).read_text())["seed"] if base.endswith(".json") else 0
    if seed is None:  # the run's own training pool and prompts, or seed 0's at the warm start
        seed = recorded
    tag = f"_seed{seed}" if seed else ""  # seed 0 at the warm start keeps the first results' name
    if start:  # another seed than the run's own samples another prompt batch: it must not share the run's name
        tag = "_" + "_".join(Path(start.rsplit(":", 1)[0]).parts[-3:]) + f"_{at[1]}"
        tag += f"_seed{seed}" if seed != recorded else ""
    tag += ("_adam" if space == "adam" else "") + (f"_{label}" if label else "")
    path = ROOT / "benchmarks" / "results" / f"gradient_bias_{preset_name}_{quant}{tag}.json"
    earlier = json.loads(path.read_text()) if path.exists() else {}
    held = earlier.get("start")
    if held is not None and _state(held) != _state(start or "warm start"):  # the name keeps a run path's last parts
        raise ValueError(f"{path.relative_to(ROOT)} holds the measurement of another state ({held}); pass tag=NAME "
                         "to write this one beside it")  # fmt: skip
    if earlier:  # a smoke run (fewer salts, the default methods) must not replace a published measurement
        held_methods = earlier.get("methods") or [k for k in earlier["results"] if k.partition(":")[0] in CORRECTIONS]
        if earlier["salts"] != salts or sorted(held_methods) != sorted(methods):
            raise ValueError(f"{path.relative_to(ROOT)} holds a measurement with other settings (salts="
                             f"{earlier['salts']} methods={','.join(held_methods)}); give those to measure it again, "
                             "or pass tag=NAME to write this one beside it")  # fmt: skip
    common = [f"seed={seed}"]
    g_ref, g, rows = [], {m: [] for m in methods}, {m: [] for m in methods}
    t0 = time.perf_counter()
    for k in range(salts):
        _, gr = one_step(base, [*common, f"sample_salt={k}", "rollout.quant=none", "correction.name=none"], start=at)
        g_ref.append(gr)
        for m in methods:
            name, _, opts = m.partition(":")  # e.g. tis:cap=100 -> correction.name=tis correction.cap=100
            extra = [f"correction.{o}" for o in opts.split("+") if o]
            row, gm = one_step(base, [*common, f"sample_salt={k}", f"rollout.quant={quant}", f"correction.name={name}",
                                      *extra], start=at)  # fmt: skip
            g[m].append(gm)
            rows[m].append(row)
        print(f"salt {k}: {time.perf_counter() - t0:.0f} s", flush=True)
    vecs = {"ref": torch.stack(g_ref), **{m: torch.stack(v) for m, v in g.items()}}  # (K, P) each
    if space == "adam":
        vecs = {m: adam_space(v, at) for m, v in vecs.items()}
    res = measure(vecs.pop("ref"), vecs, horizons, choose, segment=space == "grad", alpha_max=alpha_max)
    for m in methods:  # the batch statistics the runs logged, averaged over salts
        for key in ("k3_kl", "ess", "alpha"):
            vals = [r[key] for r in rows[m] if r.get(key) is not None]
            if vals:
                res[m][key] = statistics.fmean(vals)
    for name, r in res.items():
        if isinstance(r, dict) and name != "calibration":
            print(f"{name:>10}: " + "  ".join(f"{k} {v:.4g}" for k, v in r.items()))
    out = {"preset": preset_name, "quant": quant, "seed": seed, "salts": salts, "methods": methods,
           "start": start or "warm start", "space": space, "results": res, "seconds": time.perf_counter() - t0,
           "machine": machine(), "command": command(__file__)}  # fmt: skip
    write_json(path, out)
    update_section(ROOT / "BENCHMARKS.md", f"gradient_bias_{preset_name}_{quant}{tag}", section(out))
    return out


KEYS = ("preset", "quant", "seed", "salts", "methods", "start", "horizons", "choose", "space", "tag", "alpha_max")

if __name__ == "__main__":
    _, kw = options(sys.argv[1:], KEYS)
    main(kw.get("preset"), kw.get("quant", "mxfp4_w4a4"), number(kw, "seed", None, low=0),
         number(kw, "salts", 16, low=3), kw.get("methods", "none,tis,prefix_tis,seq_tis").split(","),
         kw.get("start", ""), numbers(kw, "horizons", [1, 10, 100], low=1),
         kw["choose"].split(",") if "choose" in kw else None, kw.get("space", "grad"), kw.get("tag", ""),
         number(kw, "alpha_max", 1.0, float))  # fmt: skip
