"""Rollout/trainer mismatch corrections, selectable by name, as plain functions of tensors.

Every correction turns (old_logp, rollout_logp, mask) into detached per-token loss multipliers and
a loss mask (docs/ais.md section 1 for AIS):

    res = correct("ais", old_logp, rollout_logp, mask, cap=2.0)
    loss, m = grpo_loss(logp, old_logp, adv, res.mask, weights=res.weights)

With delta = old_logp - rollout_logp, w = exp(delta) (token), W = exp(sum_t delta) (sequence) and
G = exp(mean_t delta) (geometric):

- none:      weights 1.
- tis:       clip(w, floor, cap)                      truncated IS (Espeholt et al. 2018; FlashRL TIS).
- seq_tis:   clip(W, floor, cap) for every token of the sequence.
- prefix_tis: clip(prod_{s<=t} w_s, floor, cap) for token t: per-decision IS (Precup et al. 2000), which
             corrects the distribution of the token and of its context but not of the tokens after it.
             A token dropped as unusable (NaN) counts as w = 1 in later prefixes; one the trainer gives no
             probability (old_logp = -inf) as w = 0, so the rest of its sequence gets weight ~0; a rollout
             log-prob of -inf makes w huge, so the rest of that sequence sits at the cap.
- suffix_tis: clip(prod_{s>=t} w_s, floor, cap) for token t: corrects the token and the tokens after it, which
             the sequence's reward depends on (its conditional expectation given the context is then the trainer's,
             as in off-policy actor-critic, Degris et al. 2012), but not the distribution of the context.
- geo_tis:   clip(G, floor, cap) for every token of the sequence (length-normalised).
- icepop:    w inside the band [low, high], token masked outside (IcePop / token MIS).
- seq_mask:  reject sequences whose W leaves [low, high].
- geo_mask:  reject sequences whose G leaves [low, high] (e.g. [0.999, 1.001]).
- k1/k2/k3_reject: reject tokens or sequences whose KL estimate (k1 = -delta, k2 = delta^2/2,
             k3 = w - 1 - delta), aggregated at `level` (token, seq_mean, seq_sum, seq_max),
             exceeds `threshold` in absolute value.
- veto:      reject a sequence in which any token has w < threshold (catastrophic tokens).
- ais:       (1 - alpha) + alpha * clip(w, floor, cap), alpha from aisrl.ais.

Options every correction takes: `normalize=True` divides the applied weights by their batch mean
(all-reduced), `metrics_only=True` computes everything but applies nothing (weights 1, mask kept), and
`veto=v` (0 < v < 1) also drops every sequence holding a token with w < v, the `veto` rule around the correction:
such a token puts the rest of its sequence, and the reward the whole sequence is credited with, where the trainer
would rarely go (a hard, sequence-wide stand-in for the context and suffix weights token TIS leaves out; logged as
`veto_frac_seq`).
Rules that reject (icepop, seq_mask, geo_mask, k*_reject, veto) decide on the log-ratio before the +-20 clamp the
weights use (`Batch.log_ratio`), so a band or threshold past e^+-20 means what it says.
`res.weights` is 0 wherever `res.mask` is False. A batch where everything is rejected returns an
all-False mask and finite metrics; the losses turn it into a zero loss, not a division by zero.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch

from aisrl.ais import ais_alpha, ais_diagnostics
from aisrl.config import check_like_default
from aisrl.diagnostics import EXP_CLAMP, Batch, _div, _s, k3_per_token, mismatch_metrics, prepare, weight_stats
from aisrl.dist import all_sum, local_only


class CorrectionResult(NamedTuple):
    weights: torch.Tensor  # (N, T) detached loss multipliers, 0 where mask is False
    mask: torch.Tensor  # (N, T) bool loss mask after rejection
    metrics: dict[str, torch.Tensor]  # detached scalars


# A rule maps a prepared batch to (weights (N, T), keep (N, T) bool, clipped (N, T) bool, extra metrics).
Rule = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]


def _check_band(low: float, high: float) -> None:
    if not (0.0 <= low <= high and high > 0):
        raise ValueError(f"need 0 <= low <= high and high > 0 for a ratio band, got low={low}, high={high}")


def _check_cap(cap: float, floor: float) -> None:
    if not (cap > 0 and 0.0 <= floor <= cap):
        raise ValueError(f"need cap > 0 and 0 <= floor <= cap, got cap={cap}, floor={floor}")


def _per_seq(x: torch.Tensor) -> torch.Tensor:
    return x[:, None]  # (N, 1), broadcasts over tokens


def _none(b: Batch):
    ones = torch.ones_like(b.delta)
    return ones, b.mask, torch.zeros_like(b.mask), {}


def _tis(b: Batch, cap: float = 2.0, floor: float = 0.0):
    _check_cap(cap, floor)
    w = b.w
    return w.clamp(floor, cap), b.mask, (w > cap) | (w < floor), {}


def _clip_exp(log_v: torch.Tensor, cap: float, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """clip(exp(log_v), floor, cap) computed without overflow, and where it clipped. An unbounded cap (inf, asking for
    untruncated products) is held at exp(EXP_CLAMP): a product of ratios overflows FP32 past exp(88)."""
    _check_cap(cap, floor)
    top = min(math.log(cap), EXP_CLAMP)
    v = torch.exp(log_v.clamp(max=top))  # <= min(cap, e^80), never inf
    clipped = (log_v > top) | (v < floor)
    return v.clamp(min=floor), clipped


def _seq_level(b: Batch, log_v: torch.Tensor, cap: float, floor: float):
    """Truncated sequence-level weights exp(log_v) (N,) for every token of the sequence."""
    v, clipped = _clip_exp(log_v, cap, floor)  # (N,)
    return _per_seq(v).expand_as(b.delta), b.mask, _per_seq(clipped) & b.mask, {}


def _seq_tis(b: Batch, cap: float = 2.0, floor: float = 0.0):
    return _seq_level(b, b.seq_log_w, cap, floor)


def _token_level(b: Batch, log_v: torch.Tensor, cap: float, floor: float):
    """Truncated per-token weights exp(log_v) (N, T), each token its own product of ratios."""
    v, clipped = _clip_exp(log_v, cap, floor)  # (N, T)
    return v, b.mask, clipped & b.mask, {}


def _prefix_tis(b: Batch, cap: float = 2.0, floor: float = 0.0):
    # delta is 0 on masked tokens, so the cumulative sums run over the counted tokens only
    return _token_level(b, b.delta.cumsum(-1), cap, floor)  # sum_{s<=t} delta_s


def _suffix_tis(b: Batch, cap: float = 2.0, floor: float = 0.0):
    return _token_level(b, b.delta.flip(-1).cumsum(-1).flip(-1), cap, floor)  # sum_{s>=t} delta_s


def _geo_mean_log(b: Batch, log_v: torch.Tensor | None = None) -> torch.Tensor:
    """(N,) mean_t of log_v (default delta) over the sequence's tokens, zero-probability tokens included."""
    total = b.seq_log_w if log_v is None else log_v.sum(-1)
    return total / b.products_len.clamp(min=1.0).to(total.dtype)


