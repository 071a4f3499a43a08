"""Low-precision rollout formats as exact fake-quantisation, in the spirit of torchao's `quantize_`.

Why: the rollout engine runs a quantised copy of the policy (FP8 / INT8 / FP4), the trainer the full
precision one; their log-prob mismatch is what aisrl.correction corrects. Each linear layer rounds its
weight (and with a W8A8/W4A4 preset its input activations) exactly as the format does, then computes in
FP32 and returns its input's dtype. Everything else (norms, attention, residual stream, KV cache unless
`kv_cache`) stays in the model's own precision, so the copy emulates the quantised GEMMs, not a whole engine
that also runs those parts in BF16; the `bf16` preset rounds weights only, `bf16_w16a16` weights and linear inputs
(the BF16 GEMMs of a BF16 engine, accumulating in FP32: the high-precision reference rollouts of a GPU study).

    rollout = copy.deepcopy(model)
    quantize_(rollout, quant_config("fp8_e4m3_w8a8"))     # or QuantConfig(format="fp8_e4m3", ...)
    seconds = sync_weights(model, rollout)                # every step: re-quantise the trainer's weights

Number formats (sign + E exponent bits + M mantissa bits, saturating at the largest finite value):
FP8 E4M3 (OCP "fn": max 448, no inf), FP8 E5M2 (max 57344), FP4 E2M1 (values 0, .5, 1, 1.5, 2, 3, 4, 6).
`fake_float` rounds to nearest-even on the format's grid, subnormals included; tests check it equals
torch's own float8 casts bit for bit. Scales:
- FP8 weights: per-tensor, per-output-channel or 128x128 blocks, scale = amax / max_finite (DeepSeek-V3 /
  FP8-RL blockwise recipe); W8A8 adds dynamic per-token activation scales.
- INT8: symmetric per-channel weights (amax / 127), per-token activations. INT4: groups of 128 along
  the input dimension (amax / 7).
- MXFP4 (OCP MX v1.0): blocks of 32, shared power-of-two (E8M0) scale 2^(floor(log2 amax) - 2).
- NVFP4: blocks of 16 with an FP8 E4M3 scale (amax / 6), under a per-tensor FP32 scale amax / (448 * 6).

Mixed precision: `QuantConfig(keep=("model.layers.0.self_attn.*", ...))` leaves the linear layers whose module names
match those shell patterns in full precision, as rollout engines' lists of ignored layers do. A few layers can
carry most of a 4-bit format's mismatch; `aisrl mismatch ... per_layer=true` (aisrl.doctor) finds them.
"""

from __future__ import annotations

import fnmatch
import math
import time
from dataclasses import dataclass, replace

import torch
from torch import nn

from aisrl.lora import merged_state

# (exponent bits, mantissa bits, exponent bias, largest finite value)
FLOAT_FORMATS = {
    "e4m3": (4, 3, 7, 448.0),
    "e5m2": (5, 2, 15, 57344.0),
    "e2m1": (2, 1, 1, 6.0),
}


