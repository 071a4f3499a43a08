"""The policy-gradient update of one GRPO step: mu epochs of the clipped loss over micro-batches.

Why a module of its own: it is the one place where the loss meets the model (micro-batching, gradient
accumulation, the optional KL reference, data-parallel gradient averaging, clipping), and it reads best apart
from the trainer's bookkeeping. Each micro-batch's loss is scaled by its share of the batch's global token (or
sequence) count, so accumulating them gives exactly the full-batch loss of aisrl.losses, whatever the grouping
(DAPO-style token-mean aggregation; Yu et al. 2025) and across ranks (`aisrl.dist.all_sum`).
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time

import torch

from aisrl.dist import all_sum, world_size
from aisrl.lora import is_peft
from aisrl.losses import LOSSES, SEQ_METRICS


@contextlib.contextmanager
def eval_mode(model):
    """The model in eval mode for the block, its previous mode restored after."""
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


def active_dropout(model) -> float:
    """The largest dropout probability the model applies in train mode (nn.Dropout modules, LoRA's included, and
    the attention dropout of a Hugging Face config); 0 when training is deterministic."""
    modules = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    config = getattr(getattr(model, "config", None), "attention_dropout", 0.0) or 0.0
    return max([0.0, float(config), *modules])


def _as_reference(ref):
    """Score with the reference policy: a frozen copy as is, or a LoRA model with its adapters switched off
    (the d1 recipe's reference, without a second copy of the weights), in eval mode either way."""
    stack = contextlib.ExitStack()
    stack.enter_context(eval_mode(ref))
    if is_peft(ref):
        stack.enter_context(ref.disable_adapter())
    return stack


def _clock(model) -> float:
    """perf_counter once the model's device has finished its queued work (CUDA runs asynchronously)."""
    p = next(model.parameters(), None)
    if p is not None and p.is_cuda:
        torch.cuda.synchronize(p.device)
    return time.perf_counter()


def accumulate_gradient(cfg, model, ref, r, old_logp, adv, res, score, order) -> dict[str, float]:
    """One pass of the loss over micro-batches of the rows in `order` (the policy's: by length for causal LMs),
    its gradient added to each parameter's .grad and averaged over ranks; returns the loss metrics and the
    seconds spent in forward passes (policy, reference and loss: `time_forward`) and backward passes
    (`time_backward`, gradient averaging over ranks included)."""
    n = r.completion_ids.shape[0]
    mask = res.mask
    tok_total, seq_total = all_sum(mask.sum().double(), mask.any(1).sum().double())  # global denominators
    totals = {"tok": tok_total.clamp(min=1), "seq": seq_total.clamp(min=1)}
    acc: dict[str, float] = {}
    seconds = {"time_forward": 0.0, "time_backward": 0.0}
    agg = "seq-mean" if cfg.loss == "tbpo" else cfg.agg
    dual_clip = cfg.dual_clip or (3.0 if cfg.loss == "tbpo" else None)
    for s in range(0, n, cfg.micro_batch):
        t0 = _clock(model)
        sl = order[s : s + cfg.micro_batch]
        rows = r.select(sl)
        logp = score(model, rows)
        ref_logp = None
        if ref is not None:
            with torch.no_grad(), _as_reference(ref):
                ref_logp = score(ref, rows)
        loss, m = LOSSES[cfg.loss](logp, old_logp[sl], adv[sl], mask[sl], weights=res.weights[sl],
                                   clip=(cfg.clip_low, cfg.clip_high), dual_clip=dual_clip, agg=agg,
                                   ref_logp=ref_logp, kl_coef=cfg.kl_coef,
                                   horizon=cfg.rollout.max_new_tokens)  # fmt: skip
        # micro-batch share of the batch's denominator, so accumulation equals one full-batch loss
        (mb_tok, mb_seq) = all_sum(mask[sl].sum().double(), mask[sl].any(1).sum().double())
        shares = {"tok": (mb_tok / totals["tok"]).item(), "seq": (mb_seq / totals["seq"]).item()}
        share = shares["tok" if agg == "token-mean" else "seq"]
        t1 = _clock(model)
        (loss * share).backward()
        t2 = _clock(model)
        seconds["time_forward"] += t1 - t0
        seconds["time_backward"] += t2 - t1
        for k, v in m.items():  # the loss by its share of the loss's denominator, a metric by that of its own
            unit = "seq" if k in SEQ_METRICS[cfg.loss] else "tok"
            acc[k] = acc.get(k, 0.0) + v.item() * (share if k == "loss" else shares[unit])
    t0 = _clock(model)
    if world_size() > 1:  # data parallel: average gradients over ranks (what DDP does)
        for p in model.parameters():
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad)
                p.grad /= world_size()
    seconds["time_backward"] += _clock(model) - t0
    return {**acc, **seconds}


def flat_grad(model) -> torch.Tensor:
    """(P,) the trainable parameters' .grad, concatenated in parameter order (zeros where a parameter has none)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float().cpu()
                      for p in params])  # fmt: skip


def _grad_norm(params: list[torch.Tensor]) -> float:
    """The total L2 norm of the gradients, as clip_grad_norm_ measures it, without touching them."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6
        return torch.nn.utils.get_total_norm(grads).item()
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach()) for g in grads])).item()


