"""What a training config must satisfy before anything is built: `validate(cfg)` checks names against their
registries (corrections, losses, formats, devices, tasks) and refuses settings that cannot train together, each
error naming the key and what to give instead. The checks run in sections (correction, loss, rollout, model,
schedule, LoRA, task), in that order, so the first problem of a config is the one reported.
"""

from __future__ import annotations

import os
from pathlib import Path

from aisrl.calibrate import RULES, check_candidates, check_mixable
from aisrl.correction import CORRECTIONS, check_options
from aisrl.lab import check_lab
from aisrl.losses import AGGREGATIONS, LOSSES
from aisrl.models import TINY
from aisrl.quant import PRESETS
from aisrl.rollout import SamplingParams
from aisrl.tasks import check_task
from aisrl.train_config import (
    PRECISIONS,
    TrainConfig,
    correction_options,
    diffusion_params,
    resolve_device,
    rollout_format,
    task_kwargs,
)

MAX_SALT = 1_000_000
"""sample_salt stays below this: larger salts would overflow the engine's int64 seeds."""


def _check_output_dir(path: str, output: str) -> None:
    """That a run can write to `path`, or an error saying which `output` option to change."""
    if not path.strip():
        raise ValueError(f"output_dir is empty; name the directory the run writes to, e.g. {output}=runs/x")
    long = [part for part in Path(path).parts if len(part.encode()) > 255]
    if long:
        raise ValueError(f"output_dir={path}: a name in it is {len(long[0].encode())} bytes, past the 255 a file "
                         f"system takes ({long[0][:40]}...); choose a shorter {output}")  # fmt: skip
    blocked = [p for p in (Path(path), *Path(path).parents) if p.exists() and not p.is_dir()]
    if blocked:
        raise ValueError(f"output_dir={path}: {blocked[-1]} is a file, not a directory; choose another {output}")
    nearest = next(p for p in (Path(path).absolute(), *Path(path).absolute().parents) if p.exists())
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise ValueError(f"output_dir={path} cannot be created or written: {nearest} is not writable; choose "
                         f"another {output}")  # fmt: skip


def validate(cfg: TrainConfig, output: str | None = "output_dir") -> None:
    """Raise ValueError, naming the key and the valid choices, on settings that cannot train; before any model
    is built. `output`: the option that chooses output_dir, named in its errors (`out` for a study command, which
    sets output_dir per run); None where nothing is written (scoring a run), which skips those checks."""
    _check_correction(cfg)
    _check_loss(cfg)
    _check_rollout(cfg)
    _check_model(cfg)
    _check_schedule(cfg, output)
    _check_lora(cfg)
    _check_task(cfg)


def _check_correction(cfg: TrainConfig) -> None:
    """The correction.* keys: the correction and its options, calibration, the veto and the guard."""
    if cfg.correction.name not in CORRECTIONS:
        raise ValueError(f"unknown correction {cfg.correction.name!r}; choose from {sorted(CORRECTIONS)}")
    if cfg.correction.calibrate_every < 0:
        raise ValueError(f"correction.calibrate_every must be 0 (off) or a number of steps, got "
                         f"{cfg.correction.calibrate_every}")  # fmt: skip
    if cfg.correction.calibrate_window < 1:
        raise ValueError(f"correction.calibrate_window must be >= 1, got {cfg.correction.calibrate_window}")
    if cfg.correction.calibrate_rule not in RULES:
        raise ValueError(f"unknown correction.calibrate_rule {cfg.correction.calibrate_rule!r}; choose from "
                         f"{sorted(RULES)}")  # fmt: skip
    calibrating = cfg.correction.calibrate_every > 0
    if calibrating:
        check_candidates(cfg.correction.candidates)
        if cfg.correction.bypass or cfg.rollout.pool or cfg.rollout.align:
            raise ValueError("correction.calibrate_every chooses an importance-weighting correction: it needs the "
                             "trainer's log-probs (correction.bypass=false) and neither rollout.pool nor rollout.align")
    if not 0.0 <= cfg.correction.veto < 1.0:
        raise ValueError(f"correction.veto is a weight below which a sequence is dropped, in [0, 1); "
                         f"got {cfg.correction.veto}")  # fmt: skip
    own = sorted(set(cfg.correction.options) & {"cap", "ema", "prev_alpha", "alpha", "veto"})
    if own:
        raise ValueError(f"correction.options sets {own}: set them with their own keys (correction.cap=..., ...)")
    if cfg.correction.ema and calibrating:  # each candidate would be handed it, and only ais takes it
        raise ValueError("correction.ema smooths AIS's alpha across steps, and correction.calibrate_every chooses "
                         "a correction each step instead: set correction.ema=0 while calibrating")  # fmt: skip
    if cfg.correction.ema and cfg.correction.name != "ais":
        raise ValueError(f"correction.ema smooths AIS's alpha across steps: it needs correction.name=ais; set "
                         f"correction.ema=0 for {cfg.correction.name!r}")  # fmt: skip
    for name in cfg.correction.candidates if calibrating else [cfg.correction.name]:
        try:  # the correction checks its own options (cap, ema, alpha) on a one-token batch, before any model
            check_options(name, **correction_options(cfg, None, name))
        except (ValueError, TypeError) as e:  # TypeError: an option's value of the wrong type, e.g. {'floor': '0.5'}
            raise ValueError(f"correction settings: {e}") from e
    if calibrating and cfg.correction.calibrate_rule == "mix":
        check_mixable(cfg.correction.candidates, lambda name: correction_options(cfg, None, name))
    if cfg.correction.bypass and cfg.correction.guard > 0:
        raise ValueError("correction.bypass=true scores with the rollout log-probs themselves, so the k3 KL the guard "
                         "watches is 0 at every step: drop correction.guard or the bypass")  # fmt: skip
    if cfg.correction.guard < 0 or 0 < cfg.correction.guard <= 1:
        raise ValueError(f"correction.guard is a factor over the recent k3 KL: 0 (off) or above 1, e.g. 4; "
                         f"got {cfg.correction.guard}")  # fmt: skip