def fake_float(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round FP32 values to the nearest representable value of `fmt` (ties to even), saturating."""
    _, m_bits, bias, max_val = FLOAT_FORMATS[fmt]
    x = x.float()
    _, e = torch.frexp(x)  # x = f * 2^e with |f| in [0.5, 1): floor(log2|x|) = e - 1
    e = (e - 1).clamp(min=1 - bias)  # below the smallest normal exponent the grid is uniform (subnormals)
    step = torch.ldexp(torch.ones_like(x), (e - m_bits).to(torch.int32))  # spacing of the grid near x
    q = torch.round(x / step) * step  # torch.round rounds half to even
    return q.clamp(-max_val, max_val)


def amax_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """amax / qmax, and 1 for an all-zero group or one so small that amax / qmax underflows to 0 in FP32 (amax below
    about 1e-42: its values then round to 0, where a scale of 0 would make them NaN); a NaN or inf amax stays
    non-finite, so a non-finite value makes its whole group NaN (as on the hardware) instead of silently rescaling
    the group's finite values."""
    s = amax / qmax
    return torch.where(s == 0, torch.ones_like(s), s)


def _blocks(w: torch.Tensor, rows: int, cols: int):
    """(O, I) -> (O/rows, rows, I/cols, cols) zero-padded view, and a function undoing it (contiguous: a padded
    shape's slice would otherwise feed a matmul strided, whose sums then differ in the last bit between a layer
    that stores the weight and one that quantises it on the fly)."""
    o, i = w.shape
    po, pi = -o % rows, -i % cols
    wp = nn.functional.pad(w, (0, pi, 0, po))
    b = wp.view((o + po) // rows, rows, (i + pi) // cols, cols)
    return b, lambda t: t.reshape(o + po, i + pi)[:o, :i].contiguous()


def quantize_fp8(w: torch.Tensor, fmt: str = "e4m3", granularity: str = "channel", block: int = 128):
    """Fake-quantise a weight (O, I) to FP8 with tensor / channel / block scales (computed in FP32)."""
    qmax = FLOAT_FORMATS[fmt][3]
    w = w.float()
    if granularity == "tensor":
        s = amax_scale(w.abs().amax(), qmax)
        return fake_float(w / s, fmt) * s
    if granularity == "channel":
        s = amax_scale(w.abs().amax(dim=1, keepdim=True), qmax)  # (O, 1)
        return fake_float(w / s, fmt) * s
    if granularity == "block":
        b, undo = _blocks(w, block, block)
        s = amax_scale(b.abs().amax(dim=(1, 3), keepdim=True), qmax)  # (O/b, 1, I/b, 1)
        return undo(fake_float(b / s, fmt) * s)
    raise ValueError(f"unknown granularity {granularity!r}; choose from ['block', 'channel', 'tensor']")


def quantize_int(w: torch.Tensor, bits: int, group: int | None = None) -> torch.Tensor:
    """Symmetric integer fake-quant along the last dim: per row, or per group of `group` columns (in FP32)."""
    qmax = 2 ** (bits - 1) - 1
    w = w.float()
    if group:
        b, undo = _blocks(w, 1, group)
        s = amax_scale(b.abs().amax(dim=-1, keepdim=True), qmax)
        return undo(torch.round(b / s).clamp(-qmax, qmax) * s)
    s = amax_scale(w.abs().amax(dim=-1, keepdim=True), qmax)
    return torch.round(w / s).clamp(-qmax, qmax) * s


def quantize_mxfp4(w: torch.Tensor, block: int = 32) -> torch.Tensor:
    """MXFP4: E2M1 elements, one power-of-two (E8M0) scale per `block` consecutive values (OCP MX v1.0: shared
    exponent floor(log2 amax) - 2, within E8M0's [-127, 127]; a block holding inf or NaN is NaN, E8M0's NaN)."""
    b, undo = _blocks(w.float(), 1, block)
    amax = b.abs().amax(dim=-1, keepdim=True)
    exp = (torch.frexp(amax).exponent - 3).clamp(-127, 127)  # floor(log2 amax), exactly, minus emax of E2M1 (2)
    s = torch.where(torch.isfinite(amax), torch.exp2(exp.to(amax.dtype)), torch.full_like(amax, math.nan))
    return undo(fake_float(b / s, "e2m1") * s)


def quantize_nvfp4(w: torch.Tensor, block: int = 16, per_row: bool = False) -> torch.Tensor:
    """NVFP4: E2M1 elements, an FP8 E4M3 scale per `block` values, under one FP32 tensor scale (per row with
    per_row=True: activations, so a token's quantisation never depends on the other tokens of the batch).
    A value decodes as (q * s) * g, the tensor scale g applied after the block product as NVFP4 kernels apply it
    (in the GEMM's epilogue); q * (s * g) differs from it by one FP32 ulp in about one value in eight."""
    w = w.float()
    amax = w.abs().amax(dim=-1, keepdim=True) if per_row else w.abs().amax()
    g = amax_scale(amax, 448.0 * 6.0)  # the second-level scale, so block scales fit E4M3
    b, undo = _blocks(w / g, 1, block)
    s = fake_float(amax_scale(b.abs().amax(dim=-1, keepdim=True), 6.0), "e4m3")
    s = torch.where(s == 0, torch.ones_like(s), s)  # an all-zero block; a NaN one stays NaN
    return undo(fake_float(b / s, "e2m1") * s) * g


def quantize_act(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Dynamic per-token activation fake-quant (one scale per row of the last dim), in FP32."""
    x = x.float()
    if fmt == "int8":
        return quantize_int(x, 8)
    s = amax_scale(x.abs().amax(dim=-1, keepdim=True), FLOAT_FORMATS[fmt][3])
    return fake_float(x / s, fmt) * s


@dataclass(frozen=True)
class QuantConfig:
    format: str = "fp8_e4m3"
    """Weight format: bf16, fp8_e4m3, fp8_e5m2, int8, int4, mxfp4, nvfp4."""
    granularity: str = "channel"
    """FP8 weight scales: tensor, channel or block (128x128)."""
    activations: bool = False
    """Also fake-quantise linear inputs dynamically: per-token scales for fp8_*/int8 (W8A8), the format's own
    block scales along the input dimension for mxfp4/nvfp4 (W4A4), a plain rounding to BF16 for bf16."""
    group_size: int = 128
    """INT4 group size along the input dimension."""
    lm_head: bool = False
    """Quantise the output projection too (kept in full precision by default, as vLLM/SGLang do)."""
    kv_cache: bool = False
    """Store keys/values in FP8 E4M3, with per-request, per-head scales calibrated on each rollout's prefill. The
    cache is the sampler's (quantize_ swaps the linears only): rollout.generate and aisrl.engine.Engine read this
    flag from the model's config."""
    keep: tuple[str, ...] = ()
    """Linear layers left in full precision, as shell-style patterns of module names (`fnmatch`, e.g.
    'model.layers.0.self_attn.*'): the mixed-precision recipe of a rollout engine's ignored layers. Each pattern
    must match a layer that would otherwise be quantised; `aisrl mismatch ... per_layer=true` says which to keep."""

    def __post_init__(self):
        if self.format not in WEIGHT_FORMATS:
            raise ValueError(f"unknown format {self.format!r}; choose from {sorted(WEIGHT_FORMATS)}")
        if self.activations and self.format not in ACT_FORMATS:
            raise ValueError(f"activations=True needs one of {sorted(ACT_FORMATS)}, not {self.format!r}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1 (INT4 values per scale), got {self.group_size}")
        if self.granularity not in ("tensor", "channel", "block"):
            raise ValueError(f"unknown granularity {self.granularity!r}; choose from ['block', 'channel', 'tensor']")
        if isinstance(self.keep, str) or not all(isinstance(k, str) and k for k in self.keep):
            raise ValueError(f"keep must be a list of non-empty module-name patterns, got {self.keep!r}")
        object.__setattr__(self, "keep", tuple(self.keep))  # a YAML or CLI list arrives as a list


WEIGHT_FORMATS = {
    "bf16": lambda w, c: w.to(torch.bfloat16).float(),
    "fp8_e4m3": lambda w, c: quantize_fp8(w, "e4m3", c.granularity),
    "fp8_e5m2": lambda w, c: quantize_fp8(w, "e5m2", c.granularity),
    "int8": lambda w, c: quantize_int(w, 8),
    "int4": lambda w, c: quantize_int(w, 4, c.group_size),
    "mxfp4": lambda w, c: quantize_mxfp4(w),
    "nvfp4": lambda w, c: quantize_nvfp4(w),
}

ACT_FORMATS = {  # dynamic activation fake-quant per weight format (input rows are tokens)
    "bf16": lambda x: x.to(torch.bfloat16).float(),
    "fp8_e4m3": lambda x: quantize_act(x, "e4m3"),
    "fp8_e5m2": lambda x: quantize_act(x, "e5m2"),
    "int8": lambda x: quantize_act(x, "int8"),
    "mxfp4": lambda x: quantize_mxfp4(x.reshape(-1, x.shape[-1])).reshape(x.shape),
    "nvfp4": lambda x: quantize_nvfp4(x.reshape(-1, x.shape[-1]), per_row=True).reshape(x.shape),
}

PRESETS = {
    "bf16": QuantConfig("bf16"),
    "bf16_w16a16": QuantConfig("bf16", activations=True),
    "fp8_e4m3": QuantConfig("fp8_e4m3"),
    "fp8_e4m3_tensor": QuantConfig("fp8_e4m3", "tensor"),
    "fp8_e4m3_block": QuantConfig("fp8_e4m3", "block"),
    "fp8_e4m3_w8a8": QuantConfig("fp8_e4m3", activations=True),
    "fp8_e4m3_tensor_w8a8": QuantConfig("fp8_e4m3", "tensor", activations=True),
    "fp8_e4m3_block_w8a8": QuantConfig("fp8_e4m3", "block", activations=True),
    "fp8_e4m3_w8a8_kv": QuantConfig("fp8_e4m3", activations=True, kv_cache=True),
    "fp8_e5m2": QuantConfig("fp8_e5m2"),
    "fp8_e5m2_tensor": QuantConfig("fp8_e5m2", "tensor"),
    "fp8_e5m2_block": QuantConfig("fp8_e5m2", "block"),
    "fp8_e5m2_w8a8": QuantConfig("fp8_e5m2", activations=True),
    "fp8_e5m2_tensor_w8a8": QuantConfig("fp8_e5m2", "tensor", activations=True),
    "fp8_e5m2_block_w8a8": QuantConfig("fp8_e5m2", "block", activations=True),
    "int8_w8a8": QuantConfig("int8", activations=True),
    "int4": QuantConfig("int4"),
    "mxfp4": QuantConfig("mxfp4"),
    "nvfp4": QuantConfig("nvfp4"),
    "mxfp4_w4a4": QuantConfig("mxfp4", activations=True),
    "nvfp4_w4a4": QuantConfig("nvfp4", activations=True),
}


def quant_config(name: str, **overrides) -> QuantConfig:
    """A named preset (see PRESETS), optionally with fields replaced."""
    if name not in PRESETS:
        raise ValueError(f"unknown quantisation preset {name!r}; choose from {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


class FakeQuantLinear(nn.Module):
    """A rollout-side linear layer: fake-quantised weight (no grad), optional per-token input quant."""

    def __init__(self, linear: nn.Linear, cfg: QuantConfig):
        super().__init__()
        self.cfg = cfg
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", torch.empty_like(linear.weight, dtype=torch.float32), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())
        self.load_from(linear.weight)

    @torch.no_grad()
    def load_from(self, w: torch.Tensor) -> None:
        """Re-quantise a (trainer) weight into this layer."""
        self.weight.copy_(WEIGHT_FORMATS[self.cfg.format](w.detach().float(), self.cfg))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype  # a BF16 model's residual stream stays BF16; the GEMM itself is exact in FP32
        x = ACT_FORMATS[self.cfg.format](x.float()) if self.cfg.activations else x.float()
        bias = None if self.bias is None else self.bias.float()  # (FP32 buffers, unless the model was cast since)
        return nn.functional.linear(x, self.weight.float(), bias).to(dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.cfg}"


def _is_head(name: str, model: nn.Module) -> bool:
    get_out = getattr(model, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    return name.split(".")[-1] in ("lm_head", "output") or (head is not None and model.get_submodule(name) is head)


def quant_targets(model: nn.Module, cfg: QuantConfig) -> list[tuple[str, nn.Linear]]:
    """The (name, layer) pairs of `model` that `cfg` puts in the rollout format: every nn.Linear but the output head
    (unless cfg.lm_head) and those cfg.keep names. Raises when a keep pattern matches none of the candidates (a
    typo would otherwise quantise everything) or when nothing is left to quantise."""
    if isinstance(model, nn.Linear):  # the swap replaces child layers: a bare layer has no parent to hold its copy
        raise ValueError("quantize_ and align_ swap a model's nn.Linear children: a bare nn.Linear is not one; wrap "
                         "it in a container (nn.Sequential(layer)) or use FakeQuantLinear(layer, cfg) directly")
    candidates = [
        (n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and (cfg.lm_head or not _is_head(n, model))
    ]
    check_keep(cfg, [n for n, _ in candidates], "quantisable layers")
    targets = [(n, m) for n, m in candidates if not is_kept(n, cfg)]
    if not targets:
        why = " (keep names them all)" if candidates else ""
        raise ValueError(f"no nn.Linear layers to quantise in this model{why}")
    return targets


def check_keep(cfg: QuantConfig, names: list[str], what: str) -> None:
    """Raise if a cfg.keep pattern matches none of `names` (the model's `what`): a typo would keep nothing."""
    for pattern in cfg.keep:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
            raise ValueError(f"keep pattern {pattern!r} matches none of this model's {what} ({shown})")


def is_kept(name: str, cfg: QuantConfig) -> bool:
    """Whether the linear layer `name` stays in full precision under `cfg.keep`."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in cfg.keep)


def kept_fraction(model: nn.Module, cfg: QuantConfig) -> float:
    """The fraction of the quantisable layers' weights (hence of their GEMM FLOPs per token) that cfg.keep leaves
    in full precision."""
    every = quant_targets(model, replace(cfg, keep=()))
    total = sum(m.weight.numel() for _, m in every)
    return sum(m.weight.numel() for n, m in every if is_kept(n, cfg)) / total


@torch.no_grad()
def quantize_(model: nn.Module, cfg: QuantConfig) -> nn.Module:
    """Swap every nn.Linear of `model` (in place) for a FakeQuantLinear, but the output head (unless cfg.lm_head)
    and the layers cfg.keep names; returns the model. A model quantised already is refused: its layers would mix two
    formats while `quant_config` named one."""
    if any(isinstance(m, FakeQuantLinear) for m in model.modules()):
        done = getattr(model, "quant_config", None)
        what = done.format if done else "FakeQuantLinear layers"
        raise ValueError(f"the model is quantised already ({what}); quantise a fresh copy of the full-precision "
                         f"model (copy.deepcopy before quantize_)")  # fmt: skip
    for name, mod in quant_targets(model, cfg):
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, FakeQuantLinear(mod, cfg))
    model.quant_config = cfg
    model.requires_grad_(False)
    return model


@torch.no_grad()
def sync_weights(trainer: nn.Module | dict[str, torch.Tensor], rollout: nn.Module) -> float:
    """Copy the trainer's current weights (a module, or a {name: tensor} state such as LoRA-merged weights)
    into the rollout copy, re-quantising quantised layers. Returns the seconds it took (the "weight
    sync" cost of every RL step)."""
    t0 = time.perf_counter()
    src = trainer if isinstance(trainer, dict) else merged_state(trainer)
    for name, mod in rollout.named_modules():
        if isinstance(mod, FakeQuantLinear):
            key = f"{name}.weight"
            if key not in src:
                raise ValueError(f"sync_weights: trainer has no parameter {key!r}; is it the same architecture?")
            mod.load_from(src[key])
            if mod.bias is not None:
                if f"{name}.bias" not in src:
                    raise ValueError(f"sync_weights: trainer has no parameter {name + '.bias'!r} where the rollout "
                                     f"copy's layer has a bias; is it the same architecture?")  # fmt: skip
                mod.bias.copy_(src[f"{name}.bias"])
    quantised = {n for n, m in rollout.named_modules() if isinstance(m, FakeQuantLinear)}
    for name, t in list(rollout.named_parameters()) + list(rollout.named_buffers()):
        owner = name.rpartition(".")[0]
        if owner in quantised:
            continue
        if name not in src:
            mod, leaf = rollout.get_submodule(owner), name.rpartition(".")[2]
            if leaf in getattr(mod, "_non_persistent_buffers_set", ()):
                continue  # derived, not trained (rotary inv_freq): absent from a state dict, nothing to sync
            raise ValueError(f"sync_weights: trainer has no tensor {name!r}; is it the same architecture?")
        t.copy_(src[name])
    p = next(rollout.parameters(), None)
    if p is not None and p.is_cuda:
        torch.cuda.synchronize(p.device)  # the copies are asynchronous: time them, not their launch
    return time.perf_counter() - t0


def fp8_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Fake-quantise keys or values (B, H, S, D) to FP8 E4M3 with per-request, per-head scales (B, H, 1, 1)."""
    return fake_float(x / scale, "e4m3") * scale


def kv_scales(x: torch.Tensor, mask: torch.Tensor | None = None, margin: float = 1.0) -> torch.Tensor:
    """E4M3 scales amax / 448 of calibration keys or values (B, H, S, D) per request and head -> (B, H, 1, 1),
    over the positions where `mask` (B, S) is True (padding left out), so no request's scale depends on another."""
    a = x.detach().abs()
    if mask is not None:
        a = a.masked_fill(~mask[:, None, :, None].to(a.device), 0)
    return amax_scale(a.amax(dim=(2, 3), keepdim=True).float() * margin, 448.0)
