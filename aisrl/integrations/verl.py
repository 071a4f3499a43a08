"""AIS inside verl: `install()` registers aisrl's corrections as verl policy losses.

    import aisrl.integrations.verl as av
    av.install()        # then: actor_rollout_ref.actor.policy_loss.loss_mode=ais

Registered names: "ais", and "aisrl_<name>" for every correction of aisrl.correction.CORRECTIONS
("aisrl_tis", "aisrl_icepop", "aisrl_seq_mask", ...). Each loss is verl's vanilla PPO loss (clip_ratio_low /
clip_ratio_high / dual clip clip_ratio_c, aggregated by verl's own `agg_loss` with the batch information verl
provides) multiplied per token by the aisrl correction weights, with the correction's mask applied.

What the correction needs and where it comes from (verl 0.9). verl never hands a policy loss the rollout
log-probs; it hands `rollout_is_weights = exp(old_log_prob - rollout_log_prob)`, computed once per batch from
the trainer's recomputed old log-probs, and by default truncated. With untruncated token weights the rollout
log-probs are recovered exactly on valid tokens, rollout_logp = old_logp - log(w), and the correction runs on
(old_logp, rollout_logp) as everywhere else. That needs these verl settings (REQUIRED_SETTINGS):

    algorithm.rollout_correction.rollout_is=token
    algorithm.rollout_correction.rollout_is_threshold=inf
    algorithm.rollout_correction.rollout_is_batch_normalize=false
    algorithm.rollout_correction.rollout_rs=null
    algorithm.rollout_correction.bypass_mode=false
    actor_rollout_ref.rollout.calculate_log_probs=true

The first CHECKED_CALLS micro-batches (about a first step's) are checked, and a ValueError naming these settings
is raised when what arrived cannot be raw token weights (none at all, values capped at a threshold: three tokens at
the largest weight, counted over those calls; zeros inside the mask; or constant per sequence). A NaN
weight is not read as a setting: verl's exp(clamp(old - rollout, -20, 20)) keeps the NaN of a token whose rollout
log-prob is NaN, and `correct` drops that token from the loss (counted in `aisrl/nonfinite_frac`), on the first
micro-batch as on any other.
verl bounds the log-ratio at +-20 before exponentiating, so the recovered rollout log-prob is exact only where
|old_logp - rollout_logp| <= 20; aisrl clamps log-ratios at the same bound (aisrl.diagnostics.LOG_RATIO_CLAMP),
so the corrections see what they would have seen with the true rollout log-probs.

verl calls the loss once per micro-batch, and ranks may run different numbers of micro-batches, so the
correction statistics (alpha and the diagnostics) are computed per micro-batch on each rank
(`aisrl.dist.local_only`), not all-reduced, and an AIS `ema` smooths alpha over that rank's successive
micro-batches (its time scale is in micro-batches, not steps). Workers must register the losses: set
`actor_rollout_ref.model.external_lib=aisrl.integrations.verl_plugin` (verl's workers import it when they build
the model, on every node), or `VERL_USE_EXTERNAL_MODULES=aisrl.integrations.verl_plugin` in the environment of
every worker (on a multi-node Ray cluster, through Ray's runtime environment), or call install() from your own
plugin.

With one mini-batch and one epoch verl's actor replaces old_log_prob by the current log_prob (they are equal at
that point) after the weights were computed, so the recovered rollout_logp is shifted by that difference while
the log-ratio the correction sees, log(w), is exact: weights, alpha and every ratio metric are right; only
`rollout_ppl` and `ppl_diff` carry the shift.

Loss denominators under rejection (icepop, seq_mask, geo_mask, k*_reject, veto=). The aisrl trainer takes rejected
tokens out of the loss and out of its denominators (aisrl.update: mask=res.mask). Here the kept-token mask goes to
verl's `agg_loss`, but what it divides by depends on verl's path:
- no global batch information (verl's legacy dp_actor path, `global_batch_info` empty): the micro-batch's kept
  tokens (token-mean) or kept sequences (seq-mean-token-mean, seq-mean-token-sum), as in the aisrl trainer; the
  adapter aggregates these itself (aisrl.losses' aggregation, on this rank), since verl's fallback differs between
  releases (some count every sequence, a wholly rejected one too); seq-mean-token-sum-norm goes to verl's agg_loss;
- verl >= 0.7's model-engine path (`global_batch_info` = dp_size, batch_num_tokens, global_batch_size): verl counted
  those from its own response mask before the correction ran, so rejected tokens and wholly rejected sequences stay
  in them: the loss, and the step, are the aisrl trainer's times the kept fraction, tokens kept / batch_num_tokens for
  token-mean, sequences kept / global_batch_size for seq-mean-* (for one micro-batch on one rank exactly; summed over
  micro-batches and ranks, the kept fraction of the global batch). The per-sequence token mean of seq-mean-token-mean
  still runs over the kept tokens.
The adapter does not rescale to the aisrl convention: the global kept count is known only after every micro-batch of
every rank has run its correction, and a collective inside the loss could hang (ranks run different numbers of
micro-batches); a per-micro-batch rescale would up-weight micro-batches that lost most of their tokens. So, on that
path, a rejecting correction shrinks the step by the kept fraction, which acts like a learning rate scaled by it
(Adam-type optimisers largely normalise a steady scale away, SGD does not): tune the learning rate with the
correction on, and watch `aisrl/mask_frac_token` / `aisrl/mask_frac_seq` (1 - kept fraction, per micro-batch).

Needs verl >= 0.7: earlier versions call policy losses without `rollout_is_weights` or expect four return
values; install() refuses them (`check_verl`).
"""

