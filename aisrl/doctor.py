"""The mismatch doctor: how far will a rollout precision pull the samples from the trainer, before training?

For each format: quantise a copy of the model (`aisrl.quant`), sample completions with it, recompute the
same tokens' log-probs with the full-precision model, and report the metric set of `aisrl.correction`
(k3 KL, ESS/N, chi2, logprob_abs_diff, fraction of ratios outside [0.5, 2], token multiplicative
probability error) plus the time of one `sync_weights`. Writes JSON and a PNG histogram of token
log-ratios per format.

    aisrl mismatch --model smollm2 --formats fp8_e4m3_w8a8,fp8_e5m2_w8a8,int4 --task arithmetic
    aisrl mismatch --preset diffusion_lab --formats fp8_e4m3_w8a8,mxfp4_w4a4

With `--preset` the doctor examines exactly what that training preset would roll out: its model (the lab
models included, causal or masked-diffusion), its task's training prompts and its sampling settings. Both
kinds go through `aisrl.policy` (`sample` with the quantised copy, `score` with the full-precision model), so
a diffusion model is measured with d1's log-prob estimate, as its trainer sees it, and the full-precision side
scores at the preset's training precision. (The rollout side is always a fake-quantised copy sampled through
`aisrl.rollout`, also for a preset whose rollout.engine is `static`: the same operands, rounded exactly, but
not the engine's FP8 GEMMs and KV cache, whose accumulation differs a little.)

Mixed precision: `keep=[pattern,...]` leaves the linear layers it names in full precision in every format (what
training's rollout.keep does), and `per_layer=true` ranks the quantised layers by how much of the mismatch each
removes when kept alone, which says what to keep:

    aisrl mismatch --preset lab_columns --formats nvfp4_w4a4 per_layer=true
    aisrl mismatch --preset lab_columns --formats nvfp4_w4a4 "keep=[model.layers.0.self_attn.*]"

`start=RUN:STEP` examines a training run's policy at one of its checkpoints (its recorded settings and prompts, its
weights at that step), to see where the mismatch sits after training has moved the policy:

    aisrl mismatch --formats nvfp4_w4a4 per_layer=true start=runs/x/nvfp4_w4a4/ais/seed42:100
"""

from __future__ import annotations

import copy
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from aisrl.correction import correct
from aisrl.models import prompt_ids
from aisrl.policy import CausalPolicy
from aisrl.quant import FakeQuantLinear, kept_fraction, quant_config, quant_targets, quantize_, sync_weights
from aisrl.rollout import SamplingParams, device_of

REPORTED = ["k3_kl", "kl", "ess", "chi2_token", "chi2_seq", "logprob_abs_diff_mean", "logprob_abs_diff_max",
            "ratio_frac_above_2", "ratio_frac_below_half", "token_prob_mult_error"]  # fmt: skip


def arithmetic_questions(n: int, seed: int) -> list[str]:
    """Easy procedural arithmetic questions: the doctor's own prompts, fixed so that its figures stay comparable
    across versions (`preset=` examines a training task's prompts instead)."""
    rng = random.Random(seed)
    qs = []
    for _ in range(n):
        a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice("+-*")
        qs.append(f"What is {a} {op} {b}? Think step by step, then give the answer.")
    return qs


TASKS = {"arithmetic": arithmetic_questions}


@dataclass
class DoctorConfig:
    model: str = "smollm2"
    """'smollm2', a tiny-* model or a local Hugging Face directory (with `preset`, the preset's model)."""
    preset: str = ""
    """A training preset or YAML file (e.g. lab, diffusion_lab): diagnose its model, task prompts and sampling
    settings; `model`, `task`, `max_new_tokens` and `temperature` are then the preset's, and setting them is an
    error."""
    formats: list[str] = field(default_factory=lambda: ["fp8_e4m3_w8a8", "fp8_e5m2_w8a8", "int4"])
    """Quantisation presets (aisrl.quant.PRESETS) to examine."""
    task: str = "arithmetic"
    """Prompt source."""
    prompts: int = 16
    """Number of prompts (one completion each)."""
    max_new_tokens: int = 64
    """Completion length."""
    temperature: float = 1.0
    """Sampling temperature (the processed distribution is what both sides score)."""
    seed: int = 0
    """Seed of the prompts and of the samples."""
    keep: list[str] = field(default_factory=list)
    """Linear layers every examined format leaves in full precision: module-name patterns (aisrl.quant.QuantConfig.keep,
    training's rollout.keep), e.g. [model.layers.0.self_attn.*]."""
    per_layer: bool = False
    """Also rank each format's quantised linear layers by the mismatch left when that layer alone is put back in full
    precision (the candidates for `keep`): one scoring pass of the samples per layer."""
    start: str = ""
    """RUN:STEP: examine a training run's policy at a checkpoint (its recorded model, task and sampling settings, its
    weights at STEP) instead of a preset's initial model, e.g. runs/x/nvfp4_w4a4/ais/seed42:100. How the mismatch
    spreads over the layers changes as training moves the policy (BENCHMARKS.md section 3). The formats are `formats`
    with the doctor's `keep`, not the run's rollout settings: a run's rollout.keep is given again as keep=[...], and
    QaRL's alignment (rollout.align) is not applied. The prompts are the task's training ones drawn with the
    doctor's `seed`, not the run's own batches."""
    device: str = "auto"
    """Where the models run: auto (a GPU where there is one; a model handed to `diagnose` stays where it is), cpu, cuda
    or cuda:N. The figures of BENCHMARKS.md and the README were measured on a CPU; a GPU's kernels round a little
    differently (device=cpu reproduces them)."""


