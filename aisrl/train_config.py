"""Training configuration: typed dataclasses, YAML presets, dotted `key=value` overrides.

    cfg = load_config("lab", ["max_steps=20", "correction.name=tis", "rollout.quant=none"])

A preset is a name in aisrl/presets/ or a path to a YAML file (read by a yaml.SafeLoader that refuses a key given
twice) or to a run's config.json (read as JSON); its values are checked against the same field types as the
overrides, so an unknown key or a wrong type fails with a message naming the key either way. `validate(cfg)` then
checks what types cannot: names against their registries (corrections, losses, formats, devices) and the settings
that cannot train together, before any model is built.
"""

from __future__ import annotations

import json
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aisrl.calibrate import RULES, check_candidates, check_mixable
from aisrl.config import apply_mapping, apply_overrides, is_file
from aisrl.correction import CORRECTIONS, check_options, options_of
from aisrl.lab import LabConfig, check_lab
from aisrl.losses import AGGREGATIONS, LOSSES
from aisrl.models import TINY
from aisrl.quant import PRESETS, quant_config
from aisrl.rollout import SamplingParams
from aisrl.tasks import check_task

PRESET_DIR = Path(__file__).parent / "presets"
DEFAULT_PRESET = "lab_columns"  # the main job (`make run`): what `aisrl train` and `aisrl eval` run without a preset


@dataclass
class ModelConfig:
    name: str = "lab"
    """'lab' (warm-started tiny model), 'smollm2', a local Hugging Face directory with its tokenizer, or a repository
    id already in the local Hugging Face cache (e.g. Qwen/Qwen3-1.7B; nothing is downloaded). The tiny-* test models
    have no tokenizer, so they cannot be trained."""
    kind: str = "causal"
    """'causal' (autoregressive LM) or 'diffusion' (masked-diffusion LM, LLaDA-style; see aisrl.diffusion)."""


@dataclass
class DiffusionSettings:
    block_length: int = 8
    """Completion positions decoded together (rollout.max_new_tokens is the generation length)."""
    steps: int = 20
    """Denoising steps in total over all blocks."""
    remasking: str = "low_confidence"
    """Commit order: 'low_confidence' (most probable first) or 'random'."""
    p_mask: float = 0.15
    """d1 log-probs: probability of masking each prompt token (seeded per step, shared by rollout and trainer)."""
    mask_id: int = -1
    """[MASK] token id (-1: the checkpoint config's `mask_token_id`, else the tokenizer's; LLaDA-8B uses 126336)."""


@dataclass
class RolloutConfig:
    quant: str = "fp8_e4m3_w8a8"
    """Rollout precision: a preset of aisrl.quant.PRESETS, or 'none' for full-precision rollouts."""
    keep: list[str] = field(default_factory=list)
    """Mixed-precision rollouts: linear layers the rollout copy leaves in full precision, as shell patterns of module
    names (e.g. [model.layers.0.self_attn.*]; aisrl.quant.QuantConfig.keep). `aisrl mismatch --preset P per_layer=true`
    ranks the candidates. Full-precision rollouts (rollout.quant=none) keep every layer already."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    max_new_tokens: int = 24
    """Completion length limit."""
    engine: str = "hf"
    """Rollout engine: 'hf' (aisrl.rollout.generate on a fake-quantised copy: any causal LM, any format, the
    GEMM operands rounded exactly) or 'static' (aisrl.engine: Llama/Qwen families, full precision or FP8 E4M3
    W8A8 [+ _kv], real FP8 GEMMs, FP8 KV cache and CUDA graphs on a GPU)."""
    align: bool = False
    """QaRL: the trainer's forward runs through the rollout format (straight-through to FP32 master weights)."""
    pool: int = 0
    """Sol-RL: sample this many candidates per prompt (> group_size) at the rollout format, keep the top and bottom
    group_size/2 by reward, rescore them at training precision and train on them as on-policy, their advantages
    normalised over the kept group_size (0 = off)."""


