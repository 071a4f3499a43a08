"""Batched sampling with a KV cache, returning the log-probs the rollout policy actually sampled from.

Why: importance weights w = exp(old_logp - rollout_logp) are only right if `rollout_logp` is the
log-probability under the *processed* sampling distribution (temperature, then top-k, then top-p,
renormalised), exactly what the trainer recomputes with `logprobs(...)` under the same processing.

Generation: left-padded prompts are prefilled once (only the last position's logits are computed), then
one token per step through the model's KV cache. Each request samples by inverse CDF from one uniform
number drawn from its own generator, so a request's completion depends only on its seed and prompt,
not on the batch it shares, as far as the model's arithmetic does: with quantised activations (W8A8, W4A4), a
GEMM of another batch shape rounds differently by an FP32 ulp, which can flip a value's low-precision rounding
and change the completion (the log-probs returned are still those the tokens were drawn from).

Known limit: the uniform has 24 bits and the CDF is FP32, so a token is drawn at a rate rounded to a grid of 2^-24
(about 6e-8) while `rollout_logp` reports its exact log-prob. On a 151,936-token vocabulary with random logits (std
2 and 4) the sampled and the reported distributions differ by 1.5e-3 and 0.7e-3 in total variation per step; with
the lab's vocabulary of tens of tokens it is negligible.
Rows stop at EOS (kept in the completion and its mask), at a stop string
(needs the tokenizer) or at max_new_tokens. An FP8 KV cache (`kv_cache_fp8=True`, the default for a model
quantize_ gave a `*_kv` preset) fake-quantises keys
and values to E4M3 with per-request, per-head scales calibrated on each rollout's prefill, so scales follow the
weights after every sync (FP8-RL's per-step QKV recalibration).

Memory: log-softmax is taken over (B, V) for one step at a time in generation, and over (B, chunk, V)
position chunks in `logprobs`, never over a whole (B, T, V) batch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import numbers
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from aisrl.quant import fp8_kv, kv_scales


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    """Completion length limit."""
    temperature: float = 1.0
    """Softmax temperature (> 0)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens with cumulative probability >= top_p (1 = off)."""
    greedy: bool = False
    """Argmax decoding (evaluation); rollout_logp is then the temperature-processed log-prob of the argmax."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (matched on decoded text; need a tokenizer). One string is taken as a list of one."""

    def __post_init__(self):
        for key in ("max_new_tokens", "top_k"):
            if not isinstance(getattr(self, key), numbers.Integral) or isinstance(getattr(self, key), bool):
                raise ValueError(f"{key} must be an integer, got {getattr(self, key)!r}")
        if isinstance(self.stop, str):  # not its characters, each of which would end a completion
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings (an empty one always matches), got {self.stop}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.max_new_tokens < 1:
            raise ValueError("top_k must be >= 0 and max_new_tokens >= 1")


@dataclass
class Rollout:
    prompt_ids: torch.Tensor  # (B, P) left-padded
    prompt_mask: torch.Tensor  # (B, P) bool
    completion_ids: torch.Tensor  # (B, T) right-padded with pad_id
    completion_mask: torch.Tensor  # (B, T) bool, EOS included
    rollout_logp: torch.Tensor  # (B, T) FP32 log-prob under the processed distribution, 0 where masked

    def select(self, idx: torch.Tensor) -> Rollout:
        """The rows `idx` (a subset or reordering of the batch)."""
        return Rollout(*(getattr(self, f.name)[idx] for f in dataclasses.fields(self)))


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., V) logits -> (..., V) FP32 log-probs of the processed sampling distribution."""
    # at temperature 1, FP32 logits are the caller's own tensor: nothing below may modify x in place
    x = logits.float() if params.temperature == 1.0 else logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -torch.inf)
    if params.top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        drop = probs.cumsum(-1) - probs >= params.top_p  # mass before this token already reaches top_p
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, -torch.inf))
    return x.log_softmax(-1)


def inverse_cdf(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(B, V) processed log-probs and (B,) uniforms in (0, 1) -> (B,) sampled ids: the first token whose
    cumulative probability reaches u (a zero-probability token is never returned). A u of exactly 0, which torch.rand
    returns once in 2^24 draws, is read as 2^-25, below its smallest positive draw: at 0 the first token, whatever its
    probability, would reach it."""
    cdf = _cumsum(logp.exp())  # (B, V), non-decreasing: the count of entries below the target is the first index
    target = (u.clamp(min=2.0**-25) * cdf[:, -1])[:, None]  # (B, 1)
    # reaching it: on CUDA a fusable count that graphs capture; on the CPU the same index by binary search (its
    # cumsum accumulates in FP64, so cdf is exactly monotone there)
    tok = (cdf < target).sum(-1) if cdf.is_cuda else torch.searchsorted(cdf, target).squeeze(-1)
    tok = tok.clamp(max=cdf.shape[-1] - 1)
    return torch.where(torch.isfinite(logp.gather(-1, tok[:, None]).squeeze(-1)), tok, logp.argmax(-1))


