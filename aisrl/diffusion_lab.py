"""The diffusion lab: a tiny masked-diffusion policy warm-started on a procedural task, for GRPO on a CPU.

Same idea as `aisrl.lab` for causal models: the character tokenizer (plus one [MASK] id after its
vocabulary), solver traces of a procedural task (4x4 Sudoku in the diffusion_lab preset), and a supervised warm
start of a fixed number of steps (`LabConfig.sft_steps`; the loop is `aisrl.lab.run_sft`),
cached on disk by configuration.
The warm start is LLaDA's masked-token objective: the completion is padded with EOS to gen_length, a time
t ~ U(0, 1) per sequence, raised to at least 1e-3 (1/t weights a tiny t's few masked tokens without bound), masks each
completion token with probability t, and the loss is the cross-entropy of the masked tokens weighted by 1/t,
averaged over completion positions (an upper bound on the negative log-likelihood).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from aisrl.diffusion import DiffusionParams, tiny_diffusion_model
from aisrl.lab import (
    HELD_OUT,
    CharTokenizer,
    LabConfig,
    _cache_dir,
    completion_text,
    lab_task,
    load_cached,
    prompt_text,
    publish_cache,
    run_sft,
    sft_trainer,
)


def mask_id_of(tok: CharTokenizer) -> int:
    return len(tok)


def encode_prompt(tok: CharTokenizer, p) -> list[int]:
    return [tok.bos_token_id] + tok.encode(prompt_text(p))


def diffusion_accuracy(model, tok, task, problems, params: DiffusionParams) -> float:
    """Greedy (temperature 0) accuracy, scored as the trainer scores it (completion up to its first EOS)."""
    from aisrl.policy import DiffusionPolicy
    from aisrl.trainer import evaluate

    policy = DiffusionPolicy(params, mask_id_of(tok), tok.pad_token_id, tok.eos_token_id)
    return evaluate(model, tok, task, lambda p: encode_prompt(tok, p), problems, policy)


def diffusion_lab_model(cfg: LabConfig, params: DiffusionParams, verbose: bool = True, warm: bool = True):
    """(model, tokenizer, info): the warm-started diffusion lab policy, trained once and cached (`warm=False`: as
    aisrl.lab.lab_model's)."""
    from safetensors.torch import load_file, save_file

    tok = CharTokenizer()
    key = {"lab": cfg, "gen_length": params.gen_length, "block_length": params.block_length, "steps": params.steps,
           "remasking": params.remasking}  # fmt: skip
    cache = _cache_dir(_Key(**key), kind="diffusion_lab")
    task = lab_task(cfg)
    train = task.problems("train", cfg.sft_examples, seed=cfg.seed)
    held = task.problems("test", HELD_OUT, seed=cfg.seed + 1)
    need = max(len(encode_prompt(tok, p)) for p in train + held) + params.gen_length  # prompt and completion
    max_len = 128 if need <= 128 else 128 * 2 ** math.ceil(math.log2((need + 32) / 128))  # 128: every earlier lab
    model = tiny_diffusion_model(len(tok) + 1, mask_id_of(tok), hidden=cfg.hidden, layers=cfg.layers,
                                 max_len=max_len, seed=cfg.seed)  # fmt: skip
    seqs = [(encode_prompt(tok, p), tok.encode(completion_text(p)) + [tok.eos_token_id]) for p in train]
    if (longest := max(len(c) for _, c in seqs)) > params.gen_length:  # a warm start, or a checkpoint scored with it
        fit = -(-longest // params.block_length) * params.block_length  # the next multiple of the block length
        raise ValueError(f"rollout.max_new_tokens={params.gen_length} (the diffusion generation length) is shorter "
                         f"than the lab task's completions ({longest} tokens with EOS): set rollout.max_new_tokens="
                         f"{fit} or more, a multiple of diffusion.block_length={params.block_length}")  # fmt: skip
    if (cache / "info.json").exists():
        load_cached(cache, lambda: model.load_state_dict(load_file(cache / "model.safetensors")))
        return model.eval(), tok, load_cached(cache, lambda: json.loads((cache / "info.json").read_text()))
    if not warm:
        return model.eval(), tok, {}
    loss_of = lambda batch, gen: masked_sft_loss(model, batch, params.gen_length, tok, gen)  # noqa: E731
    train_steps = sft_trainer(cfg, model, seqs, loss_of)

    def accuracy() -> float:
        model.eval()
        return diffusion_accuracy(model, tok, task, held, params)

    step, acc = run_sft(cfg, train_steps, accuracy, "diffusion lab SFT" if verbose else None)
    info = {"sft_steps": step, "heldout_greedy_accuracy": acc, "params": sum(p.numel() for p in model.parameters())}
    publish_cache(cache, lambda tmp: (save_file(model.state_dict(), tmp / "model.safetensors"),
                                      (tmp / "info.json").write_text(json.dumps(info))))  # fmt: skip
    return model.eval(), tok, info


@dataclass
class _Key:
    """What determines the warm start (the cache key): the lab config and the generation settings. The denoising
    steps and remasking rule belong to it although they train nothing: with `lab.target` set, the SFT stops at the
    first held-out check inside the band, and that check samples with them; info.json records its accuracy."""

    lab: LabConfig
    gen_length: int
    block_length: int
    steps: int
    remasking: str


def masked_sft_loss(model, batch, gen_length: int, tok: CharTokenizer, gen: torch.Generator) -> torch.Tensor:
    """LLaDA's SFT objective on (prompt, completion + EOS) pairs, completions EOS-padded to gen_length."""
    p = max(len(a) for a, _ in batch)
    x = torch.full((len(batch), p + gen_length), tok.eos_token_id)
    attn = torch.ones_like(x, dtype=torch.bool)
    for i, (a, c) in enumerate(batch):
        x[i, p - len(a) : p] = torch.tensor(a)
        x[i, : p - len(a)] = tok.pad_token_id
        attn[i, : p - len(a)] = False
        x[i, p : p + len(c)] = torch.tensor(c)
    t = torch.rand(len(batch), 1, generator=gen).clamp(min=1e-3)  # (B, 1) masking level
    masked = torch.rand(len(batch), gen_length, generator=gen) < t  # (B, G)
    noisy = x.clone()
    noisy[:, p:] = torch.where(masked, mask_id_of(tok), x[:, p:])
    logits = model(noisy, attention_mask=attn).logits[:, p:]  # (B, G, V)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, p:].reshape(-1), reduction="none")
    return ((ce.view(len(batch), gen_length) * masked) / t).sum() / (len(batch) * gen_length)