@dataclass
class CorrectionConfig:
    name: str = "ais"
    """Mismatch correction: any name in aisrl.correction.CORRECTIONS."""
    cap: float = 2.0
    """Truncation cap C (tis, seq_tis, prefix_tis, suffix_tis, geo_tis, ais; the other corrections truncate nothing
    and leave it unused, so a study's cap can reach every method)."""
    ema: float = 0.0
    """AIS: smoothing of alpha across steps (0 = per-batch alpha)."""
    alpha: float | None = None
    """AIS: pin alpha to this value in [0, 1] instead of computing it (an ablation: 0 is `none`, 1 is `tis`; the
    diagnostics and the alpha AIS would have chosen, `alpha_batch`, are still logged). None = adaptive."""
    bypass: bool = False
    """Use rollout_logp as old_logp and skip the trainer-side recompute (then every weight is 1)."""
    mask_errors: bool = False
    """Drop tokens the error-token detector flags (loops, runs of large log-ratios) from the loss."""
    guard: float = 0.0
    """Mismatch guard: when a batch's rollout/trainer k3 KL exceeds this many times the median of the last 10 steps',
    undo the previous update and train on nothing this step (e.g. 4; 0 = off). aisrl.update.MismatchGuard. It keeps a
    copy of the trainable weights and optimizer state, in memory and in every checkpoint."""
    calibrate_every: int = 0
    """Every this many steps from step 1 (0 = off), also sample the step's prompts from the full-precision trainer
    with the same seeds, and train from then on with the correction among `candidates` whose gradient on the
    low-precision batch is nearest the full-precision batch's (aisrl.calibrate). `name` is then unused. The
    gradients compared are the whole loss's: with kl_coef > 0 the KL term's difference between the two batches, which
    no correction weights, is in every candidate's distance."""
    candidates: list[str] = field(default_factory=lambda: ["tis", "prefix_tis", "seq_tis"])
    """The corrections a calibration chooses from (with calibrate_every > 0)."""
    calibrate_window: int = 8
    """A calibration judges by this many calibrations, the last ones and itself (one batch is a noisy judge);
    calibrate_rule says how."""
    calibrate_rule: str = "window"
    """How the window's calibrations give the end point: `window` (the candidate of least mean distance; it favours
    the end point least noisy against full precision, not the least biased), `pooled` (the one whose gradient
    difference, averaged over the window, is least), `mix` (the mixture of candidates whose averaged difference is
    least). aisrl.calibrate.RULES; pooled and mix keep len(candidates) x window gradient-sized vectors."""
    options: dict[str, typing.Any] = field(default_factory=dict)
    """Further options of the correction (aisrl.correction.correct), e.g. {'low': 0.8, 'high': 1.25} for icepop's
    band, {'floor': 0.5} for a two-sided TIS clip, {'threshold': 0.01, 'level': 'seq_max'} for k3_reject,
    {'normalize': True} or {'metrics_only': True}; one the correction does not take is an error listing those it
    does. cap, ema, alpha and veto have their own keys."""
    veto: float = 0.0
    """Guard around any correction: drop every sequence in which a token's weight w = pi/mu falls below this (e.g.
    1e-3: a token the trainer finds a thousand times less likely than the sampler did decides the rest of its
    sequence, and its reward); 0 = off. `correct(..., veto=v)`: the `veto` rule of aisrl.correction around the
    correction, so the TRL and verl adapters take it as a correction option too."""