def _check_loss(cfg: TrainConfig) -> None:
    """The seeds, the loss and its aggregation."""
    if not 0 <= cfg.seed < 1_000_000_000:  # with the salt, the step's sampling seeds stay within int64
        raise ValueError(f"seed must be in [0, 1000000000), got {cfg.seed}")
    if not 0 <= cfg.sample_salt < MAX_SALT:
        raise ValueError(f"sample_salt must be in [0, {MAX_SALT}), got {cfg.sample_salt}")
    if cfg.agg not in AGGREGATIONS:
        raise ValueError(f"unknown agg {cfg.agg!r}; choose from {list(AGGREGATIONS)}")
    if cfg.loss not in LOSSES:
        raise ValueError(f"unknown loss {cfg.loss!r}; choose from {sorted(LOSSES)}")
    if cfg.loss == "tbpo" and cfg.agg != TrainConfig.agg:
        raise ValueError(f"agg={cfg.agg!r} is the grpo loss's aggregation; tbpo always averages over sequences: "
                         "leave agg at its default with loss=tbpo")  # fmt: skip
    if cfg.dual_clip and not cfg.dual_clip > 1:  # (NaN too)
        raise ValueError(f"dual_clip must be 0 (off) or > 1, got {cfg.dual_clip}")


def _check_rollout(cfg: TrainConfig) -> None:
    """The rollout.* keys: QaRL alignment, Sol-RL pools, the format and the engine."""
    if cfg.rollout.align and (cfg.rollout.quant == "none" or cfg.lora.r > 0):
        raise ValueError("rollout.align (QaRL) needs a rollout format (rollout.quant) and full fine-tuning (lora.r=0)")
    if cfg.rollout.align and cfg.precision != "fp32":
        raise ValueError(f"rollout.align computes the trainer's linear layers as the rollout copy does, and "
                         f"precision={cfg.precision} would autocast every other operation, which the copy computes "
                         "in FP32: the mismatch would come back; use precision=fp32 with rollout.align")  # fmt: skip
    if cfg.rollout.align and cfg.rollout.quant in PRESETS and PRESETS[cfg.rollout.quant].kv_cache:
        raise ValueError(f"rollout.align aligns the linear layers, not the FP8 KV cache of {cfg.rollout.quant!r}, "
                         "which would then be most of the mismatch left; use the preset without _kv")  # fmt: skip
    if cfg.rollout.pool and cfg.correction.name != "none":
        raise ValueError("rollout.pool (Sol-RL) trains the kept samples as on-policy: set correction.name=none "
                         "(the mismatch metrics are still logged)")  # fmt: skip
    if cfg.rollout.pool and cfg.correction.bypass:  # on-policy only once rescored: the ratio would be pi / mu
        raise ValueError("rollout.pool (Sol-RL) rescores the kept samples at training precision, which "
                         "correction.bypass=true skips (its old log-probs are the rollout's): set "
                         "correction.bypass=false")  # fmt: skip
    per_step = cfg.prompts_per_step * max(cfg.group_size, cfg.rollout.pool)
    if per_step > 4096:  # aisrl.trainer seeds row i of a step with stream * 4096 + i
        raise ValueError(f"prompts_per_step x {'rollout.pool' if cfg.rollout.pool > cfg.group_size else 'group_size'} "
                         f"= {per_step} "
                         "samples a step; the sampling seeds of a step are distinct from the next step's for up to "
                         "4096: lower one of them")  # fmt: skip
    if cfg.rollout.pool and cfg.rollout.pool <= cfg.group_size:
        raise ValueError(
            f"rollout.pool (Sol-RL) must exceed group_size={cfg.group_size} or be 0, got {cfg.rollout.pool}"
        )
    try:
        rollout_format(cfg)  # raises with the list of presets, or on a bad keep list
    except ValueError as e:
        raise ValueError(f"rollout.quant / rollout.keep: {e}") from e
    if cfg.rollout.engine not in ("hf", "static"):
        raise ValueError(f"unknown rollout.engine {cfg.rollout.engine!r}; choose from ['hf', 'static']")
    if cfg.rollout.engine == "static" and (cfg.model.kind != "causal" or cfg.rollout.align):
        raise ValueError("rollout.engine=static samples causal LMs without QaRL alignment (rollout.align=false)")
    if cfg.rollout.engine == "static" and cfg.correction.calibrate_every:
        raise ValueError("correction.calibrate_every pairs each rollout batch with a full-precision one drawn by the "
                         "HF sampler under the same seeds, and rollout.engine=static draws its own random numbers: "
                         "calibrate with rollout.engine=hf, or set correction.calibrate_every=0")  # fmt: skip
    if cfg.rollout.engine == "static":
        from aisrl.engine import ENGINE_PRESETS

        if cfg.rollout.quant not in ("none", *ENGINE_PRESETS):
            raise ValueError(f"rollout.engine=static runs real FP8 GEMMs and cannot sample rollout.quant="
                             f"{cfg.rollout.quant!r}; use rollout.quant=none or one of {list(ENGINE_PRESETS)}, "
                             "or rollout.engine=hf, which emulates every format")  # fmt: skip


