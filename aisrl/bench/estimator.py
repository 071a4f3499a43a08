"""Exact-gradient benchmark of mismatch corrections (DESIGN.md section 8.1).

Why: whether a correction helps is a statement about the mean-squared error of the policy-gradient
estimate, which on a real model cannot be measured (the exact gradient is unknown). Here it can.

Setup. A tabular autoregressive softmax policy over a vocabulary of V tokens and sequences of length
L: one row of logits per prefix, so pi(y) = prod_t softmax(theta[prefix_t])[y_t] and all V^L sequences
can be enumerated. Logits are `sharpness * z` (z ~ N(0, 1)); large sharpness models a concentrated,
late-training policy. The rollout policy mu has logits theta + strength * eps (eps ~ N(0, 1)), a stand-in
for low-precision noise. Each sequence has a fixed random Bernoulli reward, and the objective is
J = E_pi[R] with exact gradient sum_y pi(y) R(y) grad log pi(y) (autograd over the enumeration).

Estimators. A batch has N = B * G sequences sampled from mu in B groups of G; the advantage is the
leave-one-out group baseline A_i = R_i - mean_{j != i in group} R_j (unbiased on-policy), and

    g_hat = (1 / N) sum_i sum_t omega_it A_i grad log pi(y_it | y_i,<t)

is the gradient of the GRPO surrogate at r = 1 with seq-mean-token-sum aggregation, with omega from
`aisrl.correction.correct(name, ...)` - the real code under test, called once per batch. We report
relative MSE over many batches and several random instances per sweep point, pooled as
sum_instances E||g_hat - g||^2 / sum_instances ||g||^2, for each correction and for the oracle: the best
fixed interpolation (1 - a) g_none + a g_tis, with a* the exact quadratic minimiser chosen separately for
each instance (a stricter baseline than one alpha per point).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import asdict, dataclass, field

import torch

from aisrl.correction import correct


@dataclass
class EstimatorBenchConfig:
    vocab: int = 5
    """Vocabulary size V of the tabular policy."""
    length: int = 4
    """Sequence length L (V^L sequences are enumerated)."""
    groups: int = 8
    """Prompts per batch B (groups); all share one tabular policy."""
    group_size: int = 8
    """Samples per group G; the batch has N = B * G sequences."""
    batches: int = 120
    """Sampled batches per sweep point and instance."""
    instances: int = 10
    """Random (policy, perturbation, reward) instances per sweep point; MSEs are averaged over them."""
    strengths: list[float] = field(default_factory=lambda: [0.05, 0.2, 0.5, 1.0])
    """Mismatch strengths: std of the logit perturbation of mu."""
    sharpness: list[float] = field(default_factory=lambda: [0.5, 1.5, 3.0])
    """Scale of the policy logits (higher is sharper)."""
    reward_p: float = 0.3
    """Probability that a sequence is rewarded (R = 1)."""
    cap: float = 2.0
    """Truncation cap C for tis / seq_tis / ais."""
    methods: list[str] = field(default_factory=lambda: ["none", "tis", "seq_tis", "icepop", "ais"])
    """Corrections to evaluate (any name in aisrl.correction.CORRECTIONS)."""
    variants: list[str] = field(default_factory=lambda: ["c4", "design", "no_rho", "sqrt_n", "c8", "c16"])
    """Alternative alpha formulas (names in aisrl.bench.variants.VARIANTS) scored on the same batches."""
    seed: int = 0
    """Seed of everything."""


class TabularPolicy:
    """All V^L sequences of an autoregressive tabular policy, with their prefix rows."""

    def __init__(self, vocab: int, length: int):
        self.V, self.L = vocab, length
        seqs = torch.tensor(list(itertools.product(range(vocab), repeat=length)))  # (S, L)
        offsets = [sum(vocab**k for k in range(t)) for t in range(length)]
        rows = torch.zeros_like(seqs)  # (S, L): row index of the prefix y_<t
        code = torch.zeros(len(seqs), dtype=torch.long)
        for t in range(length):
            rows[:, t] = offsets[t] + code
            code = code * vocab + seqs[:, t]
        self.seqs, self.rows = seqs, rows
        self.num_rows = sum(vocab**k for k in range(length))

    def token_logp(self, logits: torch.Tensor) -> torch.Tensor:
        """(P, V) logits -> (S, L) log-prob of each token of each sequence."""
        lp = logits.log_softmax(-1)  # (P, V)
        return lp[self.rows, self.seqs]


def _instance(cfg: EstimatorBenchConfig, pol: TabularPolicy, sharp: float, strength: float, gen):
    z = torch.randn(pol.num_rows, pol.V, generator=gen, dtype=torch.float64)
    eps = torch.randn(pol.num_rows, pol.V, generator=gen, dtype=torch.float64)
    reward = (torch.rand(len(pol.seqs), generator=gen, dtype=torch.float64) < cfg.reward_p).double()
    theta = (sharp * z).requires_grad_(True)
    logp_pi = pol.token_logp(theta)  # (S, L)
    (grad,) = torch.autograd.grad((logp_pi.sum(-1).exp() * reward).sum(), theta)  # exact dJ/dtheta
    grad = grad.reshape(-1)  # (P*V,)
    theta = theta.detach()
    logp_pi = logp_pi.detach()
    logp_mu = pol.token_logp(theta + strength * eps)  # (S, L)
    return theta, logp_pi, logp_mu, reward, grad


def _batch_gradients(pol, theta, idx, coef):
    """(K, N) sampled sequence ids and (K, N, L) per-token coefficients -> (K, P*V) gradients."""
    K, N = idx.shape
    P, V = theta.shape
    probs = theta.softmax(-1)  # (P, V)
    rows, toks = pol.rows[idx], pol.seqs[idx]  # (K, N, L)
    k = torch.arange(K)[:, None, None].expand_as(rows)
    g = torch.zeros(K, P, V, dtype=torch.float64)
    g.index_put_((k, rows, toks), coef, accumulate=True)  # the one-hot part of the score
    row_coef = torch.zeros(K, P, dtype=torch.float64)
    row_coef.index_put_((k, rows), coef, accumulate=True)
    g -= row_coef[..., None] * probs[None]  # minus coef * pi(.|prefix)
    return (g / N).reshape(K, P * V)


def run_point(cfg: EstimatorBenchConfig, pol: TabularPolicy, sharp: float, strength: float, gen):
    """Relative MSE of every method (and oracle alpha*) at one sweep point, one instance."""
    theta, logp_pi, logp_mu, reward, grad = _instance(cfg, pol, sharp, strength, gen)
    K, B, G = cfg.batches, cfg.groups, cfg.group_size
    N = B * G
    mu_seq = logp_mu.sum(-1).exp()  # (S,)
    idx = torch.multinomial(mu_seq.float().expand(K, -1), N, replacement=True, generator=gen)  # (K, N)
    r = reward[idx].view(K, B, G)
    adv = (r - (r.sum(-1, keepdim=True) - r) / (G - 1)).view(K, N)  # leave-one-out baseline
    old, roll = logp_pi[idx].float(), logp_mu[idx].float()  # (K, N, L)
    mask = torch.ones(N, pol.L, dtype=torch.bool)
    norm2 = grad.pow(2).sum()
    out, grads, diag_rows = {}, {}, []
    for name in cfg.methods:
        opts = {"cap": cfg.cap} if name in ("tis", "seq_tis", "ais") else {}
        weights, keeps = [], []
        for k in range(K):
            res = correct(name, old[k], roll[k], mask, **opts)
            weights.append(res.weights)
            keeps.append(res.mask)
            if name == "ais":
                diag_rows.append([res.metrics[key].item() for key in DIAG_KEYS])
        omega = torch.stack(weights).double() * torch.stack(keeps)  # (K, N, L)
        grads[name] = _batch_gradients(pol, theta, idx, omega * adv[..., None])  # (K, P*V)
    w1 = (old - roll).exp().clamp(max=cfg.cap).double()
    g0 = _batch_gradients(pol, theta, idx, adv[..., None].expand(K, N, pol.L).clone())
    g1 = _batch_gradients(pol, theta, idx, w1 * adv[..., None])
    d0, d01 = g0 - grad, g0 - g1  # the interpolation's error: g(a) - grad = d0 - a * d01

    def mse(a: torch.Tensor | float) -> float:  # a: scalar or (K,) per-batch alpha
        a = torch.as_tensor(a, dtype=torch.float64).reshape(-1, 1)
        return (d0 - a * d01).pow(2).sum(-1).mean().item()

    for name, g in grads.items():
        out[name] = (g - grad).pow(2).sum(-1).mean().item()
    for name, a in (("none", 0.0), ("tis", 1.0)):  # the interpolation's end points
        if name in grads:  # the real correction must give exactly the end point
            assert math.isclose(out[name], mse(a), rel_tol=1e-4), (name, out[name], mse(a))
        out.setdefault(name, mse(a))
    a_star = ((d0 * d01).sum() / d01.pow(2).sum().clamp(min=1e-300)).clamp(0.0, 1.0)
    out["oracle"] = mse(a_star)
    diag = {"oracle_alpha": a_star.item(), "grad_norm2": norm2.item(), "seq_ess": _seq_ess(old - roll),
            "k3_kl": ((old - roll).exp() - 1 - (old - roll)).mean().item()}  # fmt: skip
    if diag_rows:
        d = torch.tensor(diag_rows, dtype=torch.float64)  # (K, len(DIAG_KEYS))
        alpha = d[:, DIAG_KEYS.index("alpha")]
        # The real AIS gradient must be the exact interpolation at its own alpha.
        assert torch.allclose(grads["ais"], g0 - alpha[:, None] * d01, rtol=1e-4, atol=1e-6 * norm2.sqrt())
        diag["ais_alpha_mean"] = alpha.mean().item()
        cols = {key: d[:, i] for i, key in enumerate(DIAG_KEYS)}
        for vname, fn in cfg_variants(cfg).items():
            a = fn(cols["weight_reliability"], cols["divergence_severity"], cols["variance_amplification"],
                   cols["num_seqs"], cols["num_tokens"]).clamp(0.0, 1.0)  # fmt: skip
            out[f"variant:{vname}"] = mse(a)
            diag[f"alpha:{vname}"] = a.mean().item()
    return out, diag


DIAG_KEYS = ["weight_reliability", "divergence_severity", "variance_amplification", "num_seqs", "num_tokens", "alpha"]


def cfg_variants(cfg: EstimatorBenchConfig) -> dict:
    """Alternative alpha formulas evaluated on the same batches (see docs/ais.md)."""
    from aisrl.bench.variants import VARIANTS

    return {k: VARIANTS[k] for k in cfg.variants}


def _seq_ess(delta: torch.Tensor) -> float:
    lw = delta.sum(-1)  # (K, N)
    return ((2 * lw.logsumexp(-1) - (2 * lw).logsumexp(-1)).exp() / lw.shape[-1]).mean().item()


def run(cfg: EstimatorBenchConfig) -> dict:
    """Full sweep; returns a JSON-able dict with per-point results and the headline ratios."""
    gen = torch.Generator().manual_seed(cfg.seed)
    pol = TabularPolicy(cfg.vocab, cfg.length)
    t0 = time.perf_counter()
    points = []
    for sharp, strength in itertools.product(cfg.sharpness, cfg.strengths):
        mses, diags = [], []
        for _ in range(cfg.instances):
            m, d = run_point(cfg, pol, sharp, strength, gen)
            mses.append(m)
            diags.append(d)
        # Pooled relative MSE: sum of squared errors over instances / sum of |g|^2. A per-instance ratio
        # would let an instance whose exact gradient is ~0 (a reward plateau) dominate the point.
        norm2 = sum(d["grad_norm2"] for d in diags)
        mse = {k: sum(m[k] for m in mses) / norm2 for k in mses[0]}
        diag = {k: sum(d[k] for d in diags) / len(diags) for k in diags[0]}
        points.append({"sharpness": sharp, "strength": strength, "mse": mse, **diag})
    summary = summarize(points)
    return {"config": asdict(cfg), "points": points, "summary": summary, "seconds": time.perf_counter() - t0}


def summarize(points: list[dict]) -> dict:
    """Headline numbers: mean MSE(x)/MSE(oracle) and worst MSE(x)/min(MSE(none), MSE(tis)) per estimator."""
    out = {}
    for key in points[0]["mse"]:
        to_oracle = [p["mse"][key] / p["mse"]["oracle"] for p in points]
        to_best = [p["mse"][key] / min(p["mse"]["none"], p["mse"]["tis"]) for p in points]
        out[key] = {"over_oracle_mean": sum(to_oracle) / len(to_oracle), "over_best_fixed_max": max(to_best)}
    if "ais" in out:
        out["ais_over_oracle_mean"] = out["ais"]["over_oracle_mean"]
        out["ais_over_best_of_none_tis_max"] = out["ais"]["over_best_fixed_max"]
    return out


def markdown(result: dict) -> str:
    """Markdown tables of the sweep (relative gradient MSE; lower is better) and of the summary."""
    methods = [k for k in result["points"][0]["mse"] if not k.startswith("variant:")]
    head = "| sharpness | strength | k3 KL | seq ESS/N | " + " | ".join(methods)
    head += " | alpha* | mean AIS alpha |\n" + "|" + "---|" * (len(methods) + 6) + "\n"
    rows = []
    for p in result["points"]:
        best = min(p["mse"][k] for k in methods if k != "oracle")
        cells = [f"**{p['mse'][k]:.4f}**" if p["mse"][k] == best else f"{p['mse'][k]:.4f}" for k in methods]
        rows.append(
            f"| {p['sharpness']} | {p['strength']} | {p['k3_kl']:.4f} | {p['seq_ess']:.3f} | "
            + " | ".join(cells)
            + f" | {p['oracle_alpha']:.2f} | {p.get('ais_alpha_mean', float('nan')):.2f} |"
        )
    summary = "\n\n| estimator | mean MSE / MSE(oracle alpha*) | worst MSE / min(MSE none, MSE tis) |\n"
    summary += "|---|---|---|\n"
    for key, v in result["summary"].items():
        if isinstance(v, dict) and key != "oracle":
            summary += f"| {key} | {v['over_oracle_mean']:.3f} | {v['over_best_fixed_max']:.3f} |\n"
    return head + "\n".join(rows) + summary


def main(cfg: EstimatorBenchConfig | None = None, out: str | None = None) -> dict:
    """Run the sweep, print the table, write JSON (with the machine it ran on) to `out`."""
    from aisrl.bench.report import machine, write_json

    cfg = cfg or EstimatorBenchConfig()
    result = run(cfg)
    result["machine"] = machine()
    print(markdown(result))
    print(f"({result['seconds']:.0f} s)")
    if out:
        write_json(out, result)
    return result


if __name__ == "__main__":
    main()
