"""Masked-diffusion language models (LLaDA-style): a tiny model, block-wise generation, d1 log-probs.

The AIS paper's headline policy is LLaDA-8B-Instruct trained with GRPO on the d1 recipe. A masked-diffusion
LM is a bidirectional transformer that predicts every masked position at once: `model(x).logits` with x the
prompt followed by [MASK] tokens.

Generation (LLaDA, Nie et al. 2025; d1, Zhao et al. 2025). The completion (gen_length positions) starts
fully masked and is split into blocks of block_length, decoded left to right. Each block gets
steps / num_blocks denoising steps; its n masked positions are committed on a schedule: n // s tokens per
step, the first n % s steps one more. At a step the model predicts every position, a token is sampled at
each masked position of the current block (temperature; 0 = argmax), and the k most confident predictions
are committed (remasking='low_confidence': confidence = the model's untempered probability of the sampled
token, renormalised without [MASK], which is never committed (LLaDA's reference keeps [MASK] in that softmax, so its
order of commits can differ slightly); 'random': a uniform draw). Positions after the current block stay masked.

Log-probs (diffu-GRPO, d1). The sequence likelihood of a diffusion LM is intractable; d1 estimates
per-token log-probs with one forward pass on a perturbed input: every completion token masked, each prompt
token masked with probability p_mask, then log p(o_t | perturbed input) at the completion positions. The
prompt masking draws come from a seed that the rollout-side and the trainer-side evaluations share, so the
importance ratio compares the two models on the same input, and identical models give weights of exactly 1.
The draws are per prompt token, counted from each row's first one, so a row is perturbed alike in a micro-batch,
in the whole batch, or padded wider.

A real LLaDA checkpoint directory (Hugging Face remote-code format) loads with `load_diffusion_model(path)`;
nothing is downloaded. `tiny_diffusion_model` builds the small random model of the tests and the lab; its
projections are nn.Linear, so `aisrl.quant.quantize_` makes a low-precision rollout copy of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F

from aisrl.rollout import device_of, inverse_cdf


class _Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.up_proj, self.down_proj = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, h: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        b, t, d = h.shape
        x = self.norm1(h)
        q, k, v = (p(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for p in
                   (self.q_proj, self.k_proj, self.v_proj))  # fmt: skip
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)  # bidirectional: no causal mask
        h = h + self.o_proj(att.transpose(1, 2).reshape(b, t, d))
        return h + self.down_proj(F.gelu(self.up_proj(self.norm2(h))))


class MaskedDiffusionLM(nn.Module):
    """A small bidirectional transformer: token + learned position embeddings, pre-norm blocks, a head."""

    def __init__(self, vocab_size: int, mask_token_id: int, hidden: int = 64, layers: int = 2, heads: int = 4,
                 max_len: int = 256):  # fmt: skip
        super().__init__()
        self.mask_token_id, self.max_len = mask_token_id, max_len
        self.embed = nn.Embedding(vocab_size, hidden)
        self.pos = nn.Embedding(max_len, hidden)
        self.blocks = nn.ModuleList(_Block(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        t = input_ids.shape[1]
        if t > self.max_len:
            raise ValueError(f"sequence of {t} tokens exceeds the model's max_len={self.max_len}")
        if attention_mask is None:
            pos = torch.arange(t, device=input_ids.device)  # (T,)
        else:  # counted from each row's first token: left padding does not move a row's positions
            pos = (attention_mask.long().cumsum(1) - 1).clamp(min=0)  # (B, T)
        h = self.embed(input_ids) + self.pos(pos)
        keep = None if attention_mask is None else attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T) keys
        for blk in self.blocks:
            h = blk(h, keep)
        return SimpleNamespace(logits=self.lm_head(self.norm(h)))


def tiny_diffusion_model(vocab_size: int, mask_token_id: int, hidden: int = 64, layers: int = 2, heads: int = 4,
                         max_len: int = 256, seed: int = 0) -> MaskedDiffusionLM:  # fmt: skip
    torch.manual_seed(seed)
    return MaskedDiffusionLM(vocab_size, mask_token_id, hidden, layers, heads, max_len).eval()


def load_diffusion_model(path: str, dtype: torch.dtype = torch.float32):
    """A local LLaDA-style checkpoint directory (remote code included in the directory); no downloads."""
    if not Path(path).is_dir():
        raise FileNotFoundError(f"{path!r} is not a directory; pass a local LLaDA checkpoint directory")
    from transformers import AutoModel

    return AutoModel.from_pretrained(path, trust_remote_code=True, local_files_only=True, dtype=dtype).eval()


@dataclass
class DiffusionParams:
    gen_length: int = 32
    """Completion positions (a multiple of block_length)."""
    block_length: int = 8
    """Positions decoded together, left to right block by block."""
    steps: int = 16
    """Denoising steps in total (a multiple of the number of blocks)."""
    temperature: float = 1.0
    """Sampling temperature of the committed tokens (0 = argmax)."""
    remasking: str = "low_confidence"
    """Which predictions to commit first: 'low_confidence' (most probable first) or 'random'."""

    def __post_init__(self):
        if self.gen_length < 1 or self.block_length < 1:
            raise ValueError(f"gen_length={self.gen_length} and block_length={self.block_length} must be >= 1")
        if self.gen_length % self.block_length:
            raise ValueError(f"gen_length={self.gen_length} must be a multiple of block_length={self.block_length}")
        blocks = self.gen_length // self.block_length
        if self.steps % blocks or self.steps < blocks:
            raise ValueError(f"steps={self.steps} must be a positive multiple of the number of blocks ({blocks})")
        if self.remasking not in ("low_confidence", "random"):
            raise ValueError(f"unknown remasking {self.remasking!r}; choose from ['low_confidence', 'random']")
        if not 0 <= self.temperature < math.inf:  # NaN too; below 0 the argmax, at inf NaN logits (every token id 0)
            raise ValueError(f"temperature={self.temperature} must be >= 0 and finite (0 = argmax)")


def transfer_schedule(n_masked: torch.Tensor, steps: int) -> torch.Tensor:
    """(B,) masked counts -> (B, steps) tokens to commit per step: n // steps each, the first n % steps +1."""
    base = n_masked[:, None] // steps
    extra = (torch.arange(steps)[None] < (n_masked % steps)[:, None]).long()
    return base + extra  # (B, steps)


