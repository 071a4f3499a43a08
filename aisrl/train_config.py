"""Training configuration: typed dataclasses, YAML presets, dotted `key=value` overrides.

    cfg = load_config("lab", ["max_steps=20", "correction.name=tis", "rollout.quant=none"])

A preset is a name in aisrl/presets/ or a path to a YAML file (read by a yaml.SafeLoader that refuses a key given
twice) or to a run's config.json (read as JSON); its values are checked against the same field types as the
overrides, so an unknown key or a wrong type fails with a message naming the key either way. `validate(cfg)`
(aisrl.train_checks) then checks what types cannot: names against their registries (corrections, losses, formats,
devices) and the settings that cannot train together, before any model is built.
"""

from __future__ import annotations

import json
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aisrl.config import apply_mapping, apply_overrides, is_file, override_key
from aisrl.correction import options_of
from aisrl.lab import TASK_OPTIONS, LabConfig
from aisrl.quant import quant_config

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


_YAML_INT = r"^[-+]?(?:0|[1-9][0-9_]*|0x[0-9a-fA-F_]+)$"
"""Integers: decimal (`1_000`) or hex (`0x1f`), which the command line reads alike; not YAML 1.1's octal `010` (8) or
base-60 `1:30` (90), which the command line refuses."""
_YAML_FLOAT = (r"^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9_]+)(?:[eE][-+]?[0-9]+)?|[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+"
               r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")
"""Floats as YAML 1.2 and the command line read them: `1e-4` too, which YAML 1.1 leaves text."""


def _yaml_loader(path: Path):
    """A yaml.SafeLoader that reads numbers as the command line does (`_YAML_INT`, `_YAML_FLOAT`; text in quotes
    stays text at any depth) and refuses a key given twice in one mapping (plain safe_load keeps the last)."""
    import re

    import yaml

    class UniqueKeys(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may be overridden here
                    continue
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, (list, dict, set)):  # `[a, b]: 1` or `{a: 1}: 2`, which no config key is
                    raise ValueError(f"{path}: a key must be a name, got {key!r} (line {key_node.start_mark.line + 1})")
                if key in seen:
                    raise ValueError(f"{path}: key {key!r} is given twice (line {key_node.start_mark.line + 1}); "
                                     "keep one")  # fmt: skip
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    numbers = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
    UniqueKeys.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag not in numbers]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    UniqueKeys.add_implicit_resolver(numbers[0], re.compile(_YAML_INT), list("-+0123456789"))
    UniqueKeys.add_implicit_resolver(numbers[1], re.compile(_YAML_FLOAT), list("-+0123456789."))
    return UniqueKeys


def _read_preset(path: Path):
    """A preset file's data: JSON (a run's recorded config.json) read exactly, YAML through `_yaml_loader`."""
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
    try:
        return yaml.load(text, Loader=_yaml_loader(path)) or {}  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ValueError(f"{path} is not valid YAML: {e}") from e


def load_config(preset: str | None = None, overrides: list[str] | None = None, check: bool = True) -> TrainConfig:
    """TrainConfig from defaults, then a preset (name or YAML path), then `key=value` overrides; `check`: refuse an
    override the run would not read (`refuse_unread`; off where the run's own config is loaded later)."""
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
    if check:
        refuse_unread(cfg, overrides or [])
    return cfg


def refuse_unread(cfg: TrainConfig, overrides: list[str]) -> None:
    """A key typed for this run that the run would not read (`lab.max_operand=50` for smollm2, `lora.targets=[...]`
    without lora.r) is refused: it would change nothing but the record. Only typed keys: a preset's own (the default
    preset's lab.* under `model.name=smollm2`) are settings of another model, not a slip."""
    typed = [override_key(o) for o in overrides]
    reads = [f"lab.{k}" for k in TASK_OPTIONS.get(cfg.lab.task, {})]
    task_keys = {f"lab.{k}" for options in TASK_OPTIONS.values() for k in options}
    rules = (
        (lambda k: k.startswith("lab.") and cfg.model.name != "lab",
         f"lab.* keys set up model.name=lab, and {cfg.model.name!r} is another model"),
        (lambda k: k in task_keys and k not in reads and cfg.model.name == "lab",
         f"lab.task={cfg.lab.task!r} reads {', '.join(reads) if reads else 'no lab.* task option'}"),
        (lambda k: k.startswith("diffusion.") and cfg.model.kind != "diffusion",
         "diffusion.* keys set up model.kind=diffusion, and this model is causal"),
        (lambda k: k.startswith("lora.") and k != "lora.r" and cfg.lora.r == 0,
         "lora.* keys shape the adapters of lora.r > 0, and lora.r=0 trains every weight (no adapters)"),
    )  # fmt: skip
    for applies, why in rules:
        if unread := [k for k in typed if applies(k)]:
            raise ValueError(f"{', '.join(unread)} would change nothing: {why}; drop what this run does not read")


def diffusion_params(cfg: TrainConfig):
    """The diffusion sampler's settings (generation length, blocks, steps, temperature, remasking) of a run."""
    from aisrl.diffusion import DiffusionParams

    d = cfg.diffusion
    return DiffusionParams(cfg.rollout.max_new_tokens, d.block_length, d.steps, cfg.rollout.temperature, d.remasking)


PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
"""Trainer-side precision -> autocast dtype (None: plain FP32)."""


def resolve_device(name: str) -> torch.device:
    """'auto' | 'cpu' | 'cuda' | 'cuda:N' -> the device this process trains on (checked to exist)."""
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


def reads_dataset(cfg: TrainConfig) -> bool:
    """Whether the run reads its problems from a local file or saved dataset (`dataset=PATH` with task=dataset or
    jsonl; the lab trains on its own task)."""
    return bool(cfg.dataset) and cfg.task in ("dataset", "jsonl") and cfg.model.name != "lab"


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
