"""Rollout/trainer mismatch diagnostics, computed robustly from per-token log-probs.

Notation (docs/ais.md section 1): `delta = old_logp - rollout_logp`, token IS weight `w = exp(delta)`,
sequence weight `W = exp(sum_t delta)`. Samples come from the rollout policy mu, so every mean below
is a Monte Carlo estimate under mu:

- k1 KL(mu||pi) = E[-delta]; k3 KL(mu||pi) = E[w - 1 - delta] (>= 0 token by token; Schulman's k3).
- chi2_token = E[w^2] - 1 and chi2_seq = E[W^2] - 1 estimate the chi-square divergence chi2(pi||mu),
  which is exactly the variance inflation of an importance-weighted mean.
- ESS/N = (sum W)^2 / (N sum W^2) (Kong 1992), computed in log space with a max-shift.
- ppl of each side = exp(-token-mean log-prob) over the batch; their ratio equals exp(k1) while no log-ratio reaches
  the +-20 clamp of `kl` (a rollout log-prob of -inf is floored at -1e4 for the perplexities instead). verl's
  rollout-correction metrics average per-sequence perplexities instead, so the two differ on varied lengths.

Robustness rules, applied once in `prepare` so every correction shares them: masked positions may hold anything
(NaN, -inf) and never reach a statistic; a counted token whose log-ratio is NaN, whose trainer log-prob is not
finite or whose rollout log-prob is +inf leaves the loss mask (counted in `nonfinite_frac`). A trainer log-prob of
-inf with a finite rollout one (a token outside the trainer's top-k / top-p nucleus) is the extreme of mismatch,
w = 0: its gradient is undefined, so it leaves the loss, but it stays in the products of ratios (`zero` marks it; its
delta is -LOG_RATIO_CLAMP), so sequence-level weights, ESS, the prefix / suffix products and the veto see a sequence
the trainer cannot produce (`zero_prob_frac`). Log-ratios are clamped to +-LOG_RATIO_CLAMP (so a rollout log-prob of
-inf gives a huge weight that truncation caps), and every exponent of a sequence-level quantity is bounded by
EXP_CLAMP, so no metric is NaN or inf.
All sums go through `aisrl.dist` so sharded batches give the single-process values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from aisrl.dist import all_max, all_min, all_sum

LOG_RATIO_CLAMP = 20.0
"""Token log-ratios are clamped to [-20, 20]: w in [2e-9, 4.9e8], finite in FP32 even when squared."""
EXP_CLAMP = 80.0
"""Largest exponent taken for a reported sequence-level quantity (exp(80) ~ 5.5e34 < FP32 max)."""
LOGP_FLOOR = -1e4
"""Log-probs below this (e.g. -inf) are floored when averaged into perplexities."""


@dataclass(frozen=True)
class Batch:
    """Validated, sanitised inputs shared by every correction. All tensors are detached FP32."""

    old_logp: torch.Tensor  # (N, T) floored at LOGP_FLOOR where counted, 0 elsewhere
    rollout_logp: torch.Tensor  # (N, T) same
    delta: torch.Tensor  # (N, T) old_logp - rollout_logp, clamped; -LOG_RATIO_CLAMP at `zero`, 0 where not counted
    mask: torch.Tensor  # (N, T) bool: counted tokens (input mask minus NaN / zero-probability positions)
    zero: torch.Tensor  # (N, T) bool: tokens the trainer gives no probability (w = 0), outside `mask`
    seq_mask: torch.Tensor  # (N,) bool: sequences with a token in the products (counted, or of probability 0)
    seq_log_w: torch.Tensor  # (N,) sum_t delta, the log sequence weight
    seq_len: torch.Tensor  # (N,) number of counted tokens
    n_nonfinite: torch.Tensor  # () counted tokens dropped: NaN, non-finite trainer log-prob, +inf rollout log-prob

    @property
    def in_products(self) -> torch.Tensor:
        return self.mask | self.zero  # (N, T) the tokens a sequence-wide rule sees: counted, or of probability 0

    @property
    def products_len(self) -> torch.Tensor:
        """(N,) number of tokens in `in_products`: the length a per-sequence mean of `delta` divides by."""
        return self.in_products.sum(-1).to(self.delta.dtype)

    @property
    def log_ratio(self) -> torch.Tensor:
        """(N, T) float64 old_logp - rollout_logp before the +-LOG_RATIO_CLAMP clamp (log-probs floored at LOGP_FLOOR):
        -inf at `zero`, 0 where not counted. The rejection rules decide on it, so a band or threshold past e^+-20
        means what it says; weights and metrics use the clamped `delta`."""
        raw = self.old_logp.double() - self.rollout_logp.double()  # 0 - 0 outside `mask`
        return torch.where(self.zero, -math.inf, raw)

    @property
    def w(self) -> torch.Tensor:
        return self.delta.exp()  # (N, T), exactly 1 where not counted, ~2e-9 where `zero`


def prepare(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> Batch:
    """Check shapes, detach, bring every input to old_logp's device, drop NaN tokens, clamp log-ratios. Raises
    ValueError on bad shapes."""
    for name, t in (("old_logp", old_logp), ("rollout_logp", rollout_logp), ("mask", mask)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must have shape (N, T); got {tuple(t.shape)}")
    if old_logp.shape != rollout_logp.shape or old_logp.shape != mask.shape:
        raise ValueError(
            "old_logp, rollout_logp and mask must share one (N, T) shape; got "
            f"{tuple(old_logp.shape)}, {tuple(rollout_logp.shape)}, {tuple(mask.shape)}"
        )
    old = old_logp.detach().float()  # on the trainer's device; rollout_logp and the mask may come from another
    roll = rollout_logp.detach().to(old.device).float()
    given = mask.detach().to(old.device).bool()
    raw = old - roll  # (N, T)
    # A counted token is unusable when either side is NaN, or the trainer gives it no probability
    # (old_logp = -inf: its log-prob gradient is undefined), or the rollout reports log-prob +inf (no log-prob
    # of a sampled token can be positive, let alone infinite). rollout_logp = -inf only makes w huge: clamped.
    nan = (torch.isnan(raw) | ~torch.isfinite(old) | (roll == math.inf)) & given
    impossible = given & (old == -math.inf) & torch.isfinite(roll)  # (N, T) w = 0 exactly
    keep = given & ~nan
    delta = torch.where(keep, raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), 0.0)  # (N, T)
    delta = torch.where(impossible, -LOG_RATIO_CLAMP, delta)
    zero = torch.zeros((), dtype=old.dtype, device=old.device)
    old = torch.where(keep, old.clamp(min=LOGP_FLOOR), zero)
    roll = torch.where(keep, roll.clamp(min=LOGP_FLOOR), zero)
    seq_len = keep.sum(-1).to(old.dtype)  # (N,)
    return Batch(
        old_logp=old,
        rollout_logp=roll,
        delta=delta,
        mask=keep,
        zero=impossible,
        seq_mask=(keep | impossible).any(-1),  # a sequence of zero-probability tokens only is the worst one, not none
        seq_log_w=delta.sum(-1),
        seq_len=seq_len,
        n_nonfinite=nan.sum().to(old.dtype),
    )


def _s(x: torch.Tensor, where: torch.Tensor | None = None) -> torch.Tensor:
    """Local float64 sum of x over `where` (a bool mask) or over everything."""
    if where is not None:
        x = torch.where(where, x, 0.0)
    return x.sum(dtype=torch.float64)


def _ext(x: torch.Tensor, where: torch.Tensor, largest: bool) -> torch.Tensor:
    """Local max (or min) of x over `where`; -inf (or +inf) when nothing is selected."""
    fill = -math.inf if largest else math.inf
    x = torch.where(where, x, fill)
    return (x.amax() if largest else x.amin()).double() if x.numel() else x.new_full((), fill).double()


def _div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a / b, and 0 where b == 0 (empty selection)."""
    return torch.where(b > 0, a / b.clamp(min=1e-300), torch.zeros_like(a))


