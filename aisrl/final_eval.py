"""Evaluate the policy a run trained, with less noise than the per-step training signals (issue 5).

Why it exists: a run's training reward is the reward of *rollouts*, so under low-precision rollouts it
measures the quantised copy, not the full-precision model the run produces and a user deploys. When the
policy sharpens, the copy's errors can grow (the k3 KL of MXFP4 W4A4 rollouts doubles over a lab run), so
a gap in training reward mixes two effects: a worse trained policy, and a worse sampler of the same policy.
The held-out greedy accuracy measures the right model, but on 80 problems its noise (about 3.5 points)
is larger than the effects of the corrections.

This module scores the final checkpoint of a run in three ways, each on many samples:
- `policy_reward`: mean reward of the full-precision trained model, sampled as in training (same
  temperature and length), over every prompt of the run's training pool, `samples` completions each;
- `sampler_reward`: the same prompts and sampling seeds through the run's low-precision rollout copy
  (equal to `policy_reward` for full-precision runs), so `policy_reward - sampler_reward` is what the
  rollout format alone costs at the end of training. The static engine (rollout.engine=static) draws its own
  random numbers, so for its runs the trained model is sampled through a full-precision (FP32) engine, and the
  two sides still share their draws;
- `held_reward` / `held_accuracy`: the full-precision model sampled on the run's held-out problems (the
  set its greedy accuracy is measured on), `held_samples` completions each.
Sampling seeds do not depend on the run, so two runs of a seed are compared on the same prompts and the
same uniform draws (common random numbers): their difference has less noise than either number.
Results are cached in `<run>/final_eval.json` with the settings that produced them: hashes of the weights
and of the run's configuration, so a run trained again, or scored under other settings or by another version of this
code (SCORER), is scored again.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from dataclasses import asdict
from pathlib import Path

import torch

from aisrl.checkpoint import atomic_write_text, dataset_sha256, file_sha256, read_record
from aisrl.train_config import reads_dataset

SEED_BASE = 7_000_000_000
"""Sampling seeds of the evaluation: SEED_BASE + i for the i-th request, the same for every run."""
SCORER = 2
"""Version of the sampling and scoring code behind a cached score; raise it when a change moves scores. A score of
another version is stale: scored again by `evaluate_final`, and not read by aggregation. 2: scores cached before
versions existed predate fixes that move some runs' samples (the static engine's sampling, the log-probs of models
that scale or soft-cap their logits)."""


def _rewards(policy, model, task, tok, encode, problems: list, samples: int, kv_fp8: bool = False) -> list[tuple]:
    from aisrl.build import task_rewards

    rows = [p for p in problems for _ in range(samples)]
    out = []
    for s in range(0, len(rows), 512):  # bounded memory whatever the pool size
        chunk = rows[s : s + 512]
        seeds = [SEED_BASE + s + i for i in range(len(chunk))]
        r = policy.sample(model, [encode(p) for p in chunk], seeds, 0, kv_fp8)
        out += task_rewards(task, tok, r, chunk)
    return out


ADDED_LATER = (
    ("", "sample_salt", 0),
    ("correction", "veto", 0.0),
    ("correction", "guard", 0.0),
    ("", "task_options", {}),
    ("correction", "options", {}),
    ("", "scale_advantages", True),
    ("rollout", "keep", []),
)
"""Config fields added after scores were first cached: (section, key, default). They enter the config hash only when
set away from their default, so adding a field does not make every cached score stale."""


SCHEDULE = ("max_steps", "eval_every", "checkpoint_every")
"""When a run stops, evaluates and checkpoints: they change no score of a given checkpoint (its name and weights are in
the settings), so a study re-run with another checkpoint_every keeps its cached scores. Scores cached while they were
hashed are still read (`_config_hash(cfg, schedule=True)`)."""


def _config_hash(cfg, schedule: bool = False) -> str:
    """Hash of the run's configuration as scoring sees it: everything but where it is written, which checkpoints it
    keeps and (unless `schedule`, the hash of caches written before SCHEDULE left it) when it stops, evaluates and
    checkpoints."""
    drop = ("output_dir", "keep_checkpoints", *(() if schedule else SCHEDULE))
    run = {k: v for k, v in asdict(cfg).items() if k not in drop}
    for section, key, default in ADDED_LATER:  # at its default, a field added later leaves earlier scores valid
        where = run[section] if section else run
        if where.get(key) == default:
            del where[key]
    return hashlib.sha256(json.dumps(run, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _settings(checkpoint: str, digest: str, cfg, samples: int, held_samples: int) -> dict:
    """What a cached score depends on: the weights, the evaluation's sizes and seeds, and the run's
    configuration (sampling parameters, task, pools, rollout format; not its directory or schedule) and, for a
    local dataset, its contents."""
    run_hash = _config_hash(cfg)
    out = {"checkpoint": checkpoint, "weights_sha256": digest, "config_sha256": run_hash, "samples": samples,
           "held_samples": held_samples, "seed_base": SEED_BASE, "scorer": SCORER}  # fmt: skip
    if reads_dataset(cfg):  # the config names the path; the problems are in the file
        out["dataset_sha256"] = dataset_sha256(cfg.dataset)
    if cfg.rollout.engine == "static":  # the trained model samples through an FP32 engine (scores cached before: HF)
        out["trained_sampler"] = "engine_fp32"
    from aisrl.tasks import TASKS

    if _users_model(cfg.model.name):  # its chat template may have a thinking mode (Qwen3), closed in prompts since
        out["prompts"] = PROMPTS  # version 2: scores cached before asked it to think first
    name = cfg.lab.task if cfg.model.name == "lab" else cfg.task  # the lab trains on its own task
    for key in ("problems_version", "scorer_version"):  # the task's problems, or its judging, changed: scored again
        version = getattr(TASKS.get(name), key, 1)
        if version != 1:
            out[key] = version
    return out


def cached_scores(run_dir: str | Path, samples: int, step: int | None = None) -> dict | None:
    """The cached scores of `run_dir` if they belong to its latest checkpoint (which must be that of `step`, if
    given: a run continued past the step a study reads has another final model), to the weights that checkpoint
    holds now (a run retrained in place keeps the checkpoint's name) and to `samples`: for aggregation, which reads
    runs `evaluate_final` did not refresh too (those a study's `only=` leaves out)."""
    from aisrl.checkpoint import checkpoint_dir, latest_checkpoint

    cache = Path(run_dir) / "final_eval.json"
    try:
        ckpt = latest_checkpoint(run_dir)
    except FileNotFoundError:
        return None
    if ckpt is None or not cache.exists() or (step is not None and ckpt.name != checkpoint_dir(run_dir, step).name):
        return None
    scores = _read(cache)
    ok = scores.get("settings", {}).get("samples") == samples
    return scores if ok and scores_of(scores, ckpt) else None


def _read(cache: Path) -> dict:
    """A final_eval.json, {} where there is none or it is damaged (a cut-short copy): stale, scored again."""
    try:
        scores = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    return scores if isinstance(scores, dict) and isinstance(scores.get("settings"), dict) else {}


def scores_of(scores: dict, ckpt: Path) -> bool:
    """Whether cached scores (a final_eval.json) are this version of the scorer's, of checkpoint `ckpt` as its
    weights are now, made with this version's prompts."""
    settings, weights = scores.get("settings", {}), ckpt / "model.safetensors"
    return (current(scores) and settings.get("checkpoint") == ckpt.name and weights.is_file()
            and settings.get("weights_sha256") == file_sha256(weights)
            and _prompts_current(settings, ckpt.parent.parent))  # fmt: skip


PROMPTS = 2
"""Version of the prompts of a user's model: 2 closes a chat template's thinking mode (aisrl.models.prompt_ids)."""


def _users_model(name: str) -> bool:
    """A model of the user's (a local or hub checkpoint), not the lab, SmolLM2 (no thinking mode) or a tiny one."""
    from aisrl.models import TINY

    return name not in ("lab", "smollm2", *TINY)


def _prompts_current(settings: dict, run_dir: Path) -> bool:
    """False for scores of a user's model (the run's config.json says) made with earlier prompts."""
    if settings.get("prompts") == PROMPTS:
        return True
    try:
        name = read_record(run_dir / "config.json").get("model", {}).get("name", "lab")
    except (OSError, ValueError):  # no readable record: which model it was cannot be told
        return True
    return not _users_model(name)


def current(scores: dict) -> bool:
    """Whether cached scores (a final_eval.json) were made by this version of the scorer (SCORER)."""
    return scores.get("settings", {}).get("scorer") == SCORER


def supported(cfg) -> bool:
    """Causal runs, full-parameter or LoRA (its adapters are merged into the model scored, as into the rollout copy in
    training); a diffusion model samples differently."""
    return cfg.model.kind == "causal"


def evaluate_final(run_dir: str | Path, cfg, samples: int = 4, held_samples: int = 8) -> dict:
    """Scores of the latest checkpoint in `run_dir` (a run trained with TrainConfig `cfg`); cached.
    `samples` completions for each training prompt, `held_samples` for each of the run's held-out problems
    (`cfg.eval_problems`; the lab's arithmetic has about 100 of them, hence more samples of each)."""
    from aisrl.build import build_trained, make_policy, problem_sets, rollout_model, static_engine
    from aisrl.checkpoint import latest_checkpoint
    from aisrl.lora import merged_state
    from aisrl.train_config import resolve_device
    from aisrl.update import eval_mode

    run_dir = Path(run_dir)
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise FileNotFoundError(f"{run_dir} has no checkpoint to evaluate; train it first")
    weights = ckpt / "model.safetensors"
    settings = _settings(ckpt.name, file_sha256(weights), cfg, samples, held_samples)
    cache = run_dir / "final_eval.json"
    cached = _read(cache)
    if cached.get("settings") == settings:
        return cached
    if cached.get("settings") == {**settings, "config_sha256": _config_hash(cfg, schedule=True)}:  # cached before
        cached["settings"] = settings  # SCHEDULE left the hash: the same scores, brought up to date once
        atomic_write_text(cache, json.dumps(cached, indent=1))
        return cached
    if not supported(cfg):
        raise ValueError("final evaluation supports causal runs (model.kind=causal)")
    torch.manual_seed(0)
    device = resolve_device(cfg.device)  # where the run trained: a GPU run is scored on its GPU
    model, tok, task, encode = build_trained(cfg, weights)
    model.to(device)
    policy = make_policy(cfg, tok, model)
    pool, held = problem_sets(cfg, task)  # the run's own training pool and held-out set
    scorer = model
    if cfg.rollout.engine == "static":  # its draws are not the HF sampler's: the trained model samples through an
        scorer = static_engine(cfg, model, device, pool + held, encode, None, torch.float32)  # FP32 one: seeds pair
    with torch.no_grad(), eval_mode(model):
        trained = _rewards(policy, scorer, task, tok, encode, pool, samples)
        if cfg.rollout.quant == "none" and cfg.rollout.engine == "hf":  # the run sampled with this very model
            sampler = trained
        else:
            rollout, sync = rollout_model(cfg, model, device, pool + held, encode)
            sync(merged_state(model))
            kv_fp8 = getattr(getattr(rollout, "quant_config", None), "kv_cache", False)
            sampler = _rewards(policy, rollout, task, tok, encode, pool, samples, kv_fp8)
        unseen = _rewards(policy, model, task, tok, encode, held, held_samples)

    def mean(xs: list[tuple], i: int) -> float:  # i = 0: reward, 1: correct; over the scored (as the trainer)
        finite = [float(x[i]) for x in xs if math.isfinite(float(x[i]))]
        return statistics.fmean(finite) if finite else math.nan

    result = {"settings": settings, "policy_reward": mean(trained, 0), "policy_accuracy": mean(trained, 1),
              "sampler_reward": mean(sampler, 0), "sampler_accuracy": mean(sampler, 1),
              "held_reward": mean(unseen, 0), "held_accuracy": mean(unseen, 1)}  # fmt: skip
    atomic_write_text(cache, json.dumps(result, indent=1))
    return result
