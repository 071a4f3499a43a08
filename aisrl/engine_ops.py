"""The pieces of one decode step of aisrl.engine: FP8 linears, the elementwise stages that torch.compile fuses,
and counter-based sampling.

Why a module of its own: each piece is a plain function of tensors that the engine calls once per layer and
step, so it can be compiled, tested and read apart from the engine's bookkeeping.
  - `Linear`: one or several fused nn.Linear weights, full precision or FP8 E4M3 W8A8. FP8 weights are
    quantised per output channel (or per tensor) at every sync, activations per token at run time, and
    y = (q_x q_w^T) * s_x s_w^T accumulates in FP32 (`torch._scaled_mm` on CUDA; the same sum on the CPU).
    These are the numerics of aisrl.quant's fake-quant `fp8_e4m3_w8a8` (DeepSeek-V3; FP8-RL). FP32 and FP8
    weights on the CPU are also kept, as FP32 values, prepacked in oneDNN's blocked layout: at decode sizes (a
    few dozen rows) its GEMMs run 10-40% faster than MKL's on plain weights (BENCHMARKS.md section 4). That
    copy costs 4 bytes per parameter next to the plain weights, which prefill-sized inputs use (MKL is faster
    there).
  - The stages between GEMMs (residual add + RMSNorm + activation quantisation; QKV split + q/k norm + rotary
    + KV-cache format; SiLU-gate + quantisation; sampling). On CUDA `CompiledStage` fuses each into one or two
    kernels. Eager PyTorch launches ~60 kernels per layer, which costs more than the FP8 GEMMs save.
  - `counter_uniform`: request b's uniform at step t is an integer hash of (seed_b, t), computed on the device.
    No generator state is kept, and a completion depends only on its seed and prompt.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from aisrl.quant import amax_scale
from aisrl.rollout import SamplingParams, inverse_cdf, process_logits

E4M3_MAX = 448.0
_M32 = 0xFFFFFFFF


def fp8_rows(x: torch.Tensor, per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> FP8 E4M3 values (M, K) and FP32 scales (M, 1) = amax / 448 per row (or one shared amax)."""
    amax = (x.abs().amax() if per_tensor else x.abs().amax(-1)).float().expand(x.shape[0])[:, None]  # (M, 1)
    s = amax_scale(amax, E4M3_MAX)  # 1 where all-zero or underflowing; a NaN or inf amax stays so, as in fake-quant
    return (x.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s


class Linear:
    """One or several fused nn.Linear weights (concatenated along the output), full precision or FP8 W8A8."""

    def __init__(self, n_out: int, n_in: int, bias: bool, fp8: str | None, dtype, device):
        self.fp8, self.dtype = fp8, dtype  # fp8: None, "channel" or "tensor"; dtype: of the output, as of the engine
        self.w = torch.empty(n_out, n_in, dtype=torch.float8_e4m3fn if fp8 else dtype, device=device)
        self.s = torch.empty(1, n_out, device=device) if fp8 else None  # per output row FP32 scale
        self.b = torch.empty(n_out, dtype=dtype, device=device) if bias else None
        self.packed = None  # self.w in oneDNN's blocked layout (FP32 on the CPU), rebuilt at every load

    def load(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None) -> None:
        """Copy (and quantise) in place: captured graphs keep pointing at these buffers."""
        if self.fp8:
            parts = [fp8_rows(w.float(), per_tensor=self.fp8 == "tensor") for w in weights]
            self.w.copy_(torch.cat([q for q, _ in parts]))
            self.s.copy_(torch.cat([s for _, s in parts]).T)
        else:
            self.w.copy_(torch.cat(weights))
        if self.b is not None:
            self.b.copy_(torch.cat(biases))
        if self.w.device.type == "cpu" and (self.fp8 or self.w.dtype == torch.float32) and _ONEDNN:
            try:  # a private op: if a torch version changes it, run on the plain weights
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.w.float(), _PACK_ROWS)  # FP8: exact
            except (RuntimeError, TypeError) as e:
                self.packed = None
                warnings.warn(f"aisrl.engine: oneDNN weight packing failed, using plain GEMMs: {e}", stacklevel=2)

    def __call__(self, x) -> torch.Tensor:  # (M, n_in), or its FP8 rows and scales -> (M, n_out)
        xq, sx = (x if isinstance(x, tuple) else fp8_rows(x)) if self.fp8 else (x, None)
        if self.packed is not None and xq.shape[0] <= _PACKED_MAX_ROWS:  # CPU decode sizes
            y = torch.ops.mkldnn._linear_pointwise(xq.float(), self.packed, None, "none", [], "")
            y = (y if sx is None else y * sx * self.s).to(self.dtype)  # the FP8 scales outside the sum, as in _fp8_mm
        elif self.fp8:
            y = _fp8_mm(xq, sx, self.w, self.s, self.dtype)
        else:
            y = x @ self.w.t()
        return y if self.b is None else y + self.b


# oneDNN packs for an expected row count; packed for 64 its FP32 GEMMs match or beat MKL from 8 to 256 rows here
# (2-core AMD EPYC), while MKL is faster on prefill-sized inputs (thousands of rows)
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
_PACK_ROWS, _PACKED_MAX_ROWS = 64, 512