def _prompt_ids(cfg: DoctorConfig, tok, vocab_size: int) -> list[list[int]]:
    """The task's prompts, tokenised; without a tokenizer, bytes folded into ids 3..vocab_size - 1."""
    if cfg.task not in TASKS:
        raise ValueError(f"unknown task {cfg.task!r}; choose from {sorted(TASKS)}")
    questions = TASKS[cfg.task](cfg.prompts, cfg.seed)
    if tok is None:  # tiny models have no tokenizer: bytes of the text, folded into the ids 3.. of the vocabulary
        if vocab_size < 4:
            raise ValueError(f"a model without a tokenizer gets byte prompts folded into ids 3..V-1; its vocabulary "
                             f"has V={vocab_size}: pass its tokenizer (diagnose(cfg, model, tok))")  # fmt: skip
        fold = min(200, vocab_size - 3)
        return [[1] + [3 + b % fold for b in q.encode()][:24] for q in questions]
    return [prompt_ids(tok, q) for q in questions]


def _subject(cfg: DoctorConfig, model, tok, checkpoint: tuple[str, Path] | None = None):
    """(model, prompts, policy, precision) under examination: a training preset's, a run's at `checkpoint`
    (_run_checkpoint's settings and weights, for `start`), or a model with the doctor's prompts; `precision` is the
    trainer's (a preset's `precision`, fp32 without one), at which the full-precision side scores."""
    if cfg.preset or checkpoint is not None:
        from aisrl.build import build, build_trained, make_policy
        from aisrl.train_config import load_config

        base, weights = checkpoint or (cfg.preset, None)
        tcfg = load_config(base)
        model, tok, task, encode = build(tcfg) if weights is None else build_trained(tcfg, weights)
        prompts = [encode(p) for p in task.problems("train", cfg.prompts, seed=cfg.seed)]
        return model, prompts, make_policy(tcfg, tok, model), tcfg.precision
    if model is None:
        from aisrl.models import load_model

        model, tok = load_model(cfg.model)
    prompts = _prompt_ids(cfg, tok, model.config.vocab_size if tok is None else 0)
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
    pad = tok.pad_token_id if tok is not None else model.config.pad_token_id
    eos = tok.eos_token_id if tok is not None else model.config.eos_token_id
    return model, prompts, CausalPolicy(params, 0 if pad is None else pad, eos, tokenizer=tok), "fp32"


def _run_checkpoint(cfg: DoctorConfig) -> tuple[str, Path]:
    """(the settings the `start=RUN:STEP` run was trained with, its checkpoint's weights file): its config.json, or
    `preset` for a run without one."""
    from aisrl.branch import recorded_base
    from aisrl.checkpoint import saved_weights

    run, sep, step = cfg.start.rpartition(":")
    if not sep or not step.isdigit() or not Path(run).is_dir():
        raise ValueError(f"start={cfg.start!r}: give RUN:STEP, a folder `aisrl train` wrote and one of its checkpoint "
                         "steps, e.g. start=runs/x/nvfp4_w4a4/ais/seed42:100")  # fmt: skip
    path = saved_weights(run, int(step))
    if cfg.preset and (Path(run) / "config.json").is_file():  # a config.json that still loads is the run's settings
        from aisrl.train_config import load_config

        try:
            load_config(str(Path(run) / "config.json"))
        except ValueError:  # written by another version of aisrl (or damaged): the preset stands in for it
            pass
        else:
            raise ValueError(f"{run} records its settings (config.json); drop preset={cfg.preset!r}, the run's are "
                             "used")  # fmt: skip
    try:
        return recorded_base(Path(run), cfg.preset), path
    except ValueError as e:  # its advice (overrides) is `aisrl branch`'s: this command takes no training keys
        raise ValueError(f"{e}. aisrl mismatch takes no training keys: write the run's settings (its preset's keys "
                         "with the overrides it was trained with) into a YAML file and pass --preset FILE") from e