from __future__ import annotations

import inspect
import math
import re

import torch

from aisrl.correction import CORRECTIONS, check_options, correct
from aisrl.diagnostics import LOG_RATIO_CLAMP
from aisrl.dist import local_only
from aisrl.losses import _masked_aggregate, clipped_surrogate

REQUIRED_SETTINGS = (
    "algorithm.rollout_correction.rollout_is=token",
    "algorithm.rollout_correction.rollout_is_threshold=inf",
    "algorithm.rollout_correction.rollout_is_batch_normalize=false",
    "algorithm.rollout_correction.rollout_rs=null",
    "algorithm.rollout_correction.bypass_mode=false",
    "actor_rollout_ref.rollout.calculate_log_probs=true",
)


MIN_VERL = (0, 7)
"""verl's policy-loss interface the adapter implements: called with `rollout_is_weights=` (verl PRs #3694 and
#3984), returning (loss, metrics) (PR #4062, released in 0.7.0)."""


def check_verl(core_algos, version: str) -> None:
    """Raise ImportError, naming the version needed, when verl's policy-loss interface is older than MIN_VERL."""
    vanilla = getattr(core_algos, "compute_policy_loss_vanilla", None)
    takes_weights = vanilla is not None and "rollout_is_weights" in inspect.signature(vanilla).parameters
    m = re.match(r"(\d+)\.(\d+)", version or "")
    too_old = m is not None and (int(m[1]), int(m[2])) < MIN_VERL
    if not takes_weights or too_old:
        need = ".".join(map(str, MIN_VERL))
        raise ImportError(f"aisrl's verl losses need verl >= {need} (policy losses called with rollout_is_weights= "
                          f"and returning (loss, metrics)); this is verl {version or '(unknown version)'}: "
                          f"pip install -U 'verl>={need}'")  # fmt: skip


def _verl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("verl")
    except PackageNotFoundError:  # a source checkout on sys.path
        import verl

        return str(getattr(verl, "__version__", ""))


def _settings_error(what: str) -> ValueError:
    return ValueError(f"aisrl verl loss: {what}. The correction needs verl's raw per-token rollout IS weights; set\n  "
                      + "\n  ".join(REQUIRED_SETTINGS))  # fmt: skip


IMPLIED_LOGP_TOL = 1e-3
"""How far above 0 a rollout log-prob implied by the weights may sit (round-off of exp and log in FP32) before the
weights are taken for rescaled ones: a batch mean of 1.001 or more shows on any token the sampler was sure of."""

CHECKED_CALLS = 16
"""Micro-batches (about a first step's) whose weights each loss function judges; later ones only need weights."""