def _check_model(cfg: TrainConfig) -> None:
    """The model.* and diffusion.* keys."""
    if cfg.model.name in TINY:
        raise ValueError(f"model.name={cfg.model.name!r} is a tokenizer-less test model and cannot be trained; use "
                         "model.name=lab (the warm-started tiny model), smollm2 or a local Hugging Face directory")
    if cfg.model.kind not in ("causal", "diffusion"):
        raise ValueError(f"unknown model.kind {cfg.model.kind!r}; choose from ['causal', 'diffusion']")
    if cfg.model.kind == "diffusion":
        try:  # a bad block/step geometry, in the run's own keys
            diffusion_params(cfg)
        except ValueError as e:
            keys = "gen_length is rollout.max_new_tokens, block_length diffusion.block_length, steps diffusion.steps"
            raise ValueError(f"diffusion settings: {e} ({keys})") from e
        if not 0 <= cfg.diffusion.p_mask < 1:
            raise ValueError(f"diffusion.p_mask is a probability in [0, 1), got {cfg.diffusion.p_mask}")
        if cfg.rollout.top_k or cfg.rollout.top_p != 1.0:
            raise ValueError("the diffusion sampler draws from the tempered distribution without top-k/top-p "
                             "filters: leave rollout.top_k=0 and rollout.top_p=1 for model.kind=diffusion")  # fmt: skip
        if not cfg.rollout.temperature > 0:  # the argmax would give a group G equal completions: no advantage
            raise ValueError(f"rollout.temperature={cfg.rollout.temperature}: training samples, so it must be > 0 "
                             "(GRPO compares different completions of one prompt)")  # fmt: skip
        if cfg.rollout.quant in PRESETS and PRESETS[cfg.rollout.quant].kv_cache:
            raise ValueError(f"rollout.quant={cfg.rollout.quant!r} quantises a KV cache, which a diffusion model "
                             "(bidirectional, no cache) does not have; use the preset without _kv")  # fmt: skip
        if cfg.diffusion.mask_id < -1 or (cfg.model.name == "lab" and cfg.diffusion.mask_id != -1):
            raise ValueError(f"diffusion.mask_id={cfg.diffusion.mask_id}: -1 (the model's own [MASK] id; the diffusion "
                             "lab's is fixed by its tokenizer) or a model's [MASK] token id (LLaDA-8B: 126336)")