@dataclass
class LoraSettings:
    r: int = 0
    """LoRA rank (0 = full fine-tuning)."""
    alpha: float = 16.0
    """LoRA scaling numerator (the update is alpha / r * B A)."""
    targets: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Names of the linear layers that get adapters."""
    dropout: float = 0.0
    """LoRA dropout. Old log-probs and rollouts are computed without it, so with dropout > 0 even the first epoch's
    PPO ratio is not 1 but carries the dropout noise, which the clip then acts on; keep 0 unless you mean it."""


@dataclass
class TrainConfig:
    seed: int = 0
    """Seed of the training prompts' order, the held-out set and the sampling (the lab model's warm start has its own,
    lab.seed), in [0, 1e9)."""
    sample_salt: int = 0
    """Shifts every rollout's sampling seed and nothing else (prompts stay those of `seed`): 0 is the run itself;
    a branch (`aisrl branch`) continued from a checkpoint with salt k draws another continuation of that state."""
    max_steps: int = 60
    """GRPO steps."""
    output_dir: str = "runs/lab"
    """Where checkpoints, metrics.jsonl and the report go; re-running with the same directory resumes."""
    device: str = "auto"
    """Where the trainer, rollout and reference models run: 'auto' (the local GPU when CUDA is present, else the
    CPU; under torchrun each rank takes cuda:LOCAL_RANK), 'cpu', 'cuda' or 'cuda:N'."""
    precision: str = "fp32"
    """Trainer-side forward passes (old log-probs, updates): 'fp32', or 'bf16' autocast over FP32 master
    weights (for GPUs; on CPUs BF16 is many times slower than FP32)."""
    task: str = "arithmetic"
    """Task name (aisrl.tasks.TASKS); the lab model's task comes from lab.task."""
    dataset: str = ""
    """Local dataset for task=dataset (alias jsonl): a .jsonl or .parquet file, or a saved `datasets` directory;
    for task=reasoning_gym, the name of its generator (e.g. chain_sum)."""
    task_options: dict[str, typing.Any] = field(default_factory=dict)
    """Options of the task's generator, e.g. {'max_operand': 20} for arithmetic or {'min_terms': 3} for
    reasoning-gym's chain_sum; an option the task does not take is an error that lists those it does."""
    lenient_reward: bool = False
    """Also credit a correct final number without the answer format (correctness points only)."""
    train_problems: int = 500
    """Size of the training prompt pool (drawn from the task's train split)."""
    prompts_per_step: int = 16
    """Prompts per step (B); each is sampled group_size times."""
    group_size: int = 8
    """Completions per prompt (G)."""
    epochs: int = 1
    """PPO epochs over each batch (mu)."""
    micro_batch: int = 64
    """Sequences per forward/backward (gradient accumulation over the batch)."""
    lr: float = 5e-4
    """AdamW learning rate (constant after warm-up, so a resumed run is exact whatever max_steps is)."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up."""
    clip_low: float = 0.2
    """PPO clip below 1."""
    clip_high: float = 0.2
    """PPO clip above 1."""
    scale_advantages: bool = True
    """Divide each group's advantages (reward minus the group's mean) by the group's reward std, as GRPO does; false
    leaves them unscaled, as Dr. GRPO (Liu et al. 2025) does, so that groups with nearly equal rewards do not weigh
    as much as the others."""
    loss: str = "grpo"
    """Policy loss (aisrl.losses.LOSSES): grpo (token-level clipped surrogate) or tbpo (sequence trust band)."""
    agg: str = "token-mean"
    """Aggregation of the grpo loss (aisrl.losses.AGGREGATIONS); tbpo always averages over sequences."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1 for negative advantages (0 = off for grpo; tbpo uses 3 when 0)."""
    grad_clip: float = 1.0
    """Max gradient norm (0 = off)."""
    kl_coef: float = 0.0
    """Coefficient of the k3 KL to the initial policy (0 = no reference model). With top-k / top-p a sampled token
    outside either policy's truncated support has no finite KL term: it is left out, and counted in
    kl_ref_skipped_frac."""
    eval_every: int = 10
    """Held-out greedy accuracy every this many steps (and at the end)."""
    eval_problems: int = 80
    """Held-out problems per evaluation (and the size of the training-prompt subset whose fit is measured too)."""
    checkpoint_every: int = 10
    """Checkpoint every this many steps (and at the end)."""
    keep_checkpoints: int = 2
    """How many of its latest checkpoints a run keeps (0: all). A step you mean to branch from (`aisrl branch`) or
    examine later (`aisrl mismatch start=RUN:STEP`) must be among them: keep more, or all."""
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    lab: LabConfig = field(default_factory=LabConfig)
    diffusion: DiffusionSettings = field(default_factory=DiffusionSettings)
    lora: LoraSettings = field(default_factory=LoraSettings)


