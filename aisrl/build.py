"""What a run is made of, built from its TrainConfig: the model and tokenizer, the task and its problem pools, how the
model samples and scores (aisrl.policy), and the low-precision rollout copy with the function that syncs it.

Why it is its own module: the trainer builds these once per run, and so does everything that looks at a run after it
trained (final scoring, `aisrl eval`, `aisrl doctor`, branches, benchmarks). Building them in one place keeps every
consumer on the same model, prompts and problems as the run itself; the pools, for one, are fixed by the run's seed
(train split with `seed`, held-out split with `seed + 1`).
"""

from __future__ import annotations

import copy
import functools
import warnings
from pathlib import Path

from aisrl.checkpoint import load_weights
from aisrl.lora import apply_lora
from aisrl.policy import CausalPolicy, DiffusionPolicy
from aisrl.quant import quantize_, sync_weights
from aisrl.rollout import SamplingParams
from aisrl.train_config import LoraSettings, TrainConfig, diffusion_params, rollout_format, task_kwargs


def build(cfg: TrainConfig, warm: bool = True):
    """(model, tokenizer, task, encode_prompt) for the configured model and task. `warm=False` where a checkpoint's
    weights replace the model's: the lab's warm start is not trained for that (aisrl.lab.lab_model)."""
    if cfg.model.name == "lab" and cfg.model.kind == "diffusion":
        from aisrl.diffusion_lab import diffusion_lab_model, encode_prompt

        model, tok, _ = diffusion_lab_model(cfg.lab, diffusion_params(cfg), warm=warm)
        return model, tok, task_of(cfg), lambda p: encode_prompt(tok, p)
    if cfg.model.name == "lab":
        from aisrl.lab import lab_model, prompt_text

        model, tok, _ = lab_model(cfg.lab, warm=warm)
        return model, tok, task_of(cfg), lambda p: [tok.bos_token_id] + tok.encode(prompt_text(p))
    if cfg.model.kind == "diffusion":  # a LLaDA-style checkpoint directory with its remote code
        from transformers import AutoTokenizer

        from aisrl.diffusion import load_diffusion_model

        model = load_diffusion_model(cfg.model.name)
        tok = AutoTokenizer.from_pretrained(cfg.model.name, trust_remote_code=True, local_files_only=True)
    else:
        from aisrl.models import load_model

        model, tok = load_model(cfg.model.name)
        if tok is None:
            raise ValueError(f"model {cfg.model.name!r} has no tokenizer; use model.name=lab or a directory with one")
    return model, tok, task_of(cfg), _chat_encoder(tok)


def task_of(cfg: TrainConfig):
    """The run's task, without its model: the lab's own (lab.task and its settings) or the named or file task."""
    if cfg.model.name == "lab":
        from aisrl.lab import lab_task

        return lab_task(cfg.lab, cfg.lenient_reward)
    from aisrl.tasks import make_task

    return make_task(cfg.task, lenient=cfg.lenient_reward, **task_kwargs(cfg))


def with_lora(cfg: TrainConfig, model, dropout: float = 0.0):
    """The model with the run's LoRA adapters (lora.*). The default targets are written for several architectures: one
    this model lacks is no error; a target the user named must match."""
    default = LoraSettings().targets
    optional = default if cfg.lora.targets == default else ()
    return apply_lora(model, cfg.lora.r, cfg.lora.alpha, cfg.lora.targets, dropout, optional=optional)


def build_trained(cfg: TrainConfig, weights: Path):
    """build(cfg) with a checkpoint's weights: for a LoRA run (lora.r > 0) the adapters are applied, loaded and
    merged, so the model returned is the plain model the run trained."""
    model, tok, task, encode = build(cfg, warm=False)
    if cfg.lora.r > 0:
        model = with_lora(cfg, model)
    load_weights(model, weights)
    return (model.merge_and_unload() if cfg.lora.r > 0 else model), tok, task, encode


def _chat_encoder(tok):
    """Problem -> prompt ids: the question and the answer-format instruction as one user turn of the chat template
    (plain text when the tokenizer has no template)."""
    from aisrl.models import prompt_ids
    from aisrl.tasks import INSTRUCTION

    return lambda p: prompt_ids(tok, f"{p.question}\n{INSTRUCTION}")


def _mask_id(cfg: TrainConfig, tok, model) -> int:
    """The [MASK] id of a diffusion model: diffusion.mask_id, else the checkpoint's config, else the tokenizer's."""
    if cfg.diffusion.mask_id >= 0:
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)  # remote-code models may lack embeddings
        if vocab is not None and cfg.diffusion.mask_id >= vocab:
            raise ValueError(f"diffusion.mask_id={cfg.diffusion.mask_id} is outside {cfg.model.name!r}'s vocabulary "
                             f"[0, {vocab}); give its [MASK] token id, or -1 to read it from the checkpoint")
        return cfg.diffusion.mask_id
    if cfg.model.name == "lab":
        from aisrl.diffusion_lab import mask_id_of

        return mask_id_of(tok)
    for found in (getattr(getattr(model, "config", None), "mask_token_id", None), getattr(tok, "mask_token_id", None)):
        if found is not None:
            return int(found)
    raise ValueError(f"cannot tell the [MASK] token id of {cfg.model.name!r} (neither its config nor its tokenizer "
                     "names one): set diffusion.mask_id (LLaDA-8B uses 126336)")  # fmt: skip


