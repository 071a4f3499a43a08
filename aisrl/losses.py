"""GRPO / PPO policy loss and group advantages.

GRPO (Shao et al. 2024, arXiv 2402.03300) samples G completions per prompt and uses the
group-normalised reward as every token's advantage:

    A_i = (R_i - mean_g R) / (std_g R + eps)                       (scale=False drops the division)

The per-token clipped surrogate of PPO (Schulman et al. 2017), with r_t = exp(logp_t - old_logp_t):

    l_t = -min(r_t A, clip(r_t, 1 - eps_lo, 1 + eps_hi) A)
    dual clip (Ye et al. 2020), for A < 0 only:  l_t = min(l_t, -c A),  c > 1

is multiplied by a detached mismatch weight omega_t (aisrl.correction) and optionally augmented by
beta * k3(pi_ref || pi), then aggregated over the mask:

    token-mean                sum_it l / sum_it m                       (DAPO)
    seq-mean-token-mean       mean_i (sum_t l / sum_t m)                (original GRPO)
    seq-mean-token-sum        mean_i sum_t l
    seq-mean-token-sum-norm   sum_it l / (N_seq * horizon)              (Dr. GRPO: constant horizon, e.g.
                                                                        the max completion length)

Distributed: denominators are all-reduced and the local loss is scaled by the world size, so that
DDP's gradient averaging yields exactly the gradient of the global-batch loss; the reported metrics
are global. An empty mask gives a loss of exactly 0 that still backpropagates (zero gradients).
"""

from __future__ import annotations

import torch

from aisrl.diagnostics import _div, _s, k3_per_token
from aisrl.dist import all_sum, world_size

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
RATIO_LOG_CLAMP = 20.0
"""|logp - old_logp| is clamped to this before exponentiating, so no ratio is inf."""


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4):
    """(B*G,) rewards, grouped consecutively by prompt -> (B*G,) advantages, vectorised. A completion whose reward
    is NaN or infinite (it could not be scored) gets advantage 0 and is left out of its group's mean and std."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape (B*G,), got {tuple(rewards.shape)}")
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(
            f"group_size must be >= 2 and divide the number of rewards ({rewards.numel()}); got {group_size}"
        )
    r = rewards.detach().float().view(-1, group_size)  # (B, G)
    ok = torch.isfinite(r)  # (B, G)
    if bool(ok.all()):  # torch's own reductions: the same bits as every run recorded so far
        mean, std = r.mean(-1, keepdim=True), r.std(-1, keepdim=True)  # (B, 1)
    else:
        n = ok.sum(-1, keepdim=True)  # (B, 1) scored completions per group
        mean = torch.where(ok, r, 0.0).sum(-1, keepdim=True) / n.clamp(min=1)
        std = (torch.where(ok, r - mean, 0.0).pow(2).sum(-1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()  # unbiased
    adv = torch.where(ok, r - mean, 0.0)  # (B, G)
    return (adv / (std + eps) if scale else adv).reshape(-1)


def _masked_aggregate(per_tok: torch.Tensor, m: torch.Tensor, agg: str, horizon: int | None) -> torch.Tensor:
    """Aggregate (N, T) per-token values over the float mask m with global denominators (in FP32+)."""
    per_tok = per_tok.float() if per_tok.dtype in (torch.float16, torch.bfloat16) else per_tok
    m = m.to(per_tok.dtype)
    if agg == "token-mean":
        (den,) = all_sum(_s(m))
        return (per_tok * m).sum() / den.clamp(min=1.0).to(per_tok.dtype)
    seq_mask = (m.sum(-1) > 0).to(per_tok.dtype)  # (N,)
    (n_seq,) = all_sum(_s(seq_mask))
    n_seq = n_seq.clamp(min=1.0).to(per_tok.dtype)
    if agg == "seq-mean-token-mean":
        per_seq = (per_tok * m).sum(-1) / m.sum(-1).clamp(min=1.0)  # (N,)
        return per_seq.sum() / n_seq
    if agg == "seq-mean-token-sum":
        return (per_tok * m).sum() / n_seq
    return (per_tok * m).sum() / (n_seq * horizon)  # seq-mean-token-sum-norm


def _check_inputs(logp, old_logp, mask, dual_clip, ref_logp=None, kl_coef=0.0, *, adv=None, weights=None,
                  clip=(0.2, 0.2)) -> None:  # fmt: skip
    if logp.shape != old_logp.shape or logp.shape != mask.shape or logp.dim() != 2:
        raise ValueError(f"logp, old_logp and mask must share one (N, T) shape; got {tuple(logp.shape)}, "
                         f"{tuple(old_logp.shape)}, {tuple(mask.shape)}")  # fmt: skip
    n, t = logp.shape
    if adv is not None and tuple(adv.shape) not in ((n,), (n, t)):
        raise ValueError(f"adv must be (N,) per sequence or (N, T) per token, with (N, T) = {(n, t)} from logp; "
                         f"got {tuple(adv.shape)}")  # fmt: skip
    for name, x in (("weights", weights), ("ref_logp", ref_logp)):
        if x is not None and tuple(x.shape) != (n, t):
            raise ValueError(f"{name} must have logp's (N, T) shape {(n, t)}; got {tuple(x.shape)}")
    if dual_clip is not None and not dual_clip > 1.0:  # (NaN too)
        raise ValueError(f"dual_clip must be > 1 (it bounds the loss of negative advantages), got {dual_clip}")
    if not isinstance(clip, (tuple, list)) or len(clip) != 2 or not (0 <= clip[0] < 1 and clip[1] >= 0):  # (NaN too)
        raise ValueError(f"clip must be (low, high) with 0 <= low < 1 and high >= 0: the ratio is kept inside "
                         f"[1 - low, 1 + high]; got {clip!r}")  # fmt: skip
    if ref_logp is None and kl_coef:
        raise ValueError("kl_coef > 0 needs ref_logp (log-probs under the reference policy)")


def _like(x: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """`x` detached, on logp's device and in its dtype (advantages and weights often come from CPU rewards)."""
    return x.detach().to(device=logp.device, dtype=logp.dtype)


