"""Decode attention over a static KV cache that may hold FP8 keys and values: one Triton kernel, one reference.

Why: at decode time every step reads the whole KV cache, and at batch 64 x 768 positions of an 8B model
that is ~7 GB per step in BF16, a third of the weights' bytes. Storing keys/values as FP8 E4M3 halves it,
but only if attention reads the FP8 bytes directly; dequantising into a BF16 copy first moves *more*
bytes than a BF16 cache. So the kernel loads FP8 (or BF16) tiles, widens them in registers and runs
flash-decoding's online softmax (Dao et al. 2022; Hong et al., "FlashDecoding++", 2023):

    s_j = (q . k_j) * sm_scale * k_scale          for start_b <= j < end_b
    out = (sum_j softmax(s)_j v_j) * v_scale       (per-kv-head scales, so they factor out of the sums)

One program per (sequence, kv head) serves the G = H / H_kv query heads that share it (grouped-query
attention). The valid span [start_b, end_b) of each sequence is read from device tensors, so one captured
CUDA graph serves every decode step. `decode_attention_ref` is the same function in plain PyTorch: the CPU
path, and the reference the kernel is tested against.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F


def decode_attention_ref(q, k_cache, v_cache, k_scale, v_scale, start, end, width: int, sm_scale: float):
    """q (B, H, D); caches (B, Hk, S, D) of any float dtype; scales (B, Hk) FP32 (per request and kv head);
    start/end (B,) int; attends to slots [start_b, end_b) within the first `width` slots. Returns (B, H, D) in
    q's dtype. The scales act on q and on the output, as in the kernel, so an FP32 cache is read in place."""
    B, H, D = q.shape
    Hk = k_cache.shape[1]
    k, v = k_cache[:, :, :width].float(), v_cache[:, :, :width].float()  # (B, Hk, W, D); FP32: views, no copy
    qg = q.float().view(B, Hk, H // Hk, D) * k_scale.view(B, Hk, 1, 1)  # query heads grouped by the kv head they read
    slots = torch.arange(width, device=q.device)
    valid = (slots[None] >= start[:, None]) & (slots[None] < end[:, None])  # (B, W)
    # slots outside the span may hold anything an earlier call left (a NaN of a broken policy): a mask keeps them out
    # of the softmax, but 0 * NaN in the product with V would not be 0, so they are zeroed
    inside = valid[:, None, :, None]  # (B, 1, W, 1)
    k, v = torch.where(inside, k, 0.0), torch.where(inside, v, 0.0)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=valid[:, None, None], scale=sm_scale)  # (B, Hk, G, D)
    return (out * v_scale.view(B, Hk, 1, 1)).reshape(B, H, D).to(q.dtype)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def decode_kernel(Q, K, V, KS, VS, START, END, O, sq_b, sq_h, sk_b, sk_h, sk_s, so_b, so_h, sm_scale, S, Hk,
                      G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                      WIDE: tl.constexpr):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)  # 64-bit offsets: a layer's cache may exceed 2^31 elements
        hk = tl.program_id(1)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        n = tl.arange(0, BLOCK_N)
        head = hk * G + g  # the query heads of this kv head (rows >= G are padding for the matrix unit)
        q = tl.load(Q + b * sq_b + head[:, None] * sq_h + d[None, :], mask=(g < G)[:, None], other=0.0)
        q = q.to(WIDE)  # (BLOCK_G, D)
        s_scale = sm_scale * tl.load(KS + b * Hk + hk)
        lo = tl.load(START + b)
        hi = tl.minimum(tl.load(END + b), S)  # never past the cache, whatever the state says
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max of the scores
        l_sum = tl.zeros([BLOCK_G], tl.float32)  # running softmax denominator
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        kb = K + b * sk_b + hk * sk_h
        vb = V + b * sk_b + hk * sk_h
        for s0 in range(lo, hi, BLOCK_N):
            slot = s0 + n
            ok = slot < hi
            offs = slot[:, None] * sk_s + d[None, :]
            k = tl.load(kb + offs, mask=ok[:, None], other=0.0).to(WIDE)  # (BLOCK_N, D), FP8 widened here
            v = tl.load(vb + offs, mask=ok[:, None], other=0.0).to(WIDE)
            s = tl.dot(q, tl.trans(k)) * s_scale  # (BLOCK_G, BLOCK_N) FP32
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            shrink = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l_sum = l_sum * shrink + tl.sum(p, 1)
            acc = acc * shrink[:, None] + tl.dot(p.to(WIDE), v)
            m = m_new
        out = acc / tl.maximum(l_sum, 1.0)[:, None] * tl.load(VS + b * Hk + hk)  # l_sum >= 1 but on an empty span
        o_ptr = O + b * so_b + head[:, None] * so_h + d[None, :]
        tl.store(o_ptr, out.to(O.dtype.element_ty), mask=(g < G)[:, None])

    return decode_kernel