def _check_schedule(cfg: TrainConfig, output: str | None) -> None:
    """Batch sizes, step counts, optimiser settings, the device, the output folder and the lab's settings."""
    if cfg.group_size < 2:
        raise ValueError("group_size must be >= 2 (GRPO advantages compare completions of one prompt)")
    resolve_device(cfg.device)  # raises on a bad name or a GPU that is not there
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"unknown precision {cfg.precision!r}; choose from {sorted(PRECISIONS)}")
    for key in ("max_steps", "prompts_per_step", "micro_batch", "epochs", "eval_every", "checkpoint_every",
                "eval_problems", "train_problems"):  # fmt: skip
        if getattr(cfg, key) < 1:
            raise ValueError(f"config key {key!r} must be >= 1, got {getattr(cfg, key)}")
    if cfg.keep_checkpoints < 0:
        raise ValueError(f"keep_checkpoints is how many of the latest checkpoints a run keeps, >= 0 (0: all); got "
                         f"{cfg.keep_checkpoints}")  # fmt: skip
    if cfg.train_problems < cfg.prompts_per_step:  # known before the model (and a lab's warm start) is built
        raise ValueError(f"train_problems={cfg.train_problems} is fewer than prompts_per_step={cfg.prompts_per_step}: "
                         "a step draws that many distinct training prompts; raise train_problems")  # fmt: skip
    for key, ok, what in (("lr", cfg.lr > 0, "> 0"), ("warmup_steps", cfg.warmup_steps >= 0, ">= 0"),
                          ("clip_low", 0 <= cfg.clip_low < 1, "in [0, 1) (the ratio's lower bound is 1 - clip_low)"),
                          ("clip_high", cfg.clip_high >= 0, ">= 0"), ("kl_coef", cfg.kl_coef >= 0, ">= 0"),
                          ("grad_clip", cfg.grad_clip >= 0, ">= 0 (0 = off)")):  # fmt: skip
        if not ok:
            raise ValueError(f"config key {key!r} must be {what}, got {getattr(cfg, key)}")
    if output is not None:
        _check_output_dir(cfg.output_dir, output)
    if cfg.model.name == "lab":
        check_lab(cfg.lab)


def _check_lora(cfg: TrainConfig) -> None:
    """The lora.* keys."""
    if cfg.lora.r < 0 or not 0 <= cfg.lora.dropout < 1:
        raise ValueError(f"lora.r must be >= 0 (0: full fine-tuning) and lora.dropout in [0, 1); got r={cfg.lora.r}, "
                         f"dropout={cfg.lora.dropout}")  # fmt: skip
    if cfg.lora.r > 0 and not cfg.lora.targets:
        raise ValueError("lora.targets is empty: name the layers the adapters go on (e.g. [q_proj, v_proj]), or set "
                         "lora.r=0 for full fine-tuning")  # fmt: skip
    if cfg.lora.r > 0 and not cfg.lora.alpha > 0:  # the adapters' scale alpha / r: at 0 they add and learn nothing
        raise ValueError(f"lora.alpha must be > 0 with lora.r > 0 (the adapters are scaled by alpha / r); got "
                         f"{cfg.lora.alpha}")  # fmt: skip


def _check_task(cfg: TrainConfig) -> None:
    """The task, its dataset and options, and the sampling parameters."""
    if cfg.model.name == "lab":  # a task setting the lab would silently ignore is refused
        ignored = [f"{k}={v!r}" for k, v, default in (("task", cfg.task, TrainConfig.task),
                   ("dataset", cfg.dataset, ""), ("task_options", cfg.task_options, {})) if v != default]  # fmt: skip
        if ignored:
            raise ValueError(f"{', '.join(ignored)} is set, but model.name=lab trains on its own task (lab.task="
                             f"{cfg.lab.task!r}): choose the lab's problems with lab.* keys (lab.task=...), or clear "
                             f"{' and '.join(k.split('=')[0] for k in ignored)} (for a run that recorded them, in "
                             "its config.json too: they never took effect)")  # fmt: skip
    elif cfg.dataset and cfg.task not in ("dataset", "jsonl", "reasoning_gym"):
        raise ValueError(f"dataset={cfg.dataset!r} is set, but task={cfg.task!r} does not read it (only task=dataset, "
                         "jsonl or reasoning_gym do): set task=dataset to train on the file, or clear dataset (for a "
                         "run that recorded it, in its config.json too: it never took effect)")  # fmt: skip
    check_task(cfg.task, **task_kwargs(cfg))
    local = cfg.model.name != "lab" and cfg.task in ("dataset", "jsonl")
    if local and not (cfg.dataset and Path(cfg.dataset).exists()):
        raise ValueError(f"task={cfg.task} reads a local file or saved dataset, and dataset={cfg.dataset!r} "
                         f"{'is not set' if not cfg.dataset else 'does not exist'}: give its path with dataset=PATH "
                         "(.jsonl, .parquet or a datasets directory)")  # fmt: skip
    if cfg.model.kind == "causal":  # the sampler's own checks, before the lab's warm start or a model load
        try:
            SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.top_p)
        except ValueError as e:
            raise ValueError(f"rollout settings: {e}") from e