def _geo_tis(b: Batch, cap: float = 2.0, floor: float = 0.0):
    return _seq_level(b, _geo_mean_log(b), cap, floor)


def _log_bounds(low: float, high: float) -> tuple[float, float]:
    _check_band(low, high)
    return (math.log(low) if low > 0 else -math.inf), math.log(high)


def _icepop(b: Batch, low: float = 0.5, high: float = 2.0):
    lo, hi = _log_bounds(low, high)
    lr = b.log_ratio  # (N, T) unclamped: a band past e^+-20 is honoured
    keep = b.mask & (lr >= lo) & (lr <= hi)
    return b.w, keep, torch.zeros_like(keep), {}


def _seq_band(b: Batch, log_v: torch.Tensor, low: float, high: float):
    """Keep whole sequences whose exp(log_v) lies in [low, high] (compared in log space)."""
    lo, hi = _log_bounds(low, high)
    ok = (log_v >= lo) & (log_v <= hi)  # (N,)
    return torch.ones_like(b.delta), b.mask & _per_seq(ok), torch.zeros_like(b.mask), {}


def _seq_mask(b: Batch, low: float = 0.5, high: float = 2.0):
    return _seq_band(b, b.log_ratio.sum(-1), low, high)  # unclamped, -inf with a zero-probability token


