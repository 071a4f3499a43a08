"""Training configuration: typed dataclasses, YAML presets, dotted `key=value` overrides.

    cfg = load_config("lab", ["max_steps=20", "correction.name=tis", "rollout.quant=none"])

A preset is a name in aisrl/presets/ or a path to a YAML file; YAML is read with yaml.safe_load and its values
are checked against the same field types as the overrides, so an unknown key or a wrong type fails with a
message naming the key either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from aisrl.config import apply_mapping, apply_overrides
from aisrl.lab import LabConfig

PRESET_DIR = Path(__file__).parent / "presets"
DEFAULT_PRESET = "lab_columns"  # the main job (`make run`): what `aisrl train` and `aisrl eval` run without a preset


@dataclass
class ModelConfig:
    name: str = "lab"
    """'lab' (warm-started tiny model), 'smollm2', a tiny-* name or a local Hugging Face directory."""
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
    group_size/2 by reward, rescore them at training precision and train on them as on-policy (0 = off)."""


@dataclass
class CorrectionConfig:
    name: str = "ais"
    """Mismatch correction: any name in aisrl.correction.CORRECTIONS."""
    cap: float = 2.0
    """Truncation cap C (tis, seq_tis, prefix_tis, geo_tis, ais)."""
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
    undo the previous update and train on nothing this step (e.g. 4; 0 = off). aisrl.update.MismatchGuard."""
    veto: float = 0.0
    """Guard around any correction: drop every sequence in which a token's weight w = pi/mu falls below this (e.g.
    1e-3: a token the trainer finds a thousand times less likely than the sampler did decides the rest of its
    sequence, and its reward); 0 = off. It is the `veto` rule of aisrl.correction, applied after the correction."""


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
    """LoRA dropout."""


@dataclass
class TrainConfig:
    seed: int = 0
    """Seed of prompts, sampling and initialisation."""
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
    """Local dataset for task=dataset (alias jsonl): a .jsonl or .parquet file, or a saved `datasets` directory."""
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
    loss: str = "grpo"
    """Policy loss (aisrl.losses.LOSSES): grpo (token-level clipped surrogate) or tbpo (sequence trust band)."""
    agg: str = "token-mean"
    """Aggregation of the grpo loss (aisrl.losses.AGGREGATIONS); tbpo always averages over sequences."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1 for negative advantages (0 = off for grpo; tbpo uses 3 when 0)."""
    grad_clip: float = 1.0
    """Max gradient norm (0 = off)."""
    kl_coef: float = 0.0
    """Coefficient of the k3 KL to the initial policy (0 = no reference model)."""
    eval_every: int = 10
    """Held-out greedy accuracy every this many steps (and at the end)."""
    eval_problems: int = 80
    """Held-out problems per evaluation."""
    checkpoint_every: int = 10
    """Checkpoint every this many steps (and at the end)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    lab: LabConfig = field(default_factory=LabConfig)
    diffusion: DiffusionSettings = field(default_factory=DiffusionSettings)
    lora: LoraSettings = field(default_factory=LoraSettings)


def load_config(preset: str | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """TrainConfig from defaults, then a preset (name or YAML path), then `key=value` overrides."""
    import yaml

    cfg = TrainConfig()
    if preset:
        path = Path(preset)
        if not path.suffix:
            path = PRESET_DIR / f"{preset}.yaml"
        if not path.is_file():
            names = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
            raise ValueError(f"unknown preset {preset!r}: not a YAML file and not one of {names}")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a preset must be a mapping of config keys")
        try:
            apply_mapping(cfg, data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e
    apply_overrides(cfg, overrides or [])
    return cfg