def _fin(x: torch.Tensor) -> torch.Tensor:
    """Replace the +-inf of an empty max/min by 0 so no metric is infinite."""
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def seq_weight_moments(b: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global (m, S1, S2) with S_k = sum_i exp(k (log W_i - m)) over counted sequences, m = max log W_i.

    Both sums share the shift m, so ESS/N = S1^2 / (N S2) and mean W^2 = exp(2m) S2 / N never overflow.
    """
    log_w = b.seq_log_w.double()
    (m,) = all_max(_ext(log_w, b.seq_mask, largest=True))
    m = _fin(m)
    s1, s2 = all_sum(_s(torch.exp(log_w - m), b.seq_mask), _s(torch.exp(2.0 * (log_w - m)), b.seq_mask))
    return m, s1, s2


def weight_stats(x: torch.Tensor, where: torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
    """Mean / std / min / max of x over `where`, all-reduced; zeros when `where` is empty."""
    n, s1, s2 = all_sum(_s(where.double()), _s(x.double(), where), _s(x.double() ** 2, where))
    (mx,) = all_max(_ext(x, where, largest=True))
    (mn,) = all_min(_ext(x, where, largest=False))
    mean = _div(s1, n)
    var = (_div(s2, n) - mean**2).clamp(min=0.0)
    return {
        f"{prefix}_mean": mean,
        f"{prefix}_std": var.sqrt(),
        f"{prefix}_min": _fin(mn),
        f"{prefix}_max": _fin(mx),
    }


def k3_per_token(d: torch.Tensor) -> torch.Tensor:
    """k3 = exp(d) - 1 - d of each log-ratio d (Schulman 2020), as expm1(d) - d, which keeps precision for tiny
    mismatches, clamped at 0 (its analytic minimum) against rounding noise."""
    return (torch.expm1(d) - d).clamp(min=0.0)


def mismatch_metrics(b: Batch) -> dict[str, torch.Tensor]:
    """The mismatch metrics that depend only on the inputs (not on a correction)."""
    m = b.mask
    d = b.delta.double()
    w = d.exp()  # (N, T) in float64: k3 = expm1(d) - d keeps precision for tiny mismatches
    k3 = k3_per_token(d)  # (N, T)
    n_given = m.sum(dtype=torch.float64) + b.n_nonfinite.double()
    n, s_d, s_absd, s_k3, s_w2, s_old, s_roll, s_hi, s_lo, n_seq, nonfin, n_zero = all_sum(
        _s(m.double()), _s(d, m), _s(d.abs(), m), _s(k3, m), _s(w**2, m),
        _s(b.old_logp.double(), m), _s(b.rollout_logp.double(), m),
        _s((w > 2.0).double(), m), _s((w < 0.5).double(), m),
        _s(b.seq_mask.double()), n_given, _s(b.zero.double()),
    )  # fmt: skip
    (max_absd,) = all_max(_ext(b.delta.abs(), m, largest=True))
    # Sequence weights W = exp(seq_log_w): ESS and chi2 in log space.
    shift, s1, s2 = seq_weight_moments(b)
    ess = torch.where(n > 0, _div(_div(s1**2, n_seq), s2), 0.0)  # no scored token: no sequence to rely on
    log_mean_w2 = 2.0 * shift + torch.log(_div(s2, n_seq).clamp(min=1e-300))
    chi2_seq = torch.where(n > 0, torch.exp(log_mean_w2.clamp(max=EXP_CLAMP)) - 1.0, 0.0)
    nll_train, nll_roll = -_div(s_old, n), -_div(s_roll, n)
    ppl_train = torch.exp(nll_train.clamp(max=EXP_CLAMP))
    ppl_roll = torch.exp(nll_roll.clamp(max=EXP_CLAMP))
    mean_absd = _div(s_absd, n)
    out = {
        "kl": -_div(s_d, n),
        "k3_kl": _div(s_k3, n),
        "chi2_token": _div(s_w2, n) - torch.where(n > 0, 1.0, 0.0).double(),
        "chi2_seq": chi2_seq,
        "ess": ess,
        "training_ppl": ppl_train,
        "rollout_ppl": ppl_roll,
        "ppl_diff": ppl_train - ppl_roll,
        "ppl_ratio": torch.exp((nll_train - nll_roll).clamp(-EXP_CLAMP, EXP_CLAMP)),
        "logprob_abs_diff_mean": mean_absd,
        "logprob_abs_diff_max": _fin(max_absd),
        "token_prob_mult_error": torch.exp(mean_absd),
        "ratio_frac_above_2": _div(s_hi, n),
        "ratio_frac_below_half": _div(s_lo, n),
        "nonfinite_frac": _div(nonfin - n, nonfin),
        "zero_prob_frac": _div(n_zero, nonfin),
        "num_tokens": n,
        "num_seqs": n_seq,
    }
    out.update(weight_stats(b.w, m, "is_weight"))
    return out


def sequence_ess(b: Batch) -> torch.Tensor:
    """Normalised ESS/N of the sequence weights, in (0, 1]; 0 for a batch with no scored token."""
    _, s1, s2 = seq_weight_moments(b)
    n_seq, n = all_sum(_s(b.seq_mask.double()), _s(b.mask.double()))
    return torch.where(n > 0, _div(_div(s1**2, n_seq), s2), 0.0)