def _geo_mask(b: Batch, low: float = 0.999, high: float = 1.001):
    return _seq_band(b, _geo_mean_log(b, b.log_ratio), low, high)


KL_LEVELS = ("token", "seq_mean", "seq_sum", "seq_max")


def _kl_reject(b: Batch, estimator: str, threshold: float = 0.05, level: str = "seq_mean"):
    if level not in KL_LEVELS:
        raise ValueError(f"unknown level {level!r} for {estimator}_reject; choose from {list(KL_LEVELS)}")
    if not threshold >= 0:  # also refuses NaN, which would silently reject every token
        raise ValueError(f"{estimator}_reject threshold must be a number >= 0, got {threshold}")
    # float64 and expm1: a threshold far below FP32's rounding of exp(d) - 1 still means it; unclamped, so a
    # threshold past the +-20 clamp's KL still means it and a zero-probability token (d = -inf) has KL inf
    d = b.log_ratio  # (N, T), 0 outside the products
    k = {"k1": -d, "k2": 0.5 * d**2, "k3": k3_per_token(d)}[estimator]  # (N, T)
    if level == "token":
        keep = b.mask & (k.abs() <= threshold)
    else:
        if level == "seq_max":
            agg = k.abs().amax(-1) if k.shape[-1] else k.new_zeros(k.shape[:1])  # (N,)
        else:
            agg = k.sum(-1)
            agg = agg / b.products_len.clamp(min=1.0) if level == "seq_mean" else agg
        keep = b.mask & _per_seq(agg.abs() <= threshold)
    return torch.ones_like(b.delta), keep, torch.zeros_like(keep), {}


def _vetoed(b: Batch, threshold: float) -> torch.Tensor:
    """(N,) bool: sequences holding a token with w < threshold (zero-probability tokens included)."""
    if not 0 < threshold < 1:
        raise ValueError(f"a veto threshold is a token weight in (0, 1), got {threshold}")
    # the log-ratio before the clamp: a threshold under e^-20 (1e-10, to veto only what is near impossible) still
    # sees a weight of e^-30; a zero-probability token has log-ratio -inf
    return (b.log_ratio < math.log(threshold)).any(-1)


def _veto(b: Batch, threshold: float = 1e-4):
    return torch.ones_like(b.delta), b.mask & ~_per_seq(_vetoed(b, threshold)), torch.zeros_like(b.mask), {}


def _ais_view(b: Batch, cap: float, floor: float) -> dict[str, torch.Tensor]:
    """The three AIS diagnostics of the batch and the alpha they give (`alpha_batch`)."""
    diag = ais_diagnostics(b, cap, floor)
    diag["alpha_batch"] = ais_alpha(
        diag["weight_reliability"], diag["divergence_severity"], diag["variance_amplification"],
        diag.pop("num_seqs"), diag.pop("num_tokens"),
    )  # fmt: skip
    return diag