@torch.no_grad()
def diffusion_generate(model, prompts: list[list[int]], params: DiffusionParams, *, mask_id: int, pad_id: int = 0,
                       seeds: list[int] | None = None, trace: list | None = None,
                       micro_batch: int | None = None):  # fmt: skip
    """(x (B, P + gen_length) with the prompts left-padded, attention mask (B, P + gen_length)).

    seeds: one per prompt (None: the row index). Each denoising step runs the model, and picks tokens from its
    logits, on `micro_batch` rows at a time (None: all), on the model's device, so no more than that many rows'
    full-vocabulary logits exist at once and only their tokens and confidences come back; rows do not interact, so
    the result is the same. `trace`, if a list, receives one (block, step, committed (B, L) bool) entry per step
    (for tests)."""
    if not prompts or not all(len(ids) for ids in prompts):
        raise ValueError("diffusion_generate needs one or more prompts, each of one or more tokens")
    seeds = list(range(len(prompts))) if seeds is None else [int(s) for s in seeds]
    if len(seeds) != len(prompts):
        raise ValueError(f"need one seed per prompt: {len(seeds)} seeds for {len(prompts)} prompts")
    b, p, g = len(prompts), max(map(len, prompts)), params.gen_length
    mb = micro_batch or b
    x = torch.full((b, p + g), mask_id, dtype=torch.long)
    attn = torch.ones(b, p + g, dtype=torch.bool)
    for i, ids in enumerate(prompts):
        x[i, : p - len(ids)] = pad_id
        attn[i, : p - len(ids)] = False
        x[i, p - len(ids) : p] = torch.tensor(ids)
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    device = device_of(model)  # the model may sit on a GPU; the sampler's state stays on the CPU
    attn_dev = attn.to(device)
    blocks = g // params.block_length
    per_block = params.steps // blocks
    for blk in range(blocks):
        lo, hi = p + blk * params.block_length, p + (blk + 1) * params.block_length
        schedule = transfer_schedule((x[:, lo:hi] == mask_id).sum(-1), per_block)  # (B, per_block)
        for step in range(per_block):
            masked = x[:, lo:hi] == mask_id  # (B, K)
            # row i's draws depend only on its seed and its own prompt length, not on its batch-mates' (the
            # block's columns counted from the row's own first token)
            u = torch.stack([torch.rand(2, n + g, generator=gen)[:, n + lo - p : n + hi - p]
                             for gen, n in zip(gens, map(len, prompts), strict=True)])  # (B, 2, K)  # fmt: skip
            picks = [_pick(model(x[r : r + mb].to(device), attention_mask=attn_dev[r : r + mb]).logits[:, lo:hi],
                           u[r : r + mb].to(device), params, mask_id) for r in range(0, b, mb)]  # fmt: skip
            x0 = torch.cat([t for t, _ in picks])  # (B, K)
            conf = torch.cat([c for _, c in picks]) if params.remasking == "low_confidence" else u[:, 1]  # (B, K)
            conf = torch.where(masked, conf, -torch.inf)
            order = torch.sort(conf, dim=-1, descending=True, stable=True).indices  # (B, K)
            rank = torch.empty_like(order).scatter_(
                1, order, torch.arange(hi - lo).expand_as(order)
            )  # position -> rank
            commit = (rank < schedule[:, step : step + 1]) & masked  # the k most confident masked positions
            x[:, lo:hi] = torch.where(commit, x0, x[:, lo:hi])
            if trace is not None:
                full = torch.zeros_like(x, dtype=torch.bool)
                full[:, lo:hi] = commit
                trace.append((blk, step, full))
    return x, attn


