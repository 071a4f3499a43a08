"""Exact-gradient benchmark of mismatch corrections (docs/ais.md section 3).

Why: whether a correction helps is a statement about the mean-squared error of the policy-gradient
estimate, which on a real model cannot be measured (the exact gradient is unknown). Here it can.

Setup. A tabular autoregressive softmax policy over a vocabulary of V tokens and sequences of length
L: one row of logits per prefix, so pi(y) = prod_t softmax(theta[prefix_t])[y_t] and all V^L sequences
can be enumerated. Logits are `sharpness * z` (z ~ N(0, 1)); large sharpness models a concentrated,
late-training policy. The rollout policy mu has logits theta + strength * eps (eps ~ N(0, 1)), a stand-in
for low-precision noise. Each sequence has a fixed random Bernoulli reward, and the objective is
J = E_pi[R] with exact gradient sum_y pi(y) R(y) grad log pi(y) (autograd over the enumeration).
`policy=markov` replaces it by a first-order Markov policy over long sequences whose reward couples all
tokens (MarkovPolicy: exact gradient by a recursion instead of an enumeration).

Estimators. A batch has N = B * G sequences sampled from mu in B groups of G; the advantage is the
leave-one-out group baseline A_i = R_i - mean_{j != i in group} R_j (unbiased on-policy), and

    g_hat = (1 / N) sum_i sum_t omega_it A_i grad log pi(y_it | y_i,<t)

is the gradient of the GRPO surrogate at r = 1 with seq-mean-token-sum aggregation, with omega from
`aisrl.correction.correct(name, ...)` - the real code under test, called once per batch for AIS (whose
alpha depends on the batch) and once for all batches for the per-token and per-sequence rules. We report
relative MSE over many batches and several random instances per sweep point, pooled as
sum_instances E||g_hat - g||^2 / sum_instances ||g||^2, for each correction and for the oracle: the best
fixed interpolation (1 - a) g_none + a g_tis, with a* the exact quadratic minimiser chosen separately for
each instance (a stricter baseline than one alpha per point).

Over a run the per-step MSE is not the whole story: a bias that keeps its direction adds up over h steps
while the noise of h batches averages out. Each estimator's error is therefore also split into squared
bias and per-batch variance, and `horizons` reports bias^2 + variance / h (docs/ais.md section 4).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch

from aisrl.correction import correct, options_of


@dataclass
class EstimatorBenchConfig:
    vocab: int = 5
    """Vocabulary size V of the test policy."""
    length: int = 4
    """Sequence length L (tabular: V^L sequences are enumerated, so keep it short; markov: any)."""
    groups: int = 8
    """Prompts per batch B (groups); all share one test policy."""
    group_size: int = 8
    """Samples per group G; the batch has N = B * G sequences."""
    batches: int = 120
    """Sampled batches per sweep point and instance (>= 2: the variance is estimated across them)."""
    instances: int = 10
    """Random (policy, perturbation, reward) instances per sweep point; their errors are pooled (summed squared errors
    over summed |g|^2)."""
    strengths: list[float] = field(default_factory=lambda: [0.05, 0.2, 0.5, 1.0])
    """Mismatch strengths: std of the logit perturbation of mu."""
    sharpness: list[float] = field(default_factory=lambda: [0.5, 1.5, 3.0])
    """Scale of the policy logits (higher is sharper)."""
    reward_p: float = 0.3
    """Probability that a sequence is rewarded (R = 1); markov: the target of P_pi(count >= k)."""
    cap: float = 2.0
    """Truncation cap C for tis / seq_tis / prefix_tis / suffix_tis / ais."""
    methods: list[str] = field(default_factory=lambda: ["none", "tis", "seq_tis", "icepop", "ais"])
    """Corrections to evaluate (any name in aisrl.correction.CORRECTIONS)."""
    variants: list[str] = field(default_factory=lambda: ["c4", "design", "no_rho", "sqrt_n", "c8", "c16"])
    """Alternative alpha formulas (names in aisrl.bench.variants.VARIANTS) scored on the same batches."""
    seed: int = 0
    """Seed of everything."""
    horizons: list[int] = field(default_factory=lambda: [1])
    """Steps h over which gradient noise averages out: the MSE at h is bias^2 + variance / h (h = 1 is
    one step's MSE, the headline); each h adds the oracle interpolation at that horizon ('oracle@h')."""
    policy: str = "tabular"
    """Test policy: 'tabular' (all V^L sequences enumerated, a random reward per sequence; short L) or
    'markov' (first-order Markov, reward for at least k tokens 0, exact gradient by recursion; any L)."""


class Draw(NamedTuple):
    """One instance and its K sampled batches, as the estimator sees them."""

    theta: torch.Tensor  # (P, V) logits of pi, one row per prefix state
    rows: torch.Tensor  # (K, N, L) prefix-state row of each sampled token
    toks: torch.Tensor  # (K, N, L) sampled tokens
    old: torch.Tensor  # (K, N, L) float32 log pi of each sampled token
    roll: torch.Tensor  # (K, N, L) float32 log mu of each sampled token
    reward: torch.Tensor  # (K, N) float64 rewards of the sampled sequences
    grad: torch.Tensor  # (P * V,) exact gradient of J = E_pi[R]


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

    def draw(self, cfg: EstimatorBenchConfig, sharp: float, strength: float, gen) -> Draw:
        """A random instance and cfg.batches batches of N sequences sampled from its mu."""
        theta, logp_pi, logp_mu, reward, grad = _instance(cfg, self, sharp, strength, gen)
        mu_seq = logp_mu.sum(-1).exp()  # (S,)
        K, N = cfg.batches, cfg.groups * cfg.group_size
        idx = torch.multinomial(mu_seq.float().expand(K, -1), N, replacement=True, generator=gen)  # (K, N)
        old, roll = logp_pi[idx].float(), logp_mu[idx].float()  # (K, N, L)
        return Draw(theta, self.rows[idx], self.seqs[idx], old, roll, reward[idx], grad)


class MarkovPolicy:
    """A first-order Markov policy over long sequences, whose exact gradient comes from dynamic programming.

    Token t is drawn from softmax(theta[row(t, y_{t-1})]), one row per (position, previous token), with a
    start symbol V before the first token. The reward is 1 when at least k of the L tokens are token 0 ("k
    steps right"), k chosen per instance so that P_pi(R = 1) is as close as possible to cfg.reward_p; it
    couples every token of a sequence, as a final-answer reward does. J = P_pi(count >= k) is computed
    exactly by a forward recursion over (previous token, count), so L can be as long as real completions.
    """

    def __init__(self, vocab: int, length: int):
        self.V, self.L = vocab, length
        self.num_rows = length * (vocab + 1)

    def _count_dist(self, theta: torch.Tensor) -> torch.Tensor:
        """(L+1,) distribution of the number of 0 tokens under softmax(theta); differentiable."""
        V, L = self.V, self.L
        probs = theta.softmax(-1).view(L, V + 1, V)  # (L, prev, next)
        state = torch.zeros(V + 1, L + 1, dtype=theta.dtype)  # (prev, count)
        state[V, 0] = 1.0
        for t in range(L):
            nxt = torch.einsum("pc,py->yc", state, probs[t])  # (V, L+1) before counting token 0
            zero = torch.cat([nxt.new_zeros(1, 1), nxt[:1, :-1]], dim=1)  # token 0 adds one to the count
            state = torch.cat([zero, nxt[1:], nxt.new_zeros(1, L + 1)])  # the start row stays empty
        return state.sum(0)

    def _sample(self, logits: torch.Tensor, n: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
        """n sequences from softmax(logits) -> (n, L) rows and tokens."""
        V = self.V
        probs = logits.softmax(-1).float()  # (P, V)
        rows = torch.empty(n, self.L, dtype=torch.long)
        toks = torch.empty(n, self.L, dtype=torch.long)
        prev = torch.full((n,), V, dtype=torch.long)
        for t in range(self.L):
            rows[:, t] = t * (V + 1) + prev
            toks[:, t] = prev = torch.multinomial(probs[rows[:, t]], 1, generator=gen).squeeze(-1)
        return rows, toks

    def draw(self, cfg: EstimatorBenchConfig, sharp: float, strength: float, gen) -> Draw:
        """A random instance and cfg.batches batches of N sequences sampled from its mu."""
        z = torch.randn(self.num_rows, self.V, generator=gen, dtype=torch.float64)
        eps = torch.randn(self.num_rows, self.V, generator=gen, dtype=torch.float64)
        theta = (sharp * z).requires_grad_(True)
        dist = self._count_dist(theta)  # (L+1,)
        tail = dist.flip(0).cumsum(0).flip(0)  # (L+1,) P(count >= k)
        k = int((tail.detach() - cfg.reward_p).abs().argmin())
        (grad,) = torch.autograd.grad(tail[k], theta)  # exact dJ/dtheta
        theta = theta.detach()
        K, N = cfg.batches, cfg.groups * cfg.group_size
        mu = theta + strength * eps  # (P, V) logits of the rollout policy
        rows, toks = self._sample(mu, K * N, gen)  # (K*N, L)
        old = theta.log_softmax(-1)[rows, toks]  # (K*N, L)
        roll = mu.log_softmax(-1)[rows, toks]
        reward = ((toks == 0).sum(-1) >= k).double()  # (K*N,)
        shape = (K, N, self.L)
        return Draw(theta, rows.view(shape), toks.view(shape), old.float().view(shape), roll.float().view(shape),
                    reward.view(K, N), grad.reshape(-1))  # fmt: skip


POLICIES = {"tabular": TabularPolicy, "markov": MarkovPolicy}


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


def _batch_gradients(theta, rows, toks, coef):
    """(K, N, L) prefix rows, tokens and per-token coefficients -> (K, P*V) gradients."""
    K, N, _ = rows.shape
    P, V = theta.shape
    probs = theta.softmax(-1)  # (P, V)
    k = torch.arange(K)[:, None, None].expand_as(rows)
    g = torch.zeros(K, P, V, dtype=torch.float64)
    g.index_put_((k, rows, toks), coef, accumulate=True)  # the one-hot part of the score
    row_coef = torch.zeros(K, P, dtype=torch.float64)
    row_coef.index_put_((k, rows), coef, accumulate=True)
    g -= row_coef[..., None] * probs[None]  # minus coef * pi(.|prefix)
    return (g / N).reshape(K, P * V)


def run_point(cfg: EstimatorBenchConfig, pol, sharp: float, strength: float, gen):
    """Relative MSE of every method (and oracle alpha*) at one sweep point, one instance."""
    d = pol.draw(cfg, sharp, strength, gen)
    theta, grad, old, roll = d.theta, d.grad, d.old, d.roll
    K, B, G = cfg.batches, cfg.groups, cfg.group_size
    N, L = B * G, d.rows.shape[-1]
    r = d.reward.view(K, B, G)
    adv = (r - (r.sum(-1, keepdim=True) - r) / (G - 1)).view(K, N)  # leave-one-out baseline
    mask = torch.ones(N, L, dtype=torch.bool)
    norm2 = grad.pow(2).sum()

    def batch_grads(coef):
        return _batch_gradients(theta, d.rows, d.toks, coef)

    out, grads, diag_rows = {}, {}, []
    for name in cfg.methods:
        opts = {"cap": cfg.cap} if "cap" in options_of(name) else {}
        if name in BATCH_LEVEL:  # one call per batch: the correction depends on batch statistics
            weights, keeps = [], []
            for k in range(K):
                res = correct(name, old[k], roll[k], mask, **opts)
                weights.append(res.weights)
                keeps.append(res.mask)
                if name == "ais":
                    diag_rows.append([res.metrics[key].item() for key in DIAG_KEYS])
            omega = torch.stack(weights).double() * torch.stack(keeps)  # (K, N, L)
        else:  # token and sequence rules: all K batches in one call
            res = correct(name, old.view(K * N, L), roll.view(K * N, L), mask.repeat(K, 1), **opts)
            omega = (res.weights.double() * res.mask).view(K, N, L)
        grads[name] = batch_grads(omega * adv[..., None])  # (K, P*V)
    w1 = (old - roll).exp().clamp(max=cfg.cap).double()
    g0 = batch_grads(adv[..., None].expand(K, N, L).clone())
    g1 = batch_grads(w1 * adv[..., None])
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
    split = {name: _bias_variance(g, grad) for name, g in {"none": g0, "tis": g1, **grads}.items()}
    horizon = {f"oracle@{h}": _oracle_at_horizon(d0, d01, h) for h in cfg.horizons if h != 1}
    diag = {"oracle_alpha": a_star.item(), "grad_norm2": norm2.item(), "seq_ess": _seq_ess(old - roll),
            **{f"bias2:{k}": b for k, (b, _) in split.items()}, **{f"var:{k}": v for k, (_, v) in split.items()},
            **horizon,
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


def _bias_variance(g: torch.Tensor, grad: torch.Tensor) -> tuple[float, float]:
    """(K, D) batch gradients -> (squared bias of their mean, unbiased; variance of one batch's gradient)."""
    K = g.shape[0]
    var = (g - g.mean(0)).pow(2).sum() / (K - 1)
    return ((g.mean(0) - grad).pow(2).sum() - var / K).item(), var.item()


def _oracle_at_horizon(d0: torch.Tensor, d01: torch.Tensor, h: int) -> float:
    """min over a in [0, 1] of bias^2 + var / h along g(a) - grad = d0 - a d01 (bias and var as above).

    Over a run, a bias that keeps its direction adds up step after step while the noise of h steps
    averages out, so h = 1 is the MSE of one step and a large h is what matters over h steps.
    """
    K = d0.shape[0]
    e0, e1 = d0.mean(0), d01.mean(0)
    c0, c1 = d0 - e0, d01 - e1
    v00, v01, v11 = (c0 * c0).sum() / (K - 1), (c0 * c1).sum() / (K - 1), (c1 * c1).sum() / (K - 1)
    c = 1.0 / h - 1.0 / K

    def f(a: float) -> float:
        return ((e0 - a * e1).pow(2).sum() + c * (v00 - 2 * a * v01 + a * a * v11)).item()

    den = (e1.pow(2).sum() + c * v11).item()
    a = min(max(((e0 * e1).sum() + c * v01).item() / den, 0.0), 1.0) if den > 0 else 0.0
    return min(f(a), f(0.0), f(1.0))


POOLED = ("bias2:", "var:", "oracle@")
"""Per-point keys pooled like the MSE (summed over instances, divided by the summed |g|^2)."""
BATCH_LEVEL = {"ais"}
"""Corrections whose weights depend on the whole batch. The rest are applied to all batches at once, which
is exact because run_point never passes `normalize` (the one batch-level option they have)."""
DIAG_KEYS = ["weight_reliability", "divergence_severity", "variance_amplification", "num_seqs", "num_tokens", "alpha"]


def cfg_variants(cfg: EstimatorBenchConfig) -> dict:
    """Alternative alpha formulas evaluated on the same batches (see docs/ais.md)."""
    from aisrl.bench.variants import VARIANTS

    return {k: VARIANTS[k] for k in cfg.variants}


def _seq_ess(delta: torch.Tensor) -> float:
    lw = delta.sum(-1)  # (K, N)
    return ((2 * lw.logsumexp(-1) - (2 * lw).logsumexp(-1)).exp() / lw.shape[-1]).mean().item()


TABULAR_LIMIT = 2**20
"""The most sequences (V^L) the tabular policy enumerates; longer ones are the Markov policy's work."""


def check(cfg: EstimatorBenchConfig) -> None:
    """Raise a ValueError naming the setting, before anything runs, for settings the sweep cannot run."""
    from aisrl.bench.variants import VARIANTS
    from aisrl.correction import CORRECTIONS

    if cfg.policy not in POLICIES:
        raise ValueError(f"unknown policy {cfg.policy!r}; choose from {sorted(POLICIES)}")
    if cfg.batches < 2 or any(h < 1 for h in cfg.horizons):
        raise ValueError(f"need batches >= 2 and every horizon >= 1; got batches={cfg.batches}, "
                         f"horizons={cfg.horizons}")  # fmt: skip
    for key, names, valid in (("methods", cfg.methods, CORRECTIONS), ("variants", cfg.variants, VARIANTS)):
        unknown = sorted(set(names) - set(valid))
        if unknown:
            raise ValueError(f"unknown {key} {unknown}; choose from {sorted(valid)}")
    if cfg.variants and "ais" not in cfg.methods:
        raise ValueError(f"variants {cfg.variants} are scored from AIS's diagnostics of each batch: add ais to "
                         "methods, or drop variants")  # fmt: skip
    for key, low in (("vocab", 2), ("length", 1), ("groups", 1), ("group_size", 2), ("instances", 1)):
        if getattr(cfg, key) < low:
            raise ValueError(f"{key} must be >= {low}, got {getattr(cfg, key)}")
    if not cfg.strengths or not cfg.sharpness:
        raise ValueError("strengths and sharpness each need at least one value, e.g. strengths=[0.2]")
    if not all(math.isfinite(x) for x in [*cfg.strengths, *cfg.sharpness]):
        raise ValueError(f"strengths and sharpness must be finite; got {cfg.strengths} and {cfg.sharpness}")
    if not 0 < cfg.reward_p < 1 or not cfg.cap > 0:  # at reward_p 0 or 1 every reward is equal: no gradient
        raise ValueError(f"need 0 < reward_p < 1 (the chance of reward 1) and cap > 0; got reward_p={cfg.reward_p}, "
                         f"cap={cfg.cap}")  # fmt: skip
    if cfg.policy == "tabular" and cfg.vocab**cfg.length > TABULAR_LIMIT:
        raise ValueError(f"policy=tabular enumerates vocab^length = {cfg.vocab}^{cfg.length} sequences, more than "
                         f"{TABULAR_LIMIT}; shorten length or use policy=markov")  # fmt: skip


def run(cfg: EstimatorBenchConfig) -> dict:
    """Full sweep; returns a JSON-able dict with per-point results and the headline ratios."""
    gen = torch.Generator().manual_seed(cfg.seed)
    check(cfg)
    pol = POLICIES[cfg.policy](cfg.vocab, cfg.length)
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
        if norm2 <= 1e-20:  # every instance's exact gradient is 0 up to rounding (vocab 2, length 2: equal rewards)
            raise ValueError(f"at sharpness {sharp}, strength {strength} the exact gradient of every instance is 0, "
                             "so no error is relative to anything: raise instances, vocab or length")  # fmt: skip
        mse = {k: sum(m[k] for m in mses) / norm2 for k in mses[0]}
        diag = {k: sum(d[k] for d in diags) / (norm2 if k.startswith(POOLED) else len(diags)) for k in diags[0]}
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


def horizon_markdown(result: dict) -> str:
    """Tables of the relative MSE bias^2 + variance / h at each horizon h > 1 of the config, and of bias^2."""
    points = result["points"]
    methods = [k[len("bias2:") :] for k in points[0] if k.startswith("bias2:")]
    head = "| sharpness | strength | seq ESS/N | " + " | ".join(methods)
    out = []
    for h in [h for h in result["config"]["horizons"] if h != 1] + [None]:
        title = f"MSE over h = {h} steps, bias^2 + variance / h" if h else "Squared bias alone (h -> infinity)"
        rows = [f"{title} (relative to |g|^2; bold = lowest; unbiased estimates, which noise can put below 0):\n",
                head + (f" | oracle@{h} |" if h else " |")]  # fmt: skip
        rows.append("|" + "---|" * (len(methods) + 3 + bool(h)))
        for p in points:
            v = {m: p[f"bias2:{m}"] + (p[f"var:{m}"] / h if h else 0.0) for m in methods}
            best = min(v.values())
            cells = [f"**{x:.4f}**" if x == best else f"{x:.4f}" for x in v.values()]
            cells += [f"{p[f'oracle@{h}']:.4f}"] if h else []
            rows.append(f"| {p['sharpness']} | {p['strength']} | {p['seq_ess']:.3f} | " + " | ".join(cells) + " |")
        out.append("\n".join(rows))
    return "\n\n".join(out)


def main(cfg: EstimatorBenchConfig | None = None, out: str | None = None) -> dict:
    """Run the sweep, print the table, write JSON (with the machine it ran on) to `out`."""
    from aisrl.bench.report import machine, write_json

    cfg = cfg or EstimatorBenchConfig()
    result = run(cfg)
    result["machine"] = machine()
    print(markdown(result))
    print(horizon_markdown(result))
    print(f"({result['seconds']:.0f} s)")
    if out:
        write_json(out, result)
    return result


if __name__ == "__main__":
    main()