def _ais(
    b: Batch,
    cap: float = 2.0,
    floor: float = 0.0,
    ema: float = 0.0,
    prev_alpha: float | torch.Tensor | None = None,
    alpha: float | None = None,
):
    """AIS; `alpha` fixes the coefficient (ablations), `ema`/`prev_alpha` smooth it across steps."""
    _check_cap(cap, floor)
    if not 0.0 <= ema < 1.0:
        raise ValueError(f"ais ema must be in [0, 1), got {ema}")
    diag = _ais_view(b, cap, floor)
    batch_alpha = diag.pop("alpha_batch")
    if alpha is not None and (ema > 0 or prev_alpha is not None):
        raise ValueError("ais: pass either a fixed alpha or ema/prev_alpha smoothing, not both")
    if prev_alpha is not None and ema == 0:
        raise ValueError("ais prev_alpha (last step's alpha) only matters for the ema: pass ema > 0 with it")
    if prev_alpha is not None:
        prev = float(prev_alpha)
        if not 0.0 <= prev <= 1.0:  # also rejects NaN
            raise ValueError(f"ais prev_alpha must be a number in [0, 1] (last step's alpha), got {prev_alpha}")
    if alpha is not None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"ais alpha must be in [0, 1], got {alpha}")
        a = torch.tensor(float(alpha), dtype=torch.float64)
    elif prev_alpha is not None and ema > 0:
        a = ema * prev + (1 - ema) * batch_alpha.cpu()
    else:
        a = batch_alpha
    a = a.to(b.delta.device)
    w = b.w
    omega = (1.0 - a) + a * w.clamp(floor, cap)  # (N, T)
    clipped = b.mask & ((w > cap) | (w < floor))
    return omega.float(), b.mask, clipped, {**diag, "alpha_batch": batch_alpha, "alpha": a}


CORRECTIONS: dict[str, Rule] = {
    "none": _none,
    "tis": _tis,
    "seq_tis": _seq_tis,
    "prefix_tis": _prefix_tis,
    "suffix_tis": _suffix_tis,
    "geo_tis": _geo_tis,
    "icepop": _icepop,
    "seq_mask": _seq_mask,
    "geo_mask": _geo_mask,
    "k1_reject": partial(_kl_reject, estimator="k1"),
    "k2_reject": partial(_kl_reject, estimator="k2"),
    "k3_reject": partial(_kl_reject, estimator="k3"),
    "veto": _veto,
    "ais": _ais,
}


def options_of(name: str) -> list[str]:
    """The keyword options a correction accepts (besides normalize / metrics_only)."""
    params = inspect.signature(CORRECTIONS[name]).parameters.values()
    return [p.name for p in params if p.kind is p.KEYWORD_ONLY or p.default is not p.empty]


def correct(
    name: str,
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    normalize: bool = False,
    metrics_only: bool = False,
    veto: float = 0.0,
    **options,
) -> CorrectionResult:
    """Apply the correction `name` to a batch; see the module docstring for the menu (and for `veto`)."""
    if name not in CORRECTIONS:
        raise ValueError(f"unknown correction {name!r}; choose from {sorted(CORRECTIONS)}")
    valid = [o for o in options_of(name) if o != "estimator"]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"correction {name!r} got unknown option(s) {unknown}; it accepts {valid}, plus "
                         "normalize, metrics_only and veto (any correction)")
    b = prepare(old_logp, rollout_logp, mask)
    weights, keep, clipped, extra = CORRECTIONS[name](b, **options)
    if veto:  # whole sequences that hold a catastrophic token leave the loss, whatever the correction
        bad = _vetoed(b, veto) & b.seq_mask  # (N,)
        keep = keep & ~_per_seq(bad)
        n_seq, n_bad = all_sum(_s(b.seq_mask.double()), _s(bad.double()))
        extra = {**extra, "veto_frac_seq": _div(n_bad, n_seq)}
    weights = torch.where(keep, weights.float(), 0.0)  # (N, T)
    if normalize:
        weights = _normalized(weights, keep)
    metrics = mismatch_metrics(b)
    metrics.update(_application_metrics(b, weights, keep, clipped))
    metrics.update(extra)
    if name != "ais":  # what AIS would see and choose on this batch, logged whatever corrects it: at token TIS's cap
        same = {k: options[k] for k in ("cap", "floor") if name == "tis" and k in options}  # others bound other weights
        metrics.update(_ais_view(b, same.get("cap", 2.0), same.get("floor", 0.0)))
    if metrics_only:
        weights, keep = b.mask.float(), b.mask
    metrics = {k: v.detach().float() for k, v in metrics.items()}
    return CorrectionResult(weights.detach(), keep, metrics)