def _at_least_fp32(logp: torch.Tensor) -> torch.Tensor:
    """BF16 / FP16 log-probs upcast to FP32 (differentiably): the surrogate, and the weights and advantages cast to
    logp's dtype, would otherwise be rounded to 8 bits of mantissa, and a weight of 1.0015 would become 1."""
    return logp.float() if logp.is_floating_point() and logp.element_size() < 4 else logp


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 estimate of a KL per token, exp(x) - x - 1 (Schulman 2020), as expm1(x) - x (which keeps precision for a
    small x), on the log-ratio clamped to +-RATIO_LOG_CLAMP so a stray -inf or huge log-prob gives a large finite
    value, not inf."""
    x = torch.nan_to_num(log_ratio, nan=0.0).clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP)  # NaN (e.g. -inf - -inf) -> 0
    return torch.expm1(x) - x


def _ref_k3(ref_logp: torch.Tensor | None, logp: torch.Tensor, on: torch.Tensor):
    """(kl_ref, skipped): per-token k3 of KL(pi || pi_ref), 0 off the mask, and the (N, T) bool of counted tokens
    left out of it because the policy or the reference gives them log-prob -inf (or NaN). With top-k / top-p both
    are truncated distributions, and a sampled token can fall outside either's support as the policy moves: its
    log-ratio is infinite, k3 would be exp(20) after clamping, and its gradient 0 (the -inf is constant), so the
    token would swamp the loss and its logged value while pulling on nothing. It is skipped and counted instead."""
    if ref_logp is None:
        return torch.zeros_like(logp), torch.zeros_like(on)
    r = _like(ref_logp, logp)
    finite = torch.isfinite(r) & torch.isfinite(logp.detach())
    kl_ref = _k3(torch.where(on & finite, r - logp, 0.0))  # (N, T)
    return kl_ref, on & ~finite


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    on: torch.Tensor,
    clip: tuple[float, float] = (0.2, 0.2),
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """Per-token clipped PPO loss l_t (zero off the bool mask `on`), before weights and aggregation.

    Returns (l, ratio, log_ratio, clipped, dual), each (N, T); `clipped`/`dual` flag tokens where the clip or
    the dual clip is active. Shared by grpo_loss and the verl adapter (which aggregates with verl's agg_loss)."""
    _check_inputs(logp, old_logp, on, dual_clip, adv=adv, clip=clip)
    logp = _at_least_fp32(logp)
    on, old_logp = on.to(logp.device).bool(), old_logp.to(logp.device)
    adv = _like(adv, logp)
    adv = adv[:, None] if adv.dim() == 1 else adv  # (N, 1) or (N, T)
    adv = torch.where(on, adv, 0.0)  # (N, T)
    log_ratio = torch.where(on, logp - old_logp.detach(), 0.0)
    log_ratio = torch.nan_to_num(log_ratio, nan=0.0).clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP)  # (N, T)
    ratio = log_ratio.exp()  # (N, T)
    lo, hi = clip
    pg_unclipped = -adv * ratio  # (N, T)
    pg_clipped = -adv * ratio.clamp(1.0 - lo, 1.0 + hi)
    pg = torch.maximum(pg_unclipped, pg_clipped)  # (N, T)
    clipped = (pg_clipped > pg_unclipped) & on
    dual = torch.zeros_like(on)
    if dual_clip is not None:
        bound = -adv * dual_clip  # (N, T), positive where adv < 0
        dual = (adv < 0) & (pg > bound) & on
        pg = torch.where(adv < 0, torch.minimum(pg, bound), pg)
    return pg, ratio, log_ratio, clipped, dual


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    clip: tuple[float, float] = (0.2, 0.2),
    dual_clip: float | None = None,
    agg: str = "token-mean",
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    horizon: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy loss of GRPO with mismatch weights; returns (scalar loss, detached metrics)."""
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {agg!r}; choose from {list(AGGREGATIONS)}")
    _check_inputs(logp, old_logp, mask, dual_clip, ref_logp, kl_coef, adv=adv, weights=weights, clip=clip)
    whole = isinstance(horizon, int) and not isinstance(horizon, bool) and horizon > 0
    if agg == "seq-mean-token-sum-norm" and not whole:
        raise ValueError(
            "agg='seq-mean-token-sum-norm' needs horizon=<max completion length>, a positive int (a constant, not "
            f"the padded width, so padding and sharding cannot change the loss); got horizon={horizon!r}"
        )
    logp = _at_least_fp32(logp)
    m = _like(mask, logp)  # (N, T)
    on = m > 0
    pg, ratio, log_ratio, clipped, dual = clipped_surrogate(logp, old_logp, adv, on, clip, dual_clip)
    if weights is not None:
        pg = pg * torch.where(on, _like(weights, logp), 0.0)
    kl_ref, kl_skipped = _ref_k3(ref_logp, logp, on)  # (N, T) k3 of KL(pi || pi_ref)
    per_tok = pg + kl_coef * kl_ref if ref_logp is not None else pg
    loss = _masked_aggregate(per_tok, m, agg, horizon) * world_size()
    with torch.no_grad():
        n, s_clip, s_dual, s_ratio, s_k3, s_kl_ref, s_pg, s_skip = all_sum(
            _s(m.double()), _s(clipped.double()), _s(dual.double()), _s(ratio.double(), on),
            _s(k3_per_token(log_ratio.double()), on), _s(kl_ref.double(), on), _s(pg.double(), on),
            _s(kl_skipped.double()),
        )  # fmt: skip
        (loss_global,) = all_sum(loss.detach().double())
        metrics = {
            "loss": loss_global / world_size(),
            "pg_loss": _div(s_pg, n),
            "pg_clip_frac": _div(s_clip, n),
            "pg_dual_clip_frac": _div(s_dual, n),
            "ratio_mean": _div(s_ratio, n),
            "approx_kl": _div(s_k3, n),
            "kl_ref": _div(s_kl_ref, n),
            "kl_ref_skipped_frac": _div(s_skip, n),
        }
    return loss, {k: v.float() for k, v in metrics.items()}


def tbpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    clip: tuple[float, float] = (0.2, 0.2),
    dual_clip: float | None = 3.0,
    agg: str = "seq-mean",
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    horizon: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Trust-band policy optimisation (our reading of QaRL's TBPO; docs/qarl.md): a sequence-level objective.

        s_i   = exp( sum_t m_it (logp_it - old_it) / sum_t m_it )      length-normalised sequence ratio
        l_i   = -min(s_i A_i, clip(s_i, 1 - eps_lo, 1 + eps_hi) A_i)   the trust band clips s_i
        l_i   = min(l_i, -c A_i)  if A_i < 0                           dual clip (c = dual_clip > 1)
        loss  = sum_i omega_i l_i / N_seq  (+ kl_coef * sequence mean of the per-sequence token-mean k3)

    omega_i is the masked token mean of the correction weights (1 without a correction). `agg` must be
    'seq-mean' (the objective is per sequence); `horizon` is accepted for a uniform loss signature."""
    if agg != "seq-mean":
        raise ValueError(f"tbpo aggregates per sequence; agg must be 'seq-mean', got {agg!r}")
    _check_inputs(logp, old_logp, mask, dual_clip, ref_logp, kl_coef, adv=adv, weights=weights, clip=clip)
    logp = _at_least_fp32(logp)
    m = _like(mask, logp)  # (N, T)
    on = m > 0
    lens = m.sum(-1)  # (N,)
    seq_on = lens > 0  # (N,)
    a = _like(adv, logp)
    if a.dim() == 2:  # per-token advantages: their masked mean; off-mask values (even NaN) never enter
        a = torch.where(on, a, 0.0).mul(m).sum(-1) / lens.clamp(min=1)  # (N,)
    a = torch.where(seq_on, a, 0.0)
    d = torch.nan_to_num(torch.where(on, logp - _like(old_logp, logp), 0.0), nan=0.0)  # (N, T)
    seq_log_ratio = (d.sum(-1) / lens.clamp(min=1)).clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP)  # (N,)
    s = seq_log_ratio.exp()  # (N,)
    lo, hi = clip
    unclipped, clipped_l = -a * s, -a * s.clamp(1.0 - lo, 1.0 + hi)
    l_seq = torch.maximum(unclipped, clipped_l)  # (N,)
    band = (clipped_l > unclipped) & seq_on
    dual = torch.zeros_like(seq_on)
    if dual_clip is not None:
        dual = (a < 0) & (l_seq > -a * dual_clip) & seq_on
        l_seq = torch.where(a < 0, torch.minimum(l_seq, -a * dual_clip), l_seq)
    if weights is not None:
        omega = (torch.where(on, _like(weights, logp), 0.0)).sum(-1) / lens.clamp(min=1)  # (N,)
        l_seq = l_seq * omega
    n_seq, n_tok = all_sum(_s(seq_on.double()), _s(m.double()))
    loss = torch.where(seq_on, l_seq, 0.0).sum() / n_seq.clamp(min=1).to(l_seq.dtype)
    kl_ref, kl_skipped = _ref_k3(ref_logp, logp, on)  # (N, T)
    if ref_logp is not None:
        kl_seq = (kl_ref * m).sum(-1) / lens.clamp(min=1)  # (N,): per sequence, so micro-batches accumulate exactly
        loss = loss + kl_coef * kl_seq.sum() / n_seq.clamp(min=1).to(l_seq.dtype)
    loss = loss * world_size()
    with torch.no_grad():
        k3 = k3_per_token(d.clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP).double())  # (N, T)
        sums = all_sum(_s(band.double()), _s(dual.double()), _s(s.double(), seq_on), _s(k3, on),
                       _s(kl_ref.double(), on), loss.detach().double(), _s(kl_skipped.double()))  # fmt: skip
        metrics = {"loss": sums[5] / world_size(), "pg_clip_frac": _div(sums[0], n_seq),
                   "pg_dual_clip_frac": _div(sums[1], n_seq), "ratio_mean": _div(sums[2], n_seq),
                   "approx_kl": _div(sums[3], n_tok), "kl_ref": _div(sums[4], n_tok),
                   "kl_ref_skipped_frac": _div(sums[6], n_tok)}  # fmt: skip
    return loss, {k: v.float() for k, v in metrics.items()}


LOSSES = {"grpo": grpo_loss, "tbpo": tbpo_loss}
"""Policy losses by name (TrainConfig.loss)."""
SEQ_METRICS = {"grpo": frozenset(), "tbpo": frozenset({"pg_clip_frac", "pg_dual_clip_frac", "ratio_mean"})}
"""The metrics each loss averages over sequences; every other metric except `loss` is a mean over tokens. Averaging
micro-batches' metrics needs to know which (aisrl.update.accumulate_gradient)."""