DECODE_CONFIG = {  # launch settings per cache element width: the fastest of a sweep on an H100 at batch 64, 512
    "fp8": {"BLOCK_N": 32, "num_warps": 2, "num_stages": 3},  # positions (benchmarks/gpu_rollout.py, BENCHMARKS 9)
    "wide": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
}


def kernel_supports(head_dim: int) -> bool:
    """The kernel's tiles need a power-of-two head_dim of at least 16 (others use the reference)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def decode_attention(q, k_cache, v_cache, k_scale, v_scale, start, end, width: int, sm_scale: float,
                     use_kernel: bool | None = None):  # fmt: skip
    """Decode attention (see the module docstring): the Triton kernel on CUDA when Triton is installed (no host
    synchronisation, so CUDA graphs can capture it) and the query is not FP32 (the kernel computes in BF16), else
    the PyTorch reference. Both read slots [start_b, end_b), an empty span giving 0; the reference also clips the span
    at `width`, which the kernel leaves to its callers (the engine's end_b never passes it): a slot count the kernel
    took as an argument would be specialised by Triton at 1, and the warm-up would then build another kernel than the
    one CUDA-graph capture launches."""
    if q.dim() != 3 or k_cache.dim() != 4 or q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"decode attention needs q (B, H, D) and caches (B, Hk, S, D) with H a multiple of Hk (each "
                         f"kv head serves H / Hk query heads); got q {tuple(q.shape)}, cache {tuple(k_cache.shape)}")
    if use_kernel is None:  # the kernel's layout, or the reference
        layout = k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
        use_kernel = (q.is_cuda and q.dtype != torch.float32 and triton_available() and kernel_supports(q.shape[-1])
                      and layout)  # fmt: skip
    if not use_kernel:
        return decode_attention_ref(q, k_cache, v_cache, k_scale, v_scale, start, end, width, sm_scale)
    B, H, D = q.shape
    Hk = k_cache.shape[1]
    G = H // Hk
    if not kernel_supports(D):
        raise ValueError(f"the decode kernel needs a power-of-two head_dim >= 16, got {D}")
    q = q.contiguous()
    out = torch.empty_like(q)
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("the decode kernel needs K and V caches of one contiguous (B, Hk, S, D) layout")
    _kernel()[(B, Hk)](
        q, k_cache, v_cache, k_scale, v_scale, start, end, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), sm_scale, k_cache.shape[2], Hk,
        G=G, BLOCK_G=max(16, 1 << math.ceil(math.log2(G))), D=D, WIDE=_wide(),
        **DECODE_CONFIG["fp8" if k_cache.element_size() == 1 else "wide"],
    )  # fmt: skip
    return out


def _wide():
    import os

    import triton.language as tl

    # Triton's CPU interpreter (tests without a GPU) multiplies BF16 bit patterns as integers: widen to FP32 there
    return tl.float32 if os.environ.get("TRITON_INTERPRET") == "1" else tl.bfloat16