def policy_update(cfg, model, ref, opt, r, old_logp, adv, res, score, order) -> dict:
    """mu epochs of accumulate_gradient, one optimizer step after each. Metrics are means over epochs; the
    seconds (time_forward, time_backward, time_optimizer: gradient clipping and the optimizer step) are totals.
    An epoch takes no step when every token is rejected (Adam's momentum would still move the weights) or when the
    gradient is not finite (one inf would turn the weights NaN for good, clipped or not); `update_skipped` is the
    fraction of epochs that took none. A batch whose tokens all carry advantage 0 (every group tied) does step, as
    GRPO implementations do: its gradient is 0, and Adam's momentum carries on from the steps before."""
    (tok_total,) = all_sum(res.mask.sum().double())
    acc: dict[str, float] = {"time_optimizer": 0.0}
    skipped = 0
    for _ in range(cfg.epochs):
        opt.zero_grad()
        for k, v in accumulate_gradient(cfg, model, ref, r, old_logp, adv, res, score, order).items():
            acc[k] = acc.get(k, 0.0) + (v if k.startswith("time_") else v / cfg.epochs)
        t0 = _clock(model)
        params_ = [p for p in model.parameters() if p.requires_grad]
        if cfg.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params_, cfg.grad_clip).item()
        else:  # off: measured and logged only (clipping to inf would scale a non-finite gradient's every value to NaN)
            norm = _grad_norm(params_)
        acc["grad_norm"] = acc.get("grad_norm", 0.0) + norm / cfg.epochs  # a mean over epochs, like the rest
        if tok_total > 0 and math.isfinite(norm):  # after an all-reduce every rank sees the same norm
            opt.step()
        else:
            skipped += 1
        acc["time_optimizer"] += _clock(model) - t0
    acc["update_skipped"] = skipped / cfg.epochs  # exactly 1.0 when no epoch stepped (a sum of 1/epochs is not)
    return acc


class MismatchGuard:
    """Undo an update after which the rollout copy stopped matching the trainer (`correction.guard`).

    On `lab_columns` every late fall of an FP8 + AIS run began with one step whose rollout/trainer k3 KL was about
    ten times that of the steps before (docs/ais.md section 5): an update had moved the trainer into weights its
    low-precision copy represents badly. When a batch's k3 exceeds `factor` times the median of the last `window`
    steps' (once half the window is filled), `tripped` says so, the weights and optimizer state saved before the
    last update come back (`restore`), and the step trains on nothing. A k3 below MIN_K3 never trips it: with
    rollouts (nearly) exact, the median is ~0 and rounding noise would otherwise read as a jump.

    A jump with no update to undo does not trip it. That is the step right after a rollback: its batch comes from
    the weights the low k3s were measured on, so the jump belongs to the batch or to a new level of the mismatch,
    not to an update; tripping again would skip every later step while the baseline never moved. Such a jump is
    accepted (`rebased`): the step trains and the baseline starts again from it. Costs a copy of the weights and
    the optimizer state, which checkpoints keep (`state`), so a resumed run guards as the uninterrupted one does;
    off (factor 0) it does nothing.
    """

    MIN_K3 = 1e-4
    """No jump below this k3 KL (FP8 W8A8 rollouts of the lab model sit near 2e-3, MXFP4 W4A4 near 0.08)."""

    def __init__(self, factor: float, window: int = 10, history: list[float] | None = None, saved=None):
        self.factor, self.window = factor, window
        on = factor > 0  # off, it keeps nothing: a later resume with the guard on must not undo to a stale copy
        self.history = [h for h in history or [] if math.isfinite(h)][-window:] if on else []
        self.saved = (saved["model"], saved["optimizer"]) if on and saved is not None else None
        self.rebased = False

    def tripped(self, k3: float) -> bool:
        """Whether the last update is to be undone for this batch's k3 (updates the baseline when it is not)."""
        self.rebased = False
        if self.factor <= 0 or not math.isfinite(k3):  # an unmeasured batch neither trips nor enters the baseline
            return False
        bar = max(self.factor * statistics.median(self.history), self.MIN_K3) if self.history else math.inf
        jump = len(self.history) >= self.window // 2 and k3 > bar
        if jump and self.saved is not None:
            return True  # a tripped batch is an outlier: it stays out of the baseline
        self.rebased = jump
        self.history = [k3] if jump else [*self.history, k3][-self.window :]
        return False

    def save(self, model, opt) -> None:
        """Copy what an update changes: the trainable weights and the buffers (not a LoRA model's frozen base), and
        the optimizer state."""
        if self.factor > 0:
            params = model.named_parameters(remove_duplicate=False)  # a tied frozen weight under both its names
            frozen = {name for name, p in params if not p.requires_grad}
            weights = {k: v.detach().clone() for k, v in model.state_dict().items() if k not in frozen}
            self.saved = (weights, copy.deepcopy(opt.state_dict()))

    def forget(self) -> None:
        """Drop the undo copy: the step it was saved for made no update, so a later jump is not that step's."""
        self.saved = None

    def restore(self, model, opt) -> bool:
        """Back to the weights before the last update; False if there is none."""
        if self.saved is None:
            return False
        model.load_state_dict(self.saved[0], strict=False)  # the frozen weights were not copied: they did not move
        opt.load_state_dict(self.saved[1])
        self.saved = None
        return True

    def state(self) -> dict | None:
        """The undo copy for a checkpoint (None when there is none): {'model': state dict, 'optimizer': state dict}."""
        return None if self.saved is None else {"model": self.saved[0], "optimizer": self.saved[1]}
