"""QaRL's two answers to low-bit rollouts: align the trainer with the rollout, and find degenerate tokens.

Rollout alignment (QaRL, quantisation-aware RL). Instead of correcting the mismatch between a quantised
rollout policy mu and a full-precision trainer pi, remove it: the trainer's forward pass runs through the
same fake-quantised weights (and activation quantisation) as the rollout copy,

    y = q_a(x) @ q_w(W)^T + b,      q(v) = v + (quant(v) - v).detach()      (straight-through estimator)

so pi and mu are the same function of the same numbers (log-probs agree up to kernel and KV-cache noise),
while gradients reach the full-precision master weights W unchanged (d q(W) / dW = I). `align_(model, cfg)`
does this in place by re-classing each targeted nn.Linear; parameter names and state dicts are unchanged,
so checkpoints and `sync_weights` work as before. Not with LoRA: an adapter's B A path would run beside the
aligned layer at full precision while the rollout copy quantises the merged W + B A, so `align_` refuses a peft
model.

The same layers serve a lighter use: with the trainer left at full precision, `alignment(model, True)` switches
the rollout format on for one forward, which gives the copy's log-probs log mu_q as a differentiable function of
the master weights (benchmarks/copy_pull.py pulls the copy towards the trainer with them; docs/ais.md section 5).

Error-token detector. QaRL reports that low-bit rollouts of long answers degenerate into loops and garbled
tokens. `error_tokens` flags, per token, (a) periodic loops: a token that repeats the one `p` positions back
for at least `min_loop` consecutive positions, for some period p <= max_period, and (b) runs of at least
`min_run` consecutive tokens whose |log pi - log mu| exceeds `ratio_threshold` (the rollout and the trainer
disagree for a stretch, the signature of a low-bit derailment). The trainer logs the flagged fraction and can
drop flagged tokens from the loss (`correction.mask_errors`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from aisrl.quant import ACT_FORMATS, WEIGHT_FORMATS, QuantConfig, quant_targets


def _ste(v: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return v + (q - v).detach()


class AlignedLinear(nn.Linear):
    """nn.Linear whose forward sees the rollout format's fake-quantised weight and input (straight-through)."""

    qcfg: QuantConfig

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.qcfg
        if not getattr(self, "aligned", True):  # set_alignment(model, False): plain full precision
            return nn.functional.linear(x, self.weight, self.bias)
        w32, x32 = self.weight.float(), x.float()  # FP32 like FakeQuantLinear, whatever the model dtype
        with torch.no_grad():
            wq = WEIGHT_FORMATS[cfg.format](w32.detach(), cfg)
        w = _ste(w32, wq)
        if cfg.activations:
            with torch.no_grad():
                xq = ACT_FORMATS[cfg.format](x32.detach())
            x32 = _ste(x32, xq)
        bias = None if self.bias is None else self.bias.float()
        return nn.functional.linear(x32, w, bias).to(x.dtype)


def align_(model: nn.Module, cfg: QuantConfig) -> nn.Module:
    """Make `model`'s linear layers compute in the rollout format `cfg` with straight-through gradients
    (the layers `quantize_` would quantise: all but the output head unless cfg.lm_head, and those cfg.keep
    leaves in full precision). In place; aligning again replaces the earlier format everywhere (a layer the new
    `cfg` leaves out is plain again)."""
    if any(hasattr(m, "lora_A") for m in model.modules()):  # peft's LoRA layers
        raise ValueError("align_ needs a model without LoRA adapters: their B A path would stay in full precision "
                         "while the rollout copy quantises W + B A; merge them first (merge_and_unload) or train "
                         "full-parameter")  # fmt: skip
    targets = quant_targets(model, cfg)  # first: a cfg it refuses leaves the model as it was
    for mod in model.modules():
        if isinstance(mod, AlignedLinear):
            mod.__class__ = nn.Linear
            del mod.qcfg
            mod.__dict__.pop("aligned", None)
    for _, mod in targets:
        mod.__class__ = AlignedLinear
        mod.qcfg = cfg
    return model


def set_alignment(model: nn.Module, enabled: bool) -> None:
    """Switch aligned layers between the rollout format and plain full precision (e.g. for evaluation)."""
    for mod in model.modules():
        if isinstance(mod, AlignedLinear):
            mod.aligned = enabled


@contextlib.contextmanager
def alignment(model: nn.Module, enabled: bool):
    """The aligned layers switched on (rollout format) or off (full precision) for the block, each restored after."""
    layers = [m for m in model.modules() if isinstance(m, AlignedLinear)]
    if enabled and not layers:  # the caller would get full-precision log-probs, not the copy's
        raise ValueError("alignment(model, True) found no aligned layer: call align_(model, cfg) with the rollout "
                         "format first")  # fmt: skip
    before = [getattr(m, "aligned", True) for m in layers]
    set_alignment(model, enabled)
    try:
        yield
    finally:
        for m, was in zip(layers, before, strict=True):
            m.aligned = was


def error_tokens(
    ids: torch.Tensor,
    mask: torch.Tensor,
    log_ratio: torch.Tensor | None = None,
    *,
    max_period: int = 8,
    min_loop: int = 12,
    ratio_threshold: float = 1.0,
    min_run: int = 4,
) -> torch.Tensor:
    """(N, T) bool: tokens inside a periodic loop or a run of large rollout/trainer log-ratios."""
    shapes = {"ids": tuple(ids.shape), "mask": tuple(mask.shape)}
    if log_ratio is not None:
        shapes["log_ratio"] = tuple(log_ratio.shape)
    if ids.dim() != 2 or len(set(shapes.values())) > 1:  # broadcasting would flag the wrong tokens without a word
        raise ValueError(f"error_tokens needs (N, T) ids, mask and log_ratio of one shape; got {shapes}")
    mask = mask.bool()
    n, t = ids.shape
    flags = torch.zeros_like(mask)
    for p in range(1, min(max_period, t - 1) + 1):
        same = torch.zeros_like(mask)
        same[:, p:] = (ids[:, p:] == ids[:, :-p]) & mask[:, p:] & mask[:, :-p]  # (N, T): repeats p back
        flags |= _runs_at_least(same, min_loop, extend_back=p)
    if log_ratio is not None:
        big = (log_ratio.abs() > ratio_threshold) & mask
        flags |= _runs_at_least(big, min_run)
    return flags & mask


def _runs_at_least(x: torch.Tensor, k: int, extend_back: int = 0) -> torch.Tensor:
    """Positions inside runs of >= k consecutive True values along the last dim (plus `extend_back`
    positions before each run: the first period of a loop is part of it). Vectorised."""
    t = x.shape[-1]
    idx = torch.arange(t, device=x.device).expand_as(x)
    last_off = torch.where(~x, idx, -1).cummax(-1).values  # (N, T) latest False at or before j
    ahead = torch.where(~x, idx, t).flip(-1).cummin(-1).values.flip(-1)  # (N, T) first False at or after j
    run_len = ahead - last_off - 1  # (N, T) length of the True run through j (meaningful where x)
    out = x & (run_len >= k)
    start = out & (idx == last_off + 1)  # first position of each long run
    for e in range(1, extend_back + 1):
        out[..., :-e] |= start[..., e:]
    return out