def _fp8_mm(xq, sx, w, sw, out_dtype):
    """(xq sx)(w sw)^T with FP32 accumulation: one `torch._scaled_mm` on CUDA; on the CPU the same sum in FP32 (CPU
    builds of torch may only take per-tensor scales). Row-wise scales give BF16 out on CUDA, cast to `out_dtype`."""
    if xq.is_cuda:
        return torch._scaled_mm(xq, w.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16).to(out_dtype)
    return ((xq.float() @ w.float().t()) * sx * sw).to(out_dtype)


def _rms(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x, cos, sin):  # x (B, S, heads, D); cos/sin (B, S, 1, D): Hugging Face's rotate-half convention
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _add_norm(x, delta, w, eps: float, fp8: bool):
    """Residual add, RMSNorm and (FP8 engines) per-token quantisation of the result: (x, normed input)."""
    x = x if delta is None else x + delta
    h = _rms(x, w, eps)
    return x, (fp8_rows(h.flatten(0, -2)) if fp8 else h.flatten(0, -2))


def _qkv_split(qkv, qn, kn, cos, sin, ks, vs, dims: tuple, eps: float, kv_fp8: bool):
    """(B*S, (H + 2 Hk) D) -> q (B, S, H, D) and keys/values (B, Hk, S, D) in the cache's format, after the Qwen3
    q/k norms (when qn is given) and rotary embedding; also the unquantised keys and values."""
    B, S, H, Hk, D = dims
    q, k, v = qkv.view(B, S, -1).split([H * D, Hk * D, Hk * D], dim=-1)
    q, k, v = q.view(B, S, H, D), k.view(B, S, Hk, D), v.view(B, S, Hk, D)
    if qn is not None:
        q, k = _rms(q, qn, eps), _rms(k, kn, eps)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    return q, _cache_format(k, ks, kv_fp8), _cache_format(v, vs, kv_fp8), k, v


def _cache_format(t, scale, kv_fp8: bool):  # (B, S, Hk, D) -> (B, Hk, S, D), FP8 with (B, Hk) scales
    t = t.transpose(1, 2)
    if not kv_fp8:
        return t
    return (t.float() / scale[:, :, None, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _silu_mul(gu, fp8: bool):
    g, u = gu.chunk(2, dim=-1)
    a = F.silu(g) * u
    return fp8_rows(a) if fp8 else a


def _quant(a, fp8: bool):
    return fp8_rows(a) if fp8 else a


def _sample(logits, seeds, t, params: SamplingParams):
    """(B, V) logits -> sampled ids and their processed log-probs (counter-based uniforms, or argmax)."""
    logp = process_logits(logits, params)  # (B, V) FP32
    tok = logp.argmax(-1) if params.greedy else inverse_cdf(logp, counter_uniform(seeds, t))
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


class CompiledStage:
    """A stage under torch.compile that falls back to eager PyTorch (same results, more kernels) if compiling it
    fails; `failure` then says why (benchmarks report it)."""

    def __init__(self, fn):
        import torch._dynamo

        # each engine (quantisation, batch, sampling settings) adds specialisations of the same few functions;
        # past the default limit of 8 dynamo would silently run them eagerly
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
        torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 2048)
        self.fn, self.compiled, self.failure = fn, torch.compile(fn, dynamic=False), None

    def __call__(self, *args):
        if self.failure is None:
            try:
                return self.compiled(*args)
            except Exception as e:
                if not type(e).__module__.startswith(("torch._dynamo", "torch._inductor")):
                    raise  # not a compiler failure (out of memory, a shape error): the caller must see it
                self.failure = f"{type(e).__name__}: {str(e)[:300]}"
                warnings.warn(f"aisrl.engine: torch.compile failed on {self.fn.__name__}, running it eagerly: "
                              f"{self.failure}", stacklevel=2)  # fmt: skip
        return self.fn(*args)


STAGES = {"add_norm": _add_norm, "qkv": _qkv_split, "silu_mul": _silu_mul, "quant": _quant, "sample": _sample}


def _mix32(x):  # an integer hash of 32-bit values held in int64 (low 32 bits of each product kept)
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def counter_uniform(seeds: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """(B,) int64 seeds and a step counter -> (B,) FP32 uniforms in (0, 1), identical on every device."""
    step = _mix32((t + 0x9E3779B9) & _M32)  # offset: _mix32 maps 0 to 0, which made seed 0's first uniform 3e-8
    h = _mix32((seeds & _M32) ^ _mix32(((seeds >> 32) & _M32) ^ step))
    # the top bucket's centre, 1 - 2^-25, is not an FP32 number and rounds to 1.0: keep it below 1 like the rest
    return (((h >> 8).float() + 0.5) / 2.0**24).clamp(max=1 - 2.0**-24)


def prefill_attention(q, k, v, valid, sm_scale):
    """q (B, S, H, D), k/v (B, Hk, S, D): causal attention over valid keys (a padding query sees itself)."""
    B, S, H, _ = q.shape
    G = H // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    mask = (causal[None] & valid[:, None, :]) | torch.eye(S, dtype=torch.bool, device=q.device)[None]  # (B, S, S)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=sm_scale)
    return out.transpose(1, 2)  # (B, S, H, D)