def check(cfg: DoctorConfig) -> tuple[str, Path] | None:
    """Raise on settings the doctor cannot run with, before anything is loaded or written; returns the checkpoint of
    `start` (_run_checkpoint), None without one."""
    from aisrl.train_config import resolve_device

    if cfg.task not in TASKS and not (cfg.preset or cfg.start):
        raise ValueError(f"unknown task {cfg.task!r}; choose from {sorted(TASKS)}")
    if not cfg.formats:
        raise ValueError("formats is empty: name a preset of aisrl.quant.PRESETS, e.g. --formats fp8_e4m3_w8a8")
    for key in ("prompts", "max_new_tokens"):
        if getattr(cfg, key) < 1:
            raise ValueError(f"{key} must be >= 1, got {getattr(cfg, key)}")
    if not 0 <= cfg.seed < 1_000_000_000:  # as training's: the prompts' sampling seeds stay within int64
        raise ValueError(f"seed must be in [0, 1000000000), got {cfg.seed}")
    for name in cfg.formats:
        quant_config(name, keep=tuple(cfg.keep))  # fail fast on an unknown preset or bad keep, before loading anything
    if cfg.preset or cfg.start:  # these come from the preset or run; a value given for them would be ignored
        keys, default = ("model", "task", "max_new_tokens", "temperature"), DoctorConfig()
        given = [k for k in keys if getattr(cfg, k) != getattr(default, k)]
        what = f"the preset ({cfg.preset!r})" if cfg.preset and not cfg.start else f"the run ({cfg.start!r})"
        if given:
            raise ValueError(f"with a preset or start, {given} come from {what}; drop them, or diagnose the model "
                             "without preset and start")  # fmt: skip
    else:
        SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)  # temperature > 0, named
    resolve_device(cfg.device)
    checkpoint = _run_checkpoint(cfg) if cfg.start else None  # a bad RUN:STEP
    if cfg.preset or checkpoint:
        from aisrl.train_config import load_config

        tcfg = load_config(checkpoint[0] if checkpoint else cfg.preset)  # an unknown preset, named
        kv = [name for name in cfg.formats if quant_config(name).kv_cache]
        if tcfg.model.kind == "diffusion" and kv:  # its sampler has no cache: the figures would be the cache-less ones
            raise ValueError(f"formats {kv} quantise a KV cache, which a diffusion model (bidirectional, no cache) "
                             "does not have; use the presets without _kv")  # fmt: skip
    return checkpoint


def diagnose(cfg: DoctorConfig, model=None, tok=None) -> dict:
    """Run the doctor; returns {format: {metric: value, ..., "log_ratios": [...]}}."""
    from aisrl.train_config import resolve_device
    from aisrl.trainer import _score_at

    checkpoint = check(cfg)
    device = resolve_device(cfg.device)
    given = model  # a caller's model stays where it is unless a device is named
    model, prompts, policy, precision = _subject(cfg, model, tok, checkpoint)
    model.to(device_of(model) if given is not None and cfg.device == "auto" else device).eval()
    seeds = [cfg.seed * 100_003 + i for i in range(len(prompts))]
    out = {}
    for name in cfg.formats:
        qcfg = quant_config(name, keep=tuple(cfg.keep))
        rollout = quantize_(copy.deepcopy(model), qcfg)
        sync_s = sync_weights(model, rollout)
        t0 = time.perf_counter()
        r = policy.sample(rollout, prompts, seeds, step=0, kv_fp8=qcfg.kv_cache)
        gen_s = time.perf_counter() - t0
        with torch.no_grad():
            old = _score_at(policy, model, r, 0, precision)  # as the trainer scores (bf16 autocast if it trains so)
        m = correct("none", old, r.rollout_logp, r.completion_mask).metrics
        out[name] = {k: m[k].item() for k in REPORTED}
        out[name].update(tokens=int(r.completion_mask.sum()), sync_seconds=sync_s, generate_seconds=gen_s,
                         kept_weights=kept_fraction(model, qcfg),
                         log_ratios=(old - r.rollout_logp)[r.completion_mask].tolist())  # fmt: skip
        if cfg.per_layer:
            out[name]["per_layer"] = layer_sensitivity(policy, model, rollout, r, old)
        del rollout
    return out