@torch.compiler.disable  # inductor (torch 2.11, CUDA) fails to generate a 150k-wide scan: keep it one eager kernel
def _cumsum(x: torch.Tensor) -> torch.Tensor:
    return x.cumsum_(-1)  # in place on a temporary: one (B, V) buffer fewer to allocate every step


def check_pad_id(pad_id: int, vocab: int) -> None:
    """Padding is looked up in the embedding like any token (then masked): a pad id outside [0, vocab), a tokenizer's
    pad token added without resizing the model, would fail as an IndexError deep in the forward pass."""
    if not 0 <= pad_id < vocab:
        raise ValueError(f"pad_id {pad_id} is outside this model's vocabulary [0, {vocab}): padding goes through the "
                         "embedding too; pass a pad_id inside it (the EOS id, say) or resize the model's embeddings")


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists -> (B, P) left-padded ids and bool mask."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = True
    return ids, mask


def _make_cache(fp8: bool, prompt_mask: torch.Tensor | None = None):
    from transformers import DynamicCache

    if not fp8:
        return DynamicCache()

    class FP8KVCache(DynamicCache):
        """Keys/values stored as FP8 E4M3 (fake-quantised); per-request, per-head scales set at the first update
        (the prefill) from the prompt's own positions."""

        scales: dict = {}

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if layer_idx not in self.scales:
                m = prompt_mask if prompt_mask is not None and prompt_mask.shape[1] == key_states.shape[2] else None
                self.scales[layer_idx] = (kv_scales(key_states, m), kv_scales(value_states, m))
            ks, vs = self.scales[layer_idx]
            k = fp8_kv(key_states.float(), ks).to(key_states.dtype)
            v = fp8_kv(value_states.float(), vs).to(value_states.dtype)
            return super().update(k, v, layer_idx, *args, **kwargs)

    cache = FP8KVCache()
    cache.scales = {}
    return cache


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, S)


def eos_list(eos_id) -> list[int]:
    """The end-of-sequence ids as a list: from None (none), an int, a 0-d or 1-d tensor or array, or a sequence."""
    if eos_id is None:
        return []
    if isinstance(eos_id, numbers.Integral):
        return [int(eos_id)]
    if hasattr(eos_id, "tolist"):  # a tensor or array; its truth value is no test of emptiness (tensor([0]))
        return [int(e) for e in torch.as_tensor(eos_id).flatten().tolist()]
    return [int(e) for e in eos_id]


def device_of(model) -> torch.device:
    """Where a model's weights are (the CPU for a weightless toy model): inputs go there, results come back."""
    p = next(model.parameters(), None) if isinstance(model, torch.nn.Module) else None
    return p.device if p is not None else torch.device("cpu")


@torch.no_grad()
def request_seeds(key: tuple[int, ...], n: int) -> list[int]:
    """n per-request seeds for the batch identified by `key` (e.g. seed, step, batch, process): deterministic, and
    different in the low 32 bits, the only bits a CPU torch.Generator keeps (seeds 5 and 5 + 2**32 draw alike), so
    a key that differs anywhere gives other draws."""
    text = "/".join(str(int(k)) for k in key)
    return [int.from_bytes(hashlib.blake2b(f"{text}/{i}".encode(), digest_size=4).digest(), "little") for i in range(n)]