def check_raw_weights(w: torch.Tensor | None, mask: torch.Tensor, tally: dict | None = None,
                      old_logp: torch.Tensor | None = None) -> bool:  # fmt: skip
    """Raise if `w` cannot be verl's untruncated token-level exp(old_logp - rollout_logp); return whether there was
    anything to judge (False for a micro-batch without a valid token, or whose weights are all NaN). `tally` carries
    the largest weight seen and the tokens that held it over a loss function's calls: a cap that few tokens of
    each micro-batch reach (verl's default 2.0 under a mild mismatch) shows only as ties summed over several.
    Given `old_logp` (N, T), tokens tie only with different trainer log-probs: completions of one prompt that share
    a prefix give those tokens the very same log-probs on both sides, so the very same raw weight; and weights that
    imply a rollout log-prob above 0 (old_logp - log w > IMPLIED_LOGP_TOL) were divided by a batch mean above 1.

    NaN weights are not a sign of the settings: verl's exp(clamp(old - rollout, -20, 20)) keeps the NaN of a token
    the rollout engine could not score (clamp passes NaN through), and `correct` drops such tokens (counted in
    `nonfinite_frac`). So the heuristics look at the other tokens only."""
    if w is None:
        raise _settings_error("verl passed no rollout_is_weights (rollout_is is off or rollout log-probs missing)")
    on = mask.bool() & ~torch.isnan(w.detach())  # (N, T) the tokens the heuristics judge
    v = w.detach()[on]
    if v.numel() == 0:
        return False
    if not torch.isfinite(v).all() or (v <= 0).any():
        raise _settings_error("rollout_is_weights has zeros or infinite values inside the response mask "
                              "(a rejection/IcePop threshold such as '0.5_2.0' was applied)")  # fmt: skip
    if old_logp is not None:  # raw weights imply rollout log-probs <= 0; weights divided by a mean above 1 do not
        implied = (old_logp.detach().double() - w.detach().double().log())[on]  # the rollout log-probs they imply
        if (implied > IMPLIED_LOGP_TOL).any():
            raise _settings_error(f"rollout_is_weights imply a rollout log-prob of {implied.max().item():.3g} > 0, "
                                  "which no sampler gives: they were rescaled (rollout_is_batch_normalize=true)")
    if (v == 1).all():
        return True  # bit-identical engines: raw weights that are all exactly 1
    lengths = on.sum(-1)
    multi = lengths > 1
    if multi.sum() >= 2:
        wm = torch.where(on, w.detach(), float("nan"))[multi]
        spread = (wm.nan_to_num(-math.inf).amax(-1) - wm.nan_to_num(math.inf).amin(-1)).abs()
        if (spread == 0).all():
            raise _settings_error("rollout_is_weights are constant within every sequence (rollout_is=sequence)")
    tally = {"top": -math.inf} if tally is None else tally
    seen = tally.setdefault("seen", set())  # verl replays its micro-batches in every PPO epoch: count each once
    fingerprint = (v.numel(), float(v.double().sum()), float(v.max()))
    if fingerprint in seen:
        return True
    seen.add(fingerprint)
    top = v.max().item()
    if top >= tally["top"]:  # ties at the largest weight so far, over every call that reached it
        at = v == top
        tied = ({("old", x) for x in old_logp.detach()[on][at].tolist()} if old_logp is not None
                else {("token", len(seen), i) for i in range(int(at.sum()))})  # fmt: skip
        tally["tied"] = (tally.get("tied", set()) if top == tally["top"] else set()) | tied
        tally["top"] = top
    top = tally["top"]
    at_bound = top >= math.exp(LOG_RATIO_CLAMP) * (1 - 1e-6)  # verl's own safety bound: ties there are raw
    if top > 1.0 and len(tally.get("tied", ())) >= 3 and not at_bound:  # raw exp(log-ratio) values hardly ever tie
        raise _settings_error(f"rollout_is_weights look truncated at {top:g} (many tokens share the maximum)")
    return True


