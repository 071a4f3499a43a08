"""GRPO with low-precision rollouts and mismatch correction, top to bottom.

One step:
    prompts -> G rollouts each from the quantised copy (rollout_logp from the processed distribution)
    -> rewards -> group advantages -> old_logp recomputed at training precision (or bypass)
    -> correction weights (aisrl.correction) -> mu epochs of grpo_loss over micro-batches (aisrl.update)
    -> optimizer step -> weight sync (re-quantise the trainer into the rollout copy or engine)

Everything random in a step is derived from (seed, step): the prompts and every request's sampling
seed (shifted by `sample_salt`, which `aisrl branch` uses to draw other continuations of a checkpoint). So a run
resumed from a checkpoint continues exactly as an uninterrupted run would, and a resume with other settings is
refused (aisrl.checkpoint.record_config). Outputs in `output_dir`: config.json (the settings), start.json (a
digest of the initial weights), metrics.jsonl (one row per step), checkpoints/, report.png, summary.json,
tensorboard/ (where tensorboard is installed) and .lock, which keeps a second trainer out (aisrl.checkpoint.hold_run).
What a run is made of (model, task, problem pools, rollout copy) is built by aisrl.build.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import json
import random
import time
import warnings
from pathlib import Path

import torch

from aisrl.build import build, cut_short, make_policy, problem_sets, rollout_model, task_of, task_rewards, with_lora
from aisrl.calibrate import combine, end_point_weights, measured
from aisrl.checkpoint import (
    RESUMABLE,
    atomic_write_text,
    hold_run,
    latest_checkpoint,
    latest_step,
    load_checkpoint,
    read_jsonl,
    record_config,
    record_start,
    run_start,
    same_dataset,
    save_checkpoint,
    weights_digest,
)
from aisrl.correction import correct, restrict
from aisrl.dist import all_sum, rank_rng_states
from aisrl.lora import merged_state
from aisrl.losses import group_advantages
from aisrl.qarl import align_, alignment, error_tokens
from aisrl.rollout import device_of
from aisrl.solrl import select_extremes
from aisrl.tracking import Tracker
from aisrl.train_checks import validate
from aisrl.train_config import (
    PRECISIONS,
    TrainConfig,
    correction_options,
    reads_dataset,
    resolve_device,
    rollout_format,
)
from aisrl.update import MismatchGuard, accumulate_gradient, active_dropout, eval_mode, flat_grad, policy_update


def _init_distributed(device: torch.device) -> tuple[int, int]:
    """(rank, world) - joins the torchrun process group when launched by torchrun: gloo for the CPU tensors
    (statistics, losses), NCCL for CUDA ones (gradients) when the models are on GPUs."""
    import os

    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)  # this rank's GPU is the current one (NCCL, default allocations)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def train(cfg: TrainConfig, log=print) -> dict:
    """Run (or resume) GRPO; returns the summary dict. Under torchrun: data parallel over prompts."""
    opened: list = []  # what the run holds open (the run folder's lock, the metrics tracker), closed however it ends
    try:
        return _train(cfg, log, opened)
    finally:
        for thing in reversed(opened):
            if thing is not None:  # (a None lock: no flock on this platform)
                thing.close()


def _train(cfg: TrainConfig, log, opened: list) -> dict:
    validate(cfg)
    if reads_dataset(cfg):  # recorded as an absolute path: a resume or eval from another folder reads the same file
        cfg = dataclasses.replace(cfg, dataset=str(Path(cfg.dataset).resolve()))
    device = resolve_device(cfg.device)
    rank, world = _init_distributed(device)
    if cfg.prompts_per_step % world:
        raise ValueError(f"prompts_per_step ({cfg.prompts_per_step}) must divide evenly over {world} processes")
    log = log if rank == 0 else (lambda _: None)
    out = Path(cfg.output_dir)  # created once everything is built: a run that fails to start leaves no directory
    defaults = dataclasses.asdict(TrainConfig())  # a field the record predates must be at its default
    # a resume is the same experiment: on the rows it started on (refused on others), wherever they lie now
    moved = latest_step(out) is not None and reads_dataset(cfg) and same_dataset(out, cfg.dataset)
    free = (*RESUMABLE, "dataset") if moved else RESUMABLE
    record_config(out, dataclasses.asdict(cfg), write=False, defaults=defaults, free=free)
    pool, held = problem_sets(cfg, task_of(cfg))  # before the model: too few problems is said without a warm start
    if world > 1 and cfg.model.name == "lab":  # rank 0 builds the cached lab model, the others then load it
        if rank == 0:
            build(cfg)
        torch.distributed.barrier()
    model, tok, task, encode = build(cfg)
    if warning := cut_short(cfg, tok, pool + held):
        log(warning)
    torch.manual_seed(cfg.seed)  # after build: the same state whether or not the lab model came from the cache
    model.to(device).train()
    rollout, sync = rollout_model(cfg, model, device, pool + held, encode)
    kv_fp8 = getattr(getattr(rollout, "quant_config", None), "kv_cache", False)
    if cfg.rollout.align:  # QaRL: the trainer computes in the rollout format, gradients reach FP32 weights
        align_(model, rollout_format(cfg))
    # the KL reference is the starting policy as the trainer computes it (aligned too: no quantisation gap in the KL)
    ref = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_coef > 0 and cfg.lora.r == 0 else None
    if cfg.lora.r > 0:
        model = with_lora(cfg, model, cfg.lora.dropout)
        ref = model if cfg.kl_coef > 0 else None  # the reference is the base model: adapters off, no copy
    if p_drop := active_dropout(model):
        log(f"dropout p={p_drop} is active while training (lora.dropout, or the model's own): old "
            "log-probs and the rollouts are computed without it, so every PPO ratio carries its noise and the clip "
            "acts on that noise; RL recipes usually set it to 0")  # fmt: skip
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(cfg.warmup_steps, 1)))
    policy = make_policy(cfg, tok, model)
    fit = pool[: cfg.eval_problems]  # training prompts: how well RL fits what it trains on, next to held-out

    def evaluations(suffix: str = "") -> dict:
        shard = {"rank": rank, "world": world}  # every rank decodes its share
        return {f"eval_accuracy{suffix}": evaluate(model, tok, task, encode, held, policy, **shard),
                f"fit_accuracy{suffix}": evaluate(model, tok, task, encode, fit, policy, **shard)}  # fmt: skip

    start, prev_alpha, guard_state, end_point, past = 0, None, {}, {cfg.correction.name: 1.0}, []  # a new run's
    ckpt = latest_checkpoint(out)
    if ckpt is not None:
        if rank == 0:  # one trainer per folder, until train returns
            opened.append(hold_run(out))
        recorded = run_start(out)  # the KL reference is rebuilt, not saved: it must be the weights the run began from
        if ref is not None and ref is not model and recorded and weights_digest(ref.state_dict()) != recorded:
            raise ValueError(f"{out} started from other weights than those built here (start.json), and with "
                             "kl_coef > 0 they are its KL reference: resume with the model it started from (for the "
                             "lab, the warm start of its AISRL_CACHE, built on the same kind of CPU; else the same "
                             "checkpoint files), or branch with kl_coef=0")  # fmt: skip
        state = load_checkpoint(ckpt, model, opt, rank)
        start = state["step"]
        prev_alpha, guard_state, end_point, past = _resumed(cfg, state["extra"], log)
        sched.last_epoch = start  # the schedule of this config, not the checkpoint's (a branch may change lr/warmup)
        for group, base, lam in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True):
            group["initial_lr"], group["lr"] = base, base * lam(start)  # the lr of step start + 1
        sync(merged_state(model))
        log(f"resumed from {ckpt} at step {start}")
    elif rank == 0:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"output_dir={out} cannot be created ({e.strerror}); choose another output_dir") from e
        opened.append(hold_run(out))
        # which weights (pairs of runs must share them) and rows this run starts from
        record_start(out, model, cfg.dataset if reads_dataset(cfg) else "")
    # everything built: this run is under way (a resume with nothing left to train leaves the record as it is)
    record_config(out, dataclasses.asdict(cfg), write=rank == 0 and start < cfg.max_steps, defaults=defaults,
                  free=free)  # fmt: skip
    metrics_path = out / "metrics.jsonl"
    if rank == 0:
        # drop rows of steps after the checkpoint; a fresh start keeps none, and so reads none (a damaged file of
        # an abandoned start does not stop it)
        rows = [r for r in read_jsonl(metrics_path) if r["step"] <= start] if start else []
        atomic_write_text(metrics_path, "".join(json.dumps(r) + "\n" for r in rows))
    if start >= cfg.max_steps:
        log(f"{out} is already at step {start} (max_steps={cfg.max_steps}); nothing to train")

    past = collections.deque(past, maxlen=cfg.correction.calibrate_window - 1)  # what the next calibration averages
    B, G = cfg.prompts_per_step, cfg.group_size
    guard = MismatchGuard(cfg.correction.guard, **guard_state)
    tracker = Tracker(out, cfg.max_steps, start, log) if rank == 0 else None
    opened.append(tracker)  # a run that fails mid-way still flushes TensorBoard and gives the terminal back
    for step in range(start + 1, cfg.max_steps + 1):
        t, row = {}, {}
        if step == 1:  # the held-out baseline every later evaluation is compared with
            row.update(evaluations("_start"))
        # 1. prompts and G rollouts each, from the low-precision copy
        rng = random.Random(cfg.seed * 1_000_003 + step)
        K = cfg.rollout.pool or G  # candidates sampled per prompt (Sol-RL samples more and keeps G)
        problems = [p for p in rng.sample(pool, min(B, len(pool))) for _ in range(K)]
        stream = cfg.seed * 1_000_003 + step + cfg.sample_salt * 1_000_000_007  # a salt moves samples, not prompts
        seeds = [stream * 4096 + i for i in range(len(problems))]  # distinct in the low 32 bits CPU generators keep
        shard = slice(rank * len(problems) // world, (rank + 1) * len(problems) // world)  # whole groups per rank
        problems, seeds = problems[shard], seeds[shard]
        prompts = [encode(p) for p in problems]
        t0 = time.perf_counter()
        r = policy.sample(rollout, prompts, seeds, step, kv_fp8)
        t["time_rollout"] = time.perf_counter() - t0
        # 2. rewards and group advantages
        scored = task_rewards(task, tok, r, problems)
        rewards = torch.tensor([s[0] for s in scored])
        scorable = torch.isfinite(rewards)  # a NaN reward (a reward function that could not score) gets advantage 0
        reward_sum, n_scored, n_correct, n_samples, n_tokens = all_sum(
            rewards[scorable].sum().double(),
            scorable.sum().double(),
            torch.tensor(sum(s[1] for s in scored), dtype=torch.float64),
            torch.tensor(len(scored), dtype=torch.float64),
            r.completion_mask.sum().double(),
        )
        if K != G:  # Sol-RL: keep each prompt's extremes
            keep = select_extremes(rewards, K, G)
            r, rewards = r.select(keep), rewards[keep]
        adv = group_advantages(rewards, G, scale=cfg.scale_advantages)  # (N,)
        # 3. old_logp at training precision (or bypass), then the correction
        t0 = time.perf_counter()
        if cfg.correction.bypass:
            old_logp = r.rollout_logp
        else:
            with torch.no_grad(), eval_mode(model):  # no dropout noise in old_logp, hence in the weights
                old_logp = _score_at(policy, model, r, step, cfg.precision)
        t["time_logprob"] = time.perf_counter() - t0
        score = functools.partial(_score_at, policy, step=step, precision=cfg.precision)  # (diffusion: its seed)
        errors = error_tokens(r.completion_ids, r.completion_mask, old_logp - r.rollout_logp)  # (N, T)
        keep = ~errors if cfg.correction.mask_errors else None  # the tokens the loss keeps (QaRL's masking, if on)
        calibration, record, picked = {}, None, end_point
        k = cfg.correction.calibrate_every  # calibrate on schedule, or first thing where no pick is known yet
        if k and ((step - 1) % k == 0 or not set(end_point) <= set(cfg.correction.candidates)):
            t0 = time.perf_counter()
            batch = (prompts, problems, seeds)
            g_full = _full_precision_gradient(cfg, model, ref, policy, task, tok, batch, step, score)
            # each candidate is judged on the tokens it would train on
            low = functools.partial(_gradient, cfg, model, ref, r, old_logp, adv, score=score, policy=policy, keep=keep)
            options = functools.partial(correction_options, cfg, prev_alpha)
            picked, calibration, record = end_point_weights(
                cfg.correction.candidates, low, g_full, old_logp, r.rollout_logp, r.completion_mask, options,
                rule=cfg.correction.calibrate_rule, keep=end_point, past=past)  # fmt: skip
            t["time_calibrate"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        results = {name: correct(name, old_logp, r.rollout_logp, r.completion_mask,
                                 **correction_options(cfg, prev_alpha, name)) for name in picked}  # fmt: skip
        res = _applied(cfg, results, picked, keep)
        n_err, n_completion = all_sum(errors.sum().double(), r.completion_mask.sum().double())  # of the kept rows
        res.metrics["error_token_frac"] = n_err / n_completion.clamp(min=1)  # (a token the trainer cannot score too)
        alpha = res.metrics["alpha"].item() if "alpha" in res.metrics else None
        measured_batch = res.metrics["num_tokens"].item() > 0  # no token the trainer could score: nothing measured
        tripped = guard.tripped(res.metrics["k3_kl"].item() if measured_batch else float("nan"))
        if tripped:  # the last update left the rollout copy behind: undo it
            res = restrict(res, torch.zeros_like(res.mask))
            res.metrics["guard_rollback"] = torch.tensor(float(guard.restore(model, opt)))
        elif cfg.correction.guard > 0:
            guard.save(model, opt)
            res.metrics["guard_rollback"] = torch.tensor(0.0)
        if cfg.correction.guard > 0:  # a jump with no update to undo: the guard's baseline starts again from it
            res.metrics["guard_rebase"] = torch.tensor(float(guard.rebased))
        if not tripped:  # a tripped step measured weights now undone: its calibration neither picks nor is kept
            end_point = picked
            if record is not None and measured(record):  # an unmeasured one leaves its place to those that measured
                past.append(record)
        if cfg.correction.calibrate_every:  # the candidate of largest weight (NaN: a resumed pick among none), weights
            top = max(end_point, key=end_point.get)
            main = cfg.correction.candidates.index(top) if top in cfg.correction.candidates else float("nan")
            calibration["end_point"] = torch.tensor(float(main))
            calibration.update({f"end_weight_{n}": torch.tensor(end_point.get(n, 0.0))
                                for n in cfg.correction.candidates})  # fmt: skip
        t["time_correction"] = time.perf_counter() - t0
        # 4. mu epochs of the clipped loss over micro-batches, one optimizer step per epoch
        t0 = time.perf_counter()
        loss_metrics = policy_update(cfg, model, ref, opt, r, old_logp, adv, res, score, policy.order(r))
        if loss_metrics["update_skipped"] == 1.0:  # nothing moved: no update for the guard to undo next step
            guard.forget()
        with warnings.catch_warnings():  # a skipped update (nothing left to train on) still advances the schedule
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler")
            sched.step()
        t["time_train"] = time.perf_counter() - t0
        # 5. weight sync into the rollout copy (a LoRA run's merge of its adapters included)
        t0 = time.perf_counter()
        sync(merged_state(model))
        t["time_sync"] = time.perf_counter() - t0
        # a tripped batch is an outlier and an unmeasured one measured nothing: both stay out of the AIS EMA
        prev_alpha = alpha if measured_batch and not tripped else prev_alpha
        row = {"step": step, **row, "reward": reward_sum / n_scored.clamp(min=1),
               "reward_nan_frac": 1.0 - n_scored / n_samples, "accuracy": n_correct / n_samples,
               "completion_len": n_tokens / n_samples, "alpha": alpha, **res.metrics, **calibration,
               **loss_metrics, **t}  # fmt: skip
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            row.update(evaluations())
        save_now = step % cfg.checkpoint_every == 0 or step == cfg.max_steps
        rngs = rank_rng_states(device) if save_now and world > 1 else None  # every rank takes part
        if rank == 0:
            tracker.log_step(row)
            if save_now:
                kept = {"prev_alpha": prev_alpha, "k3": guard.history, "guard_undo": guard.state(),
                        "k3_rollout": _mismatch_key(cfg), "end_point": end_point, "calibrations": list(past)}
                save_checkpoint(out, step, model, opt, kept, keep=cfg.keep_checkpoints, rank_rng=rngs)
    if rank != 0:
        return {}
    tracker.close()
    from aisrl.report import write_report

    return write_report(out)


def _mismatch_key(cfg: TrainConfig) -> dict:
    """The settings the rollout/trainer mismatch depends on (format, QaRL alignment, sampling, trainer precision,
    bypass): the guard's k3 baseline is valid only under them."""
    ro = cfg.rollout
    return {"quant": ro.quant, "align": ro.align, "temperature": ro.temperature, "top_p": ro.top_p,
            "top_k": ro.top_k, "precision": cfg.precision, "bypass": cfg.correction.bypass, "keep": ro.keep,
            "engine": ro.engine}  # fmt: skip