@torch.no_grad()  # sampling never backpropagates: a model whose weights require grad must not record every decode step
def generate(
    model,
    prompts: list[list[int]],
    params: SamplingParams | None = None,
    *,
    seeds: list[int] | None = None,
    pad_id: int | None = None,
    eos_id: int | list[int] | None = None,
    tokenizer=None,
    kv_cache_fp8: bool | None = None,
) -> Rollout:
    """Sample one completion per prompt; see the module docstring. `kv_cache_fp8=None` follows the model: an FP8
    cache when quantize_ gave it a config with kv_cache=True (a `*_kv` preset)."""
    params = params or SamplingParams()
    if kv_cache_fp8 is None:
        kv_cache_fp8 = bool(getattr(getattr(model, "quant_config", None), "kv_cache", False))
    cfg = model.config
    pad_id = pad_id if pad_id is not None else (cfg.pad_token_id if cfg.pad_token_id is not None else 0)
    eos = torch.tensor(eos_list(eos_id if eos_id is not None else cfg.eos_token_id), dtype=torch.long)
    if params.stop and tokenizer is None:
        raise ValueError("stop strings need the tokenizer: generate(..., tokenizer=tok)")
    device = device_of(model)
    check_pad_id(pad_id, model.get_input_embeddings().num_embeddings)
    ids, pmask = left_pad(prompts, pad_id)
    B = len(prompts)
    seeds = list(range(B)) if seeds is None else list(seeds)
    if len(seeds) != B:
        raise ValueError(f"need one seed per prompt: {len(seeds)} seeds for {B} prompts")
    gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
    T = params.max_new_tokens
    out_ids = torch.full((B, T), pad_id, dtype=torch.long)
    out_logp = torch.zeros(B, T)
    done = torch.zeros(B, dtype=torch.bool)
    lengths = torch.zeros(B, dtype=torch.long)
    attn = pmask.to(device)
    cache = _make_cache(kv_cache_fp8, attn)
    pos = _positions(attn)
    step_in, step_pos = ids.to(device), pos
    # transformers 5.x names the cache argument `cache` and warns on `past_key_values`, which 4.x still needs
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft wrapper takes **kwargs
    cache_arg = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
    for t in range(T):
        logits = model(
            input_ids=step_in,
            attention_mask=attn.long(),
            position_ids=step_pos,
            use_cache=True,
            logits_to_keep=1,
            **{cache_arg: cache},
        ).logits[:, -1]  # fmt: skip  (B, V)
        logp = process_logits(logits, params).cpu()  # (B, V)
        if params.greedy:
            tok = logp.argmax(-1)
        else:
            u = torch.stack([torch.rand((), generator=g) for g in gens])  # (B,) one uniform per request
            tok = inverse_cdf(logp, u)
        live = ~done
        out_ids[live, t] = tok[live]
        out_logp[live, t] = logp.gather(-1, tok[:, None]).squeeze(-1)[live]
        lengths += live.long()
        done |= torch.isin(tok, eos) & live
        if params.stop:
            done |= live & _hit_stop(tokenizer, out_ids, lengths, params.stop)
        if bool(done.all()):
            break
        step_in = tok[:, None].to(device)
        attn = torch.cat([attn, torch.ones(B, 1, dtype=torch.bool, device=device)], dim=1)
        step_pos = step_pos[:, -1:] + 1
    T_used = int(lengths.max())
    cmask = torch.arange(T_used)[None] < lengths[:, None]
    return Rollout(ids, pmask, out_ids[:, :T_used], cmask, torch.where(cmask, out_logp[:, :T_used], 0.0))


def _hit_stop(tokenizer, out_ids, lengths, stops) -> torch.Tensor:
    tail = 8 + max(len(s) for s in stops)  # a stop string spans at most this many tokens
    hit = torch.zeros(len(lengths), dtype=torch.bool)
    for i, n in enumerate(lengths.tolist()):
        text = tokenizer.decode(out_ids[i, max(0, n - tail) : n].tolist())
        hit[i] = any(s in text for s in stops)
    return hit


def _ends(completion_mask: torch.Tensor) -> torch.Tensor:
    """(B,) one past each row's last completion token (0 for a row without any)."""
    B, T = completion_mask.shape
    if T == 0:
        return torch.zeros(B, dtype=torch.long, device=completion_mask.device)
    return (completion_mask * torch.arange(1, T + 1, device=completion_mask.device)).amax(1)