def make_policy_loss(name: str, **options):
    """A verl policy-loss function applying aisrl correction `name` with `options` (e.g. cap=2.0). With verl's global
    batch information, a rejecting correction scales the loss by the kept fraction (module docstring)."""
    if name not in CORRECTIONS:
        raise ValueError(f"unknown correction {name!r}; choose from {sorted(CORRECTIONS)}")
    check_options(name, **options)  # at install(), not inside a Ray worker after the first rollout
    state = {"prev_alpha": None, "judged": 0, "tally": {"top": -math.inf}}

    def policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                    rollout_is_weights=None):  # fmt: skip
        from verl.trainer.ppo.core_algos import agg_loss

        on = response_mask.bool()
        if rollout_is_weights is None or state["judged"] < CHECKED_CALLS:  # the settings are fixed: the heuristics
            state["judged"] += check_raw_weights(rollout_is_weights, on, state["tally"], old_log_prob)  # first calls
        safe_w = torch.where(on, rollout_is_weights.detach(), torch.ones_like(rollout_is_weights))
        rollout_logp = torch.where(on, old_log_prob.detach() - safe_w.log(), 0.0)  # (N, T)
        opts = dict(options)
        if name == "ais" and opts.get("ema"):
            opts["prev_alpha"] = state["prev_alpha"]
        with local_only():
            res = correct(name, old_log_prob.detach(), rollout_logp, on, **opts)
        cfg = config if config is not None else {}
        clip = cfg.get("clip_ratio", 0.2)
        lo = cfg.get("clip_ratio_low") if cfg.get("clip_ratio_low") is not None else clip
        hi = cfg.get("clip_ratio_high") if cfg.get("clip_ratio_high") is not None else clip
        keep = res.mask & on
        pg, ratio, log_ratio, clipped, dual = clipped_surrogate(log_prob, old_log_prob, advantages, keep, (lo, hi),
                                                                cfg.get("clip_ratio_c", 3.0))  # fmt: skip
        pg = pg * torch.where(keep, res.weights.detach().to(pg.dtype), 0.0)  # (N, T)
        info = getattr(config, "global_batch_info", None) or (cfg.get("global_batch_info") or {})
        count = "batch_num_tokens" if loss_agg_mode == "token-mean" else "global_batch_size"
        if info.get(count) is not None:  # verl's global counts (its model-engine path)
            loss = agg_loss(pg, keep, loss_agg_mode, **info)
        elif loss_agg_mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
            # no global counts (the legacy path; the model-engine path may pass None): over this micro-batch's kept
            # tokens and sequences, as the aisrl trainer, here rather than by verl's fallback, which in some releases
            # counts every sequence (a rejected one too) or divides a rejected sequence's 0 by 0; 0 if none is kept
            with local_only():
                loss = _masked_aggregate(pg, keep, loss_agg_mode, None)
        else:  # seq-mean-token-sum-norm: verl's own horizon (loss_scale_factor); 0, with the graph, if none is kept
            loss = agg_loss(pg, keep, loss_agg_mode, **info) if keep.any() else (pg * 0).sum()
        if "alpha" in res.metrics and res.metrics["num_tokens"].item() > 0:  # an unscored batch measured nothing
            state["prev_alpha"] = res.metrics["alpha"].item()
        n = keep.sum().clamp(min=1)
        metrics = {"actor/pg_clipfrac": (clipped.sum() / n).item(), "actor/pg_clipfrac_lower": (dual.sum() / n).item(),
                   "actor/ppo_kl": (-(log_ratio * keep).sum() / n).item()}  # fmt: skip
        metrics.update({f"aisrl/{k}": float(v) for k, v in res.metrics.items()})
        return loss, metrics

    policy_loss.__name__ = f"aisrl_{name}_policy_loss"
    return policy_loss


def install(options: dict[str, dict] | None = None) -> list[str]:
    """Register "ais" and "aisrl_<name>" for every aisrl correction in verl's policy-loss registry; returns the
    names. `options` maps a correction name to its keyword options, e.g. {"ais": {"cap": 2.0, "ema": 0.9}}."""
    try:
        from verl.trainer.ppo import core_algos
    except ImportError as e:
        from aisrl.integrations import import_error

        need = f"verl>={'.'.join(map(str, MIN_VERL))}"
        fix = f"aisrl.integrations.verl.install() needs verl: pip install '{need}'"
        raise import_error(e, "verl", fix, need) from e
    check_verl(core_algos, _verl_version())
    options = options or {}
    for key in options:
        if key not in CORRECTIONS:
            raise ValueError(f"options for unknown correction {key!r}; choose from {sorted(CORRECTIONS)}")
    names = []
    for name in CORRECTIONS:
        fn = make_policy_loss(name, **options.get(name, {}))
        for alias in (["ais"] if name == "ais" else []) + [f"aisrl_{name}"]:
            core_algos.register_policy_loss(alias)(fn)
            names.append(alias)
    return names