def _resumed(cfg: TrainConfig, extra: dict, log) -> tuple[float | None, dict, dict[str, float], list[dict]]:
    """(prev_alpha, guard state, end point, calibration window) from a checkpoint's extra state. All four were
    measured under the checkpoint's rollout settings; under others (a branch to another format) they mean nothing,
    and the AIS moving average, the guard's k3 baseline and the calibrations start afresh. Checkpoints before
    `k3_rollout` was stored count as the same settings. The guard's undo copy leaves `extra`, so that it is held once
    (by the guard) for the run."""
    undo = extra.pop("guard_undo", None)
    fresh = {cfg.correction.name: 1.0}  # without calibration the configured correction is the end point
    stored = {"keep": [], "engine": "hf", **extra.get("k3_rollout", _mismatch_key(cfg))}  # (keep, engine: later)
    if stored != _mismatch_key(cfg):
        log("the checkpoint's rollout settings differ from this run's: the AIS moving average, the mismatch guard's "
            "baseline and the calibration window start afresh")  # fmt: skip
        return None, {}, fresh, []
    guard = {"history": extra.get("k3", []), "saved": undo} if cfg.correction.guard > 0 else {}
    end_point = fresh  # so a branch that names another correction, without calibration, trains with it
    if cfg.correction.calibrate_every and "end_point" in extra:  # the last pick (a name before mixtures)
        end_point = extra["end_point"] if isinstance(extra["end_point"], dict) else {extra["end_point"]: 1.0}
    past = [c for c in extra.get("calibrations", []) if measured(c)]  # (older runs kept every one)
    return extra.get("prev_alpha"), guard, end_point, past


