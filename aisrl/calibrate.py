"""Choose the importance-sampling end point by its measured gradient bias, from a full-precision batch every k steps.

Why it exists: on the lab model no single end point of the correction (token-level `tis`, per-decision
`prefix_tis`, sequence-level `seq_tis`) has the least biased gradient at every training state, and the weight
statistics that drive AIS's alpha (k3 KL, ESS) hardly move between states where the answer changes
(docs/ais.md section 5, benchmarks/gradient_bias.py). The bias is a property of the gradient, so a run can buy a
measurement of it: at a calibration step it samples the step's prompts a second time, from the full-precision
trainer and with the same sampling seeds (coupled sampling: the two batches share most tokens, so their gradients'
difference is far less noisy than either), and keeps the candidate c minimising the mean over the last few
calibrations (`correction.calibrate_window`) of

    D_c = |g_c - g_ref|^2 / |g_ref|^2,

g_c the policy gradient of the low-precision batch under correction c, g_ref the uncorrected gradient of the
full-precision batch, both from the same loss at the same weights (aisrl.update.accumulate_gradient). E[D_c] is
(bias_c^2 + tr Cov(g_c - g_ref)) / |g_ref|^2, so an end point is charged for its noise as well as for its bias.
One batch's D is a noisy judge of that expectation; the mean over a window of calibrations is a steadier one, but
it still charges each end point its whole noise. `benchmarks/gradient_bias.py` (`calibration`) measures how well
such rules pick at fixed weights; on the lab model under MXFP4 neither one batch nor a window of eight picks better
than token TIS kept fixed, and a run that calibrates at every step does not beat TIS (docs/ais.md section 5).

Cost of one calibration: a full-precision rollout of the step's batch, its trainer log-probs, and
1 + len(candidates) forward-backward passes (the step then trains on its low-precision batch as usual).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from aisrl.correction import CORRECTIONS, CorrectionResult, correct

Gradient = Callable[[CorrectionResult], torch.Tensor]  # a correction's result -> the flat gradient it gives (P,)


def check_candidates(candidates: list[str]) -> None:
    """Raise ValueError unless `candidates` names two or more distinct corrections."""
    unknown = [c for c in candidates if c not in CORRECTIONS]
    if unknown:
        raise ValueError(f"correction.candidates: unknown correction(s) {unknown}; choose from {sorted(CORRECTIONS)}")
    if len(set(candidates)) < 2:
        raise ValueError(f"correction.candidates needs two or more distinct corrections to choose from, got "
                         f"{candidates}")  # fmt: skip


def closest_end_point(
    candidates: list[str], low: Gradient, reference: torch.Tensor, old_logp, rollout_logp, mask, options,
    keep: str | None = None, past: Sequence[dict[str, float]] = (),
) -> tuple[str, dict[str, torch.Tensor]]:  # fmt: skip
    """(the candidate whose low-precision gradient is nearest `reference`, metrics).

    low(res): the gradient of the low-precision batch trained with correction result `res`; reference: (P,) the
    full-precision batch's uncorrected gradient; old_logp, rollout_logp, mask: the low-precision batch, as for
    aisrl.correction.correct; options(name): that correction's keyword options (its cap, say).
    past: the D of earlier calibrations (`calib_dist_<name>` values of their metrics); the pick minimises the mean
    of D over them and this one. A reference of norm 0 (every full-precision group had equal rewards) measures
    nothing: the pick is then `keep` (the end point in use; None = the first candidate), and this calibration adds
    nothing to the mean. Ties go to the first candidate.
    Metrics: `calib_dist_<name>` = D_c for every candidate and `calib_ref_norm` = |g_ref| (a past calibration is
    such a dict, as floats).
    """
    ref2 = reference.double().pow(2).sum()
    dist = {}
    for name in candidates:
        g = low(correct(name, old_logp, rollout_logp, mask, **options(name)))  # (P,)
        d = (g.double() - reference.double()).pow(2).sum() / ref2.clamp(min=1e-30)
        dist[name] = torch.nan_to_num(d, nan=float("inf"))  # a non-finite gradient is never the pick
    metrics = {f"calib_dist_{n}": d.float() for n, d in dist.items()}
    metrics["calib_ref_norm"] = ref2.sqrt().float()
    this = {k: v.item() for k, v in metrics.items()}
    rounds = [m for m in [*past, this] if m["calib_ref_norm"] > 0 and all(f"calib_dist_{n}" in m for n in candidates)]
    if not rounds:
        return (keep if keep in candidates else candidates[0]), metrics
    mean = {n: sum(m[f"calib_dist_{n}"] for m in rounds) / len(rounds) for n in candidates}
    return min(candidates, key=lambda n: mean[n]), metrics