def _read_preset(path: Path):
    """A preset file's data: JSON (a run's recorded config.json) read exactly, YAML through a safe loader that
    refuses a key given twice in one mapping (plain safe_load keeps the last silently)."""
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}): save it as UTF-8") from e
    if path.suffix == ".json":
        try:
            return json.loads(text) or {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e

    class UniqueKeys(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may be overridden here
                    continue
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    raise ValueError(f"{path}: key {key!r} is given twice (line {key_node.start_mark.line + 1}); "
                                     "keep one")  # fmt: skip
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    try:
        return yaml.load(text, Loader=UniqueKeys) or {}  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ValueError(f"{path} is not valid YAML: {e}") from e


def load_config(preset: str | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """TrainConfig from defaults, then a preset (name or YAML path), then `key=value` overrides."""
    cfg = TrainConfig()
    if preset:
        path = Path(preset)
        if not path.suffix:
            path = PRESET_DIR / f"{preset}.yaml"
        if not is_file(path):
            names = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
            run = Path(preset) / "config.json"
            hint = f"; {preset} is a run's folder: pass output_dir={preset}, or {run} as the preset"
            raise ValueError(f"unknown preset {preset[:80]!r}: not a YAML file and not one of {names}"
                             f"{hint if is_file(run) else ''}")  # fmt: skip
        data = _read_preset(path)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a preset must be a mapping of config keys")
        try:
            apply_mapping(cfg, data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e
    apply_overrides(cfg, overrides or [])
    return cfg


def diffusion_params(cfg: TrainConfig):
    """The diffusion sampler's settings (generation length, blocks, steps, temperature, remasking) of a run."""
    from aisrl.diffusion import DiffusionParams

    d = cfg.diffusion
    return DiffusionParams(cfg.rollout.max_new_tokens, d.block_length, d.steps, cfg.rollout.temperature, d.remasking)


PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
"""Trainer-side precision -> autocast dtype (None: plain FP32)."""


def resolve_device(name: str) -> torch.device:
    """'auto' | 'cpu' | 'cuda' | 'cuda:N' -> the device this process trains on (checked to exist)."""
    import os

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda:") and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # every rank would take that GPU
        raise ValueError(f"device={name} names one GPU for every torchrun process; use device=cuda (or auto): each "
                         "process then trains on the GPU of its LOCAL_RANK")  # fmt: skip
    per_rank = name == "cuda" and "LOCAL_RANK" in os.environ
    if per_rank:
        name = f"cuda:{os.environ['LOCAL_RANK']}"  # torchrun: one GPU per rank
    elif name == "cuda" and torch.cuda.is_available():
        name = f"cuda:{torch.cuda.current_device()}"  # an explicit index (torch.cuda.set_device needs one)
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"device {name!r} is not a device name; use auto, cpu, cuda or cuda:N") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r}: the trainer runs on cpu or cuda")
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        n = torch.cuda.device_count()
        if per_rank and n:  # more torchrun processes than GPUs
            raise ValueError(f"torchrun rank LOCAL_RANK={os.environ['LOCAL_RANK']} trains on {name}, but this machine "
                             f"has {n} CUDA devices; start at most {n} processes per node (--nproc_per_node={n}) "
                             "or use device=cpu")  # fmt: skip
        raise ValueError(f"device {name!r} asked for, but this machine has {n} CUDA devices; use device=cpu "
                         "(or auto)")  # fmt: skip
    return dev


def rollout_format(cfg: TrainConfig):
    """The rollout copy's aisrl.quant.QuantConfig (rollout.quant with rollout.keep), None for full precision."""
    return None if cfg.rollout.quant == "none" else quant_config(cfg.rollout.quant, keep=tuple(cfg.rollout.keep))


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
        raise ValueError(f"prompts_per_step x {'rollout.pool' if cfg.rollout.pool else 'group_size'} = {per_step} "
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
    if cfg.lora.r < 0 or not 0 <= cfg.lora.dropout < 1:
        raise ValueError(f"lora.r must be >= 0 (0: full fine-tuning) and lora.dropout in [0, 1); got r={cfg.lora.r}, "
                         f"dropout={cfg.lora.dropout}")  # fmt: skip
    if cfg.lora.r > 0 and not cfg.lora.targets:
        raise ValueError("lora.targets is empty: name the layers the adapters go on (e.g. [q_proj, v_proj]), or set "
                         "lora.r=0 for full fine-tuning")  # fmt: skip
    if cfg.lora.r > 0 and not cfg.lora.alpha > 0:  # the adapters' scale alpha / r: at 0 they add and learn nothing
        raise ValueError(f"lora.alpha must be > 0 with lora.r > 0 (the adapters are scaled by alpha / r); got "
                         f"{cfg.lora.alpha}")  # fmt: skip
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


def task_kwargs(cfg: TrainConfig) -> dict:
    """The options `aisrl.tasks.make_task(cfg.task, ...)` gets: `task_options`, and `dataset` as the file task's
    path or the reasoning-gym generator's name."""
    given = sorted(set(cfg.task_options) & {"path", "generator"})
    if given:  # `dataset` would silently win over them
        raise ValueError(f"task_options sets {given}: name the file or generator with dataset= instead")
    named = {"jsonl": "path", "dataset": "path", "reasoning_gym": "generator"}.get(cfg.task)
    return {**cfg.task_options, **({named: cfg.dataset} if named else {})}


def correction_options(cfg: TrainConfig, prev_alpha, name: str | None = None):
    """Keyword options of aisrl.correction.correct for the correction `name` (default: the configured one;
    `prev_alpha`: last step's, for the AIS EMA)."""
    name, opts = name or cfg.correction.name, {}
    if "cap" in options_of(name):
        opts["cap"] = cfg.correction.cap
    if cfg.correction.ema != 0:  # as with alpha, a correction other than ais refuses it rather than ignoring it
        opts.update(ema=cfg.correction.ema, prev_alpha=prev_alpha)
    if cfg.correction.alpha is not None:  # any other correction refuses the option, naming the ones it takes
        opts["alpha"] = cfg.correction.alpha
    if cfg.correction.veto > 0:
        opts["veto"] = cfg.correction.veto
    return {**cfg.correction.options, **opts}