def _full_precision_gradient(cfg: TrainConfig, model, ref, policy, task, tok, batch, step, score) -> torch.Tensor:
    """(P,) the uncorrected gradient of the step's prompts sampled by the full-precision trainer with the
    low-precision batch's seeds (batch: prompts, problems, seeds): the reference of a calibration (aisrl.calibrate)."""
    prompts, problems, seeds = batch
    with torch.no_grad(), eval_mode(model):
        full = policy.sample(model, prompts, seeds, step)
        old_logp = _score_at(policy, model, full, step, cfg.precision)
    rewards = torch.tensor([s[0] for s in task_rewards(task, tok, full, problems)])
    plain = correct("none", old_logp, full.rollout_logp, full.completion_mask)
    adv = group_advantages(rewards, cfg.group_size, scale=cfg.scale_advantages)  # (N,)
    return _gradient(cfg, model, ref, full, old_logp, adv, plain, score, policy)


def _restricted(cfg: TrainConfig, res, keep):
    """The correction result with only the tokens of `keep` (N, T) left (None: all), its weights renormalized there
    when the correction normalizes them."""
    return res if keep is None else restrict(res, keep, normalize=bool(cfg.correction.options.get("normalize")))


def _applied(cfg: TrainConfig, results: dict, picked: dict[str, float], keep):
    """The correction the update applies: the picked candidates' results, each restricted to `keep` (renormalised there
    on its own, as the calibration measured it), mixed with the weights `picked`."""
    mixed = combine({name: _restricted(cfg, res, keep) for name, res in results.items()}, picked)
    return mixed if keep is None or len(results) == 1 else restrict(mixed, keep)  # the mixture's weight statistics