def _pick(logits: torch.Tensor, u: torch.Tensor, params: DiffusionParams, mask_id: int):
    """((b, K) tokens, (b, K) confidences) of a micro-batch's block logits (b, K, V), on their device and brought to
    the CPU: each position's token drawn from the tempered distribution with uniforms u[:, 0] (inverse CDF; the argmax
    at temperature 0), never [MASK], and its untempered probability over the tokens other than [MASK]
    (low-confidence remasking's confidence)."""
    logits = logits.float()
    logits[..., mask_id] = -torch.inf  # a committed token is never [MASK]
    if params.temperature > 0:  # inverse-CDF sampling; never a zero-probability token such as [MASK]
        logp = (logits / params.temperature).log_softmax(-1)  # (b, K, V)
        x0 = inverse_cdf(logp.flatten(0, 1), u[:, 0].flatten()).view(logits.shape[:2])  # (b, K)
    else:
        x0 = logits.argmax(-1)  # (b, K)
    conf = logits.softmax(-1).gather(-1, x0[..., None]).squeeze(-1)  # (b, K) untempered
    return x0.cpu(), conf.cpu()


def diffusion_logprobs(model, x: torch.Tensor, attn: torch.Tensor, prompt_len: int, completion_mask: torch.Tensor,
                       *, mask_id: int, p_mask: float = 0.15, seed: int = 0) -> torch.Tensor:  # fmt: skip
    """(B, T) d1 log-probs of the completion tokens x[:, prompt_len:] (0 where completion_mask is False).

    One forward pass on x with every completion position masked and each real prompt token masked with
    probability p_mask, drawn from torch.Generator seeded with `seed` (share it between rollout and trainer).
    The draws are per prompt token, counted from the row's first one and the same for every row, so a row gets
    the masks it gets in any batch (a micro-batch, another rank's share, another padding width). Prompts must be
    left-padded, as diffusion_generate leaves them. `attn` may be bool or 0/1 (Hugging Face's convention)."""
    attn = attn.bool()
    if prompt_len and not attn[:, prompt_len - 1].all():
        raise ValueError("diffusion_logprobs needs left-padded prompts (attn[:, prompt_len - 1] true in every row), "
                         "as diffusion_generate returns them")  # fmt: skip
    lengths = attn[:, :prompt_len].sum(1).tolist()
    draws = torch.ones(x.shape[0], prompt_len, device=attn.device)  # (B, P): padding never masked
    for i, n in enumerate(lengths):
        if n:  # drawn on the CPU's generator, the same stream whatever device the inputs are on
            draws[i, prompt_len - n :] = torch.rand(n, generator=torch.Generator().manual_seed(seed)).to(attn.device)
    noisy = x.clone()
    prompt_masked = (draws < p_mask) & attn[:, :prompt_len]
    noisy[:, :prompt_len] = torch.where(prompt_masked, mask_id, x[:, :prompt_len])
    noisy[:, prompt_len:] = mask_id
    device = device_of(model)
    logits = model(noisy.to(device), attention_mask=attn.to(device)).logits[:, prompt_len:].float()  # (B, T, V)
    target = x[:, prompt_len:].to(device)
    # the target's logit less the log-normaliser: no (B, T, V) log-softmax beside the logits
    logp = (logits.gather(-1, target[..., None]).squeeze(-1) - logits.logsumexp(-1)).to(x.device)  # (B, T)
    return torch.where(completion_mask.bool().to(logp.device), logp, 0.0)  # a 0/1 mask too