@torch.no_grad()
def layer_sensitivity(policy, model, rollout, r, old: torch.Tensor) -> list[dict]:
    """Which layers to keep in full precision: for each quantised linear of `rollout`, the mean token |log pi -
    log mu'| of the copy mu' with that layer alone swapped back for the trainer's own, scored on the completions
    `r` the whole copy sampled (scoring only, so every candidate is judged on the same tokens), with the share of
    the all-quantised mismatch it removes and its share of the quantisable weights. Rows are sorted by the
    mismatch left, smallest (the layer most worth keeping) first. `old`: (B, T) the trainer's log-probs of `r`."""
    mask = r.completion_mask  # (B, T)

    def mismatch() -> torch.Tensor:
        return (old - policy.score(rollout, r, 0)).abs()[mask].mean()

    base = mismatch()  # scored like the candidates (the sampler's own log-probs may differ by its KV cache)
    layers = [(n, m) for n, m in rollout.named_modules() if isinstance(m, FakeQuantLinear)]
    every = sum(m.weight.numel() for _, m in quant_targets(model, replace(rollout.quant_config, keep=())))
    rows = []
    for name, mod in layers:
        parent, _, child = name.rpartition(".")
        owner = rollout.get_submodule(parent) if parent else rollout
        setattr(owner, child, model.get_submodule(name))  # the trainer's full-precision layer, for one scoring
        try:
            left = mismatch()
        finally:
            setattr(owner, child, mod)
        rows.append({"layer": name, "logprob_abs_diff_mean": left.item(), "removed": (1 - left / base).item(),
                     "weights": mod.weight.numel() / every})  # fmt: skip
    return sorted(rows, key=lambda row: row["logprob_abs_diff_mean"])


def sensitivity_table(rows: list[dict], top: int = 12) -> str:
    """Markdown table of the `top` layers of layer_sensitivity, most worth keeping first."""
    head = "| keep this layer alone | mean abs log-ratio left | mismatch removed | share of weights |\n"
    head += "|---|---|---|---|\n"
    return head + "\n".join(f"| {x['layer']} | {x['logprob_abs_diff_mean']:.4g} | {x['removed']:.1%} | "
                             f"{x['weights']:.1%} |" for x in rows[:top]) + "\n"  # fmt: skip


def keep_hint(rows: list[dict], top: int = 2, kept: list[str] = ()) -> str:
    """The training override that keeps the `top` layers of layer_sensitivity, and how to check that set: one
    layer's effect is measured alone, and two layers' roundings can cancel or add. `kept`: the layers the ranking was
    measured with already kept (the doctor's `keep`), which the override keeps too."""
    keep = "[" + ",".join([*kept, *(x["layer"] for x in rows[:top])]) + "]"
    return (f"to keep the top {min(top, len(rows))}: \"rollout.keep={keep}\" in training; measure that set first "
            f"with \"keep={keep}\" (without per_layer)")  # fmt: skip


def table(result: dict) -> str:
    cols = ["k3_kl", "ess", "chi2_token", "logprob_abs_diff_mean", "ratio_frac_above_2", "ratio_frac_below_half",
            "token_prob_mult_error", "sync_seconds"]  # fmt: skip
    cols += ["kept_weights"] if any(r.get("kept_weights") for r in result.values()) else []
    head = "| format | tokens | " + " | ".join(cols) + " |\n|" + "---|" * (len(cols) + 2) + "\n"
    rows = [f"| {f} | {r['tokens']} | " + " | ".join(f"{r[c]:.4g}" for c in cols) + " |" for f, r in result.items()]
    return head + "\n".join(rows) + "\n"


def histogram(result: dict, path: str | Path) -> None:
    """PNG histogram of token log-ratios log pi - log mu, one curve per format (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in result.items():
        x = torch.tensor(r["log_ratios"]).clamp(-3, 3)
        ax.hist(x.numpy(), bins=120, range=(-3, 3), histtype="step", density=True, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("token log-ratio  log pi_trainer - log mu_rollout  (clamped to +-3)")
    ax.set_ylabel("density")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(cfg: DoctorConfig, out_dir: str | Path) -> dict:
    from aisrl.bench.report import machine, write_json

    out_dir = Path(out_dir)
    check(cfg)  # bad settings leave no folder behind
    try:  # before the diagnosis, not after it
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {out_dir} cannot be created ({e.strerror}); choose another folder") from e
    result = diagnose(cfg)
    print(table(result))
    for name, r in result.items():
        if "per_layer" in r:
            print(f"{name}: the layers whose full precision removes most of the mismatch")
            print(sensitivity_table(r["per_layer"]))
            print(keep_hint(r["per_layer"], kept=cfg.keep))
    write_json(out_dir / "mismatch.json", {"config": cfg.__dict__, "machine": machine(), "formats": result})
    try:
        histogram(result, out_dir / "logratio_hist.png")
        print(f"histogram: {out_dir / 'logratio_hist.png'}")
    except ImportError:
        print("(pip install matplotlib for the histogram)")
    print(f"results: {out_dir / 'mismatch.json'}")
    return result