def length_order(prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """(B,) row order by completion extent, then prompt length: consecutive micro-batches of it hold rows of
    similar length, so cutting each to its own width (as `logprobs` does) drops the most padding."""
    return _order(prompt_mask, _ends(completion_mask))


def _order(prompt_mask: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return torch.argsort(ends * (prompt_mask.shape[1] + 1) + prompt_mask.sum(1), stable=True)


_HEAD_CHECKED: weakref.WeakSet = weakref.WeakSet()  # models whose forward `logprobs` was checked to reproduce


def _logit_finish(model):
    """The function a causal LM's forward applies to its output head's logits, which `logprobs` must apply too (it
    runs the decoder and the head itself, to apply the head to a chunk of positions at a time): Granite divides by
    `logits_scaling`, Cohere multiplies by `logit_scale`, Gemma 2/3 soft-cap with `c * tanh(logits / c)`. Checked
    once per model against its own forward: a family that finishes its logits some other way is an error, not a
    silent mismatch between `rollout_logp` and the trainer's log-probs."""
    cfg = getattr(model, "config", None)
    scale = (getattr(cfg, "logit_scale", None) or 1.0) / (getattr(cfg, "logits_scaling", None) or 1.0)
    cap = getattr(cfg, "final_logit_softcapping", None)

    def finish(logits: torch.Tensor) -> torch.Tensor:
        logits = logits * scale if scale != 1.0 else logits
        return cap * torch.tanh(logits / cap) if cap else logits

    if model not in _HEAD_CHECKED:
        from aisrl.update import eval_mode

        with torch.no_grad(), eval_mode(model):  # no dropout: the two paths must see the same function
            ids = torch.tensor([[1, 2, 3]], device=device_of(model))
            own = model(input_ids=ids).logits.float()
            hidden = model.get_decoder()(input_ids=ids).last_hidden_state
            ours = finish(model.get_output_embeddings()(hidden)).float()
        if not torch.allclose(own, ours, rtol=1e-3, atol=1e-3 * (1 + own.abs().max().item())):
            raise ValueError(f"{type(model).__name__}'s forward changes its output head's logits in a way "
                             "aisrl.rollout.logprobs does not reproduce (it knows Granite's logits_scaling, Cohere's "
                             "logit_scale and Gemma's final_logit_softcapping), so trainer log-probs would not be "
                             "those of the sampler; please report the model family")  # fmt: skip
        _HEAD_CHECKED.add(model)
    return finish


def _score_chunk(head, finish, hidden: torch.Tensor, tgt: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(b, c) log-probs of the tokens `tgt` from the (b, c, H) states that predict them; the (b, c, V) processed
    log-softmax lives only inside this call."""
    lp = process_logits(finish(head(hidden)).float(), params)  # (b, c, V) FP32 under autocast
    return lp.gather(-1, tgt[..., None]).squeeze(-1)


def logprobs(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    params: SamplingParams | None = None,
    *,
    micro_batch: int = 8,
    chunk: int = 64,
) -> torch.Tensor:
    """(B, T) log-probs of the completion tokens under `model` and the sampling processing of `params`.

    Runs the transformer body on micro-batches of rows of similar length (`length_order`), each cut to its own
    width: prompt columns before its first token and completion columns after its last one hold no token, so
    dropping them changes no result. Applies the output head to `chunk` positions at a time. Differentiable when
    called with grad enabled (the trainer path), where each chunk's head and sampling processing are recomputed in
    backward (activation checkpointing) so that no (b, c, V) tensor outlives its chunk; 0 where completion_mask is
    False.
    """
    params = params or SamplingParams()
    body, head, finish = model.get_decoder(), model.get_output_embeddings(), _logit_finish(model)
    device = device_of(model)
    (B, P), T = prompt_ids.shape, completion_ids.shape[1]
    if T == 0 or B == 0:  # nothing to score (and nothing to differentiate)
        return torch.zeros(B, T, device=completion_mask.device)
    if P == 0 or not prompt_mask[:, -1].all():  # each completion is predicted from its prompt's last column
        raise ValueError("logprobs needs left-padded prompts of one or more tokens (prompt_mask[:, -1] true in every "
                         "row), as generate and left_pad return them")  # fmt: skip
    ends = _ends(completion_mask)  # (B,)
    order = _order(prompt_mask, ends)  # = length_order(prompt_mask, completion_mask)
    parts = []
    for s in range(0, B, micro_batch):
        idx = order[s : s + micro_batch]
        a = int(prompt_mask[idx].any(0).int().argmax())  # first column holding a token (0 if none does)
        t = max(1, int(ends[idx].max()))  # at least one column, so a batch without tokens still has a graph
        ids = torch.cat([prompt_ids[idx, a:], completion_ids[idx, :t]], dim=1).to(device)
        # every token up to a row's last one is context, as when it was sampled: a gap in completion_mask (tokens
        # left out of the loss) hides nothing from the tokens after it
        sampled = torch.arange(t, device=ends.device)[None] < ends[idx, None]  # (b, t)
        mask = torch.cat([prompt_mask[idx, a:], sampled], dim=1).to(device)
        hidden = body(input_ids=ids, attention_mask=mask.long(), position_ids=_positions(mask)).last_hidden_state
        hidden = hidden[:, P - a - 1 : -1]  # (b, t, H): the state that predicts each completion token
        rows = []
        for c in range(0, t, chunk):
            tgt = completion_ids[idx, c : min(c + chunk, t)].to(device)
            if torch.is_grad_enabled():  # recomputed in backward: autograd keeps no chunk's (b, c, V) tensors
                rows.append(checkpoint(_score_chunk, head, finish, hidden[:, c : c + chunk], tgt, params,
                                       use_reentrant=False))  # fmt: skip
            else:
                rows.append(_score_chunk(head, finish, hidden[:, c : c + chunk], tgt, params))  # (b, c)
        parts.append(F.pad(torch.cat(rows, dim=1), (0, T - t)))  # (b, T)
    lp = torch.cat(parts)[torch.argsort(order)].to(completion_mask.device)  # back to the callers' row order
    return torch.where(completion_mask, lp, torch.zeros((), dtype=lp.dtype, device=lp.device))