def _application_metrics(b: Batch, weights, keep, clipped) -> dict[str, torch.Tensor]:
    """Applied-weight statistics and the clip / mask fractions, token- and sequence-level."""
    seq_kept = (keep.any(-1) & b.seq_mask).double()  # (N,)
    seq_clipped = (clipped & b.mask).any(-1).double()
    n, n_seq, n_keep, n_clip, s_seq_keep, s_seq_clip = all_sum(
        _s(b.mask.double()), _s(b.seq_mask.double()), _s(keep.double()), _s(clipped.double(), b.mask),
        seq_kept.sum(dtype=torch.float64), seq_clipped.sum(dtype=torch.float64),
    )  # fmt: skip
    out = weight_stats(weights, keep, "weight")
    out["clip_frac_token"] = _div(n_clip, n)
    out["clip_frac_seq"] = _div(s_seq_clip, n_seq)
    out["mask_frac_token"] = _div(n - n_keep, n)
    out["mask_frac_seq"] = _div(n_seq - s_seq_keep, n_seq)
    return out


def check_options(name: str, **options) -> None:
    """Raise the ValueError `correct(name, ..., **options)` would (unknown name or option, a bad cap, band or
    alpha), now: on a one-token batch, before any model is built or any rollout is sampled; and one for a value
    whose type is not its default's (a float option given text, say)."""
    if name in CORRECTIONS:
        params = inspect.signature(CORRECTIONS[name]).parameters.values()
        defaults = {"normalize": False, "metrics_only": False, "veto": 0.0}
        defaults.update({p.name: p.default for p in params if p.default is not p.empty})
        for key, value in options.items():
            check_like_default(f"correction {name!r}", key, value, defaults.get(key))
    one = torch.zeros(1, 1)
    with local_only():  # a probe of this process's: no collective (under NCCL a CPU tensor has no backend)
        correct(name, one, one, torch.ones(1, 1, dtype=torch.bool), **options)


def _normalized(weights: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(N, T) weights divided by their mean over `keep` (over every rank), so that they average 1 there; unchanged
    where that mean is 0."""
    n, s = all_sum(_s(keep.double()), _s(weights.double(), keep))
    mean = _div(s, n)
    return torch.where(mean > 0, weights / mean.clamp(min=1e-30).float(), weights)


def restrict(res: CorrectionResult, keep: torch.Tensor, *, normalize: bool = False) -> CorrectionResult:
    """The result with only the tokens in `keep` (N, T) left in the loss (a veto, a guard applied after the
    correction); the mask fractions and the applied-weight statistics are recomputed on the final mask. normalize:
    the result was made with normalize=True, and its weights are divided again by their mean over the tokens left,
    which then average 1 as that option promises."""
    if tuple(keep.shape) != tuple(res.mask.shape):  # broadcasting would drop columns where rows were meant
        raise ValueError(f"keep must be an (N, T) mask of the result's shape {tuple(res.mask.shape)}; got "
                         f"{tuple(keep.shape)} (per sequence: keep[:, None].expand_as(res.mask))")  # fmt: skip
    mask = res.mask & keep.to(res.mask.device).bool()
    weights = torch.where(mask, res.weights, 0.0)  # (N, T)
    n_keep, n_seq_keep = all_sum(_s(mask.double()), mask.any(-1).sum(dtype=torch.float64))
    if normalize:
        weights = _normalized(weights, mask)
    n, n_seq = res.metrics["num_tokens"].double(), res.metrics["num_seqs"].double()
    metrics = dict(res.metrics)
    metrics["mask_frac_token"] = _div(n - n_keep, n)
    metrics["mask_frac_seq"] = _div(n_seq - n_seq_keep, n_seq)
    metrics.update(weight_stats(weights, mask, "weight"))
    return CorrectionResult(weights, mask, {k: v.detach().float() for k, v in metrics.items()})


def ais_weights(old_logp, rollout_logp, mask, cap: float = 2.0, **options):
    """`w, metrics = ais_weights(...)`: the AIS weights and their metrics in one call. A token the trainer cannot
    score (a NaN or infinite log-prob) gets weight 0 but stays in `mask`; a loss whose mean should not count it takes
    its mask from `correct("ais", ...)`, which returns it."""
    res = correct("ais", old_logp, rollout_logp, mask, cap=cap, **options)
    return res.weights, res.metrics