def make_policy(cfg: TrainConfig, tok, model=None):
    """How this model kind samples and scores (aisrl.policy); `model` tells a diffusion checkpoint's [MASK] id."""
    pad = tok.pad_token_id or 0
    if cfg.model.kind == "diffusion":
        return DiffusionPolicy(diffusion_params(cfg), _mask_id(cfg, tok, model), pad, tok.eos_token_id,
                               cfg.diffusion.p_mask, cfg.seed, cfg.micro_batch)  # fmt: skip
    params = SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.top_p)
    return CausalPolicy(params, pad, tok.eos_token_id, cfg.micro_batch, tok)


def problem_sets(cfg: TrainConfig, task) -> tuple[list, list]:
    """(training pool, held-out set) of a run: fixed by its seed, so every consumer sees the same problems. A
    dataset file gives what it holds: fewer than asked is said, since the held-out accuracy is then over fewer, and
    fewer training problems than a step's prompts, or no held-out one, is an error."""
    pool = task.problems("train", cfg.train_problems, seed=cfg.seed)
    held = task.problems("test", cfg.eval_problems, seed=cfg.seed + 1)
    for split, key, got, asked in (("training", "train_problems", pool, cfg.train_problems),
                                   ("held-out", "eval_problems", held, cfg.eval_problems)):  # fmt: skip
        if 0 < len(got) < asked:
            warnings.warn(f"the task gives {len(got)} {split} problems where {key}={asked} asked for more (a dataset "
                          f"holds what it holds); set {key}={len(got)} to say so", stacklevel=2)  # fmt: skip
    if len(pool) < cfg.prompts_per_step or not held:
        raise ValueError(f"the task gives {len(pool)} training and {len(held)} held-out problems; need at least "
                         f"prompts_per_step={cfg.prompts_per_step} and one held-out problem")  # fmt: skip
    return pool, held


def cut_short(cfg: TrainConfig, tok, problems) -> str | None:
    """A warning when a lab run's rollouts stop before the task's longest worked answer (`rollout.max_new_tokens`
    below it): those answers are cut short and score 0, while the warm start measured its accuracy with room for
    them. None otherwise, and for other models (whose answers have no known length)."""
    if cfg.model.name != "lab" or cfg.model.kind != "causal" or not problems:
        return None  # (the diffusion lab refuses a generation length its completions do not fit)
    from aisrl.lab import completion_text

    need = max(len(tok.encode(completion_text(p))) + 1 for p in problems)  # with EOS
    if need <= cfg.rollout.max_new_tokens:
        return None
    return (f"aisrl: warning: rollout.max_new_tokens={cfg.rollout.max_new_tokens} is shorter than the lab task's "
            f"longest worked answer ({need} tokens with EOS): answers cut short score 0; set "
            f"rollout.max_new_tokens={need} or more to give every answer room")


def completion_texts(tok, r) -> list[str]:
    """Decoded completions without special tokens (the EOS that ends a completion is not part of the answer)."""
    return [tok.decode(r.completion_ids[i][r.completion_mask[i]].tolist(), skip_special_tokens=True)
            for i in range(r.completion_ids.shape[0])]  # fmt: skip


def task_rewards(task, tok, r, problems) -> list[tuple[float, bool]]:
    """(reward, correct) of each completion of the rollout r, the i-th scored against problems[i]."""
    return [task.reward(x, p) for x, p in zip(completion_texts(tok, r), problems, strict=True)]


def rollout_model(cfg: TrainConfig, model, device, problems, encode):
    """(rollout, sync): the low-precision copy that samples - a fake-quantised Hugging Face model, or the
    static-cache engine sized for the longest prompt among `problems` (the run's) - and the function that loads the
    trainer's weights into it, returning the seconds it took."""
    if cfg.rollout.engine == "static":
        engine = static_engine(cfg, model, device, problems, encode, rollout_format(cfg))
        return engine, engine.sync
    rollout = copy.deepcopy(model)
    if cfg.rollout.quant != "none":
        quantize_(rollout, rollout_format(cfg))
    rollout.eval().requires_grad_(False)  # a sampler, its quantised layers too: no dropout, no gradients
    return rollout, functools.partial(sync_weights, rollout=rollout)


def static_engine(cfg: TrainConfig, model, device, problems, encode, quant, dtype=None):
    """An aisrl.engine.Engine of `model` in the format `quant` (None: full precision, in `dtype` or the engine's
    default), sized for the longest prompt among `problems` (the run's training pool and held-out set)."""
    from aisrl.engine import Engine

    width = max(len(encode(p)) for p in problems)
    return Engine(model, quant, max_len=width + cfg.rollout.max_new_tokens, device=device, dtype=dtype)