def _gradient(cfg: TrainConfig, model, ref, r, old_logp, adv, res, score, policy, keep=None) -> torch.Tensor:
    """(P,) the flat gradient one update pass of this batch would take (on the tokens in `keep` (N, T), if given),
    left out of the model's .grad."""
    res = _restricted(cfg, res, keep)
    model.zero_grad(set_to_none=True)
    accumulate_gradient(cfg, model, ref, r, old_logp, adv, res, score, policy.order(r))
    g = flat_grad(model)
    model.zero_grad(set_to_none=True)
    return g


def _score_at(policy, model, rows, step, precision="fp32"):
    """Trainer-side log-probs of this step's rollouts, under autocast when precision is bf16."""
    dtype = PRECISIONS[precision]
    device = device_of(model)
    with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        return policy.score(model, rows, step).float()


@torch.no_grad()
def evaluate(model, tok, task, encode, problems, policy, *, rank: int = 0, world: int = 1) -> float:
    """Greedy accuracy of the full-precision model (QaRL-aligned layers are switched off for it, so every
    method is evaluated the same way). `policy`: aisrl.policy.CausalPolicy or DiffusionPolicy. Under torchrun
    (every rank calling, with its `rank` of `world`) each rank decodes every world-th problem and the counts are
    summed, so the ranks share the work and agree on the result."""
    mine = problems[rank::world]
    correct = 0.0
    if mine:
        with alignment(model, False), eval_mode(model):
            r = policy.greedy(model, [encode(p) for p in mine])
        correct = float(sum(s[1] for s in task_rewards(task, tok, r, mine)))
    if world > 1:
        (total,) = all_sum(torch.tensor(correct, dtype=torch.float64))
        correct = total.item()
    return correct / len(problems)
