"""Choose the importance-sampling end point by its measured gradient bias, from a full-precision batch every k steps.

Why it exists: on the lab model no single end point of the correction (token-level `tis`, per-decision
`prefix_tis`, sequence-level `seq_tis`) has the least biased gradient at every training state, and the weight
statistics that drive AIS's alpha (k3 KL, ESS) hardly move between states where the answer changes
(docs/ais.md section 5, benchmarks/gradient_bias.py). The bias is a property of the gradient, so a run can buy a
measurement of it: at a calibration step it samples the step's prompts a second time, from the full-precision
trainer and with the same sampling seeds (coupled sampling: the two batches share most tokens, so their gradients'
difference is far less noisy than either), and measures for each candidate c the difference

    d_c = g_c - g_ref,    D_c = |d_c|^2 / |g_ref|^2,

g_c the policy gradient of the low-precision batch under correction c, g_ref the uncorrected gradient of the
full-precision batch, both from the same loss at the same weights (aisrl.update.accumulate_gradient). Over the last
few calibrations (`correction.calibrate_window`) a rule (RULES, `correction.calibrate_rule`) turns them into the
weights lambda of the end point trained with, sum_c lambda_c w_c (combine):
- window keeps the candidate of least mean D. E[D_c] is (bias_c^2 + tr Cov(d_c)) / |g_ref|^2: an end point is
  charged its whole noise however long the window, so the mean favours the least noisy end point, not the least
  biased;
- pooled keeps the one of least |mean d_c|^2, whose noise shrinks with the window: a bias that persists over the
  window is what adds up over the steps of a run, and what this rule sees;
- mix takes the mixture sum_c lambda_c d_c of least |mean|^2 (simplex_min), so that biases pointing different
  ways cancel.
`benchmarks/gradient_bias.py` (`calibration`) measures how well each rule picks at fixed weights, and docs/ais.md
section 5 what training with the window and pooled rules gives on the lab model under MXFP4.

Cost of one calibration: a full-precision rollout of the step's batch, its trainer log-probs, and
1 + len(candidates) forward-backward passes (the step then trains on its low-precision batch as usual); pooled and
mix keep len(candidates) x window gradient-sized vectors (window - 1 of them in each checkpoint).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from aisrl.correction import CORRECTIONS, CorrectionResult, correct
from aisrl.dist import local_only

Gradient = Callable[[CorrectionResult], torch.Tensor]  # a correction's result -> the flat gradient it gives (P,)


def simplex_min(M: torch.Tensor) -> torch.Tensor:
    """(n,) the lambda >= 0 with sum 1 minimising lambda^T M lambda, for a symmetric positive semi-definite (n, n) M.

    The minimum of a convex quadratic over the simplex is the stationary point of the face it lies inside: on the
    face of support S it solves M_S lambda_S + nu 1 = 0, 1^T lambda_S = 1 (least squares where M_S is singular, as
    when two candidates' differences cancel exactly). With few candidates every face can be tried (2^n - 1);
    the least value among the faces whose point has no negative entry is the minimum. M is first divided by its
    largest diagonal entry (the minimiser does not depend on the scale, the tolerances would). Ties go to the
    smaller face met first (single candidates first, in order).
    """
    n = M.shape[0]
    M = M.double()
    top = M.diagonal().abs().max()
    M = M / top if top > 0 else M
    best, best_val = None, float("inf")
    for size in range(1, n + 1):
        for face in itertools.combinations(range(n), size):
            idx = list(face)
            kkt = torch.ones(size + 1, size + 1, dtype=M.dtype)  # M_S lambda + nu 1 = 0, 1^T lambda = 1
            kkt[:size, :size], kkt[size, size] = M[idx][:, idx], 0.0
            rhs = torch.zeros(size + 1, dtype=M.dtype)
            rhs[size] = 1.0
            x = (torch.linalg.pinv(kkt) @ rhs)[:size]  # (size,)
            if (x < -1e-9).any() or abs(x.sum().item() - 1) > 1e-6:
                continue
            lam = torch.zeros(n, dtype=M.dtype)
            lam[idx] = x.clamp(min=0) / x.clamp(min=0).sum()
            val = (lam @ M @ lam).item()
            if best is None or val < best_val - 1e-12:
                best, best_val = lam, val
    return best if best is not None else torch.full((n,), 1.0 / n, dtype=M.dtype)


def _gram(rounds: list[dict]) -> torch.Tensor:
    """(C, C) <mean_r d_a(r), mean_r d_b(r)> over the calibrations `rounds`, d_c(r) = g_c - g_ref of calibration r
    (its "diff" row c); a candidate whose mean difference is not finite gets inf on its diagonal, 0 elsewhere."""
    mean = torch.zeros(rounds[0]["diff"].shape, dtype=torch.float64)  # (C, P), summed in place
    for r in rounds:
        mean += r["diff"]
    mean /= len(rounds)
    finite = torch.isfinite(mean).all(dim=1)  # (C,)
    mean[~finite] = 0.0
    M = mean @ mean.T  # (C, C)
    M.diagonal()[~finite] = float("inf")
    return M


def pooled_gram(rounds: list[dict]) -> torch.Tensor:
    """(C, C) _gram of `rounds` in the pooled distances' units, mean_r |g_ref(r)|^2: what `calib_pooled_<name>` and
    the pooling rules read."""
    return _gram(rounds) / (sum(r["calib_ref_norm"] ** 2 for r in rounds) / len(rounds))


def pooled_noise(rounds: list[dict], names: list[str], gram: torch.Tensor) -> torch.Tensor | None:
    """(C,) the part of each pooled distance that is noise: tr Cov_r(d_c(r)) / n over the n calibrations `rounds`, in
    the pooled distances' units (mean_r |g_ref(r)|^2); gram: their (C, C) matrix (_gram over that mean). E|mean d|^2
    = |E d|^2 + tr Cov(d) / n, so calib_pooled - calib_noise estimates without bias the bias^2 that persists; when
    the candidates' differences in it are within a few standard errors of the noise, the pick is the noise's.
    tr Cov = (sum_r |d_c(r)|^2 - n |mean d_c|^2) / (n - 1), with |d_c(r)|^2 = D_c(r) |g_ref(r)|^2 from the records.
    None with fewer than two calibrations; inf for a candidate whose gradient was not finite in one of them."""
    n = len(rounds)
    if n < 2:
        return None
    ref2 = torch.tensor([r["calib_ref_norm"] ** 2 for r in rounds], dtype=torch.float64)  # (n,)
    dist = torch.tensor([[r[f"calib_dist_{c}"] for c in names] for r in rounds], dtype=torch.float64)  # (n, C)
    total = (dist * ref2[:, None]).sum(0) / ref2.mean()  # (C,) sum_r |d_c(r)|^2 in the pooled units
    noise = ((total - n * gram.diagonal()) / (n * (n - 1))).clamp(min=0.0)  # (C,) a trace: >= 0 but for rounding
    return torch.where(torch.isfinite(total) & torch.isfinite(gram.diagonal()), noise, float("inf"))  # not inf - inf


def _least(x: torch.Tensor) -> torch.Tensor | None:
    """One-hot (C,) at the least finite entry of x (the first on ties); None if none is finite."""
    if not torch.isfinite(x).any():
        return None
    return torch.eye(len(x), dtype=torch.float64)[int(torch.nan_to_num(x, nan=float("inf")).argmin())]


def _mix(M: torch.Tensor) -> torch.Tensor | None:
    finite = torch.isfinite(M.diagonal()).nonzero().flatten().tolist()
    if not finite:
        return None
    lam = torch.zeros(M.shape[0], dtype=torch.float64)
    lam[finite] = simplex_min(M[finite][:, finite])
    return lam


RULES: dict[str, Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor | None]] = {
    "window": lambda dist, gram: _least(dist),
    "pooled": lambda dist, gram: _least(gram.diagonal()),
    "mix": lambda dist, gram: _mix(gram),
}
"""How the calibrations of the window give the end point's weights lambda (C,) over the candidates, from the mean
distances (C,) and, for the pooling rules, the Gram matrix (C, C) of the mean differences (None: nothing finite):
- window: the one candidate of least mean_r D_c(r), D = |d_c|^2 / |g_ref|^2: each calibration's distance, charged
  with its whole noise;
- pooled: the one of least |mean_r d_c(r)|^2: the differences themselves are averaged first, so their noise shrinks
  with the window while a bias that persists over the window stays (what adds up over the steps of a run);
- mix: the mixture sum_c lambda_c g_c (lambda >= 0, sum 1) of least |mean_r sum_c lambda_c d_c(r)|^2
  (simplex_min): end points whose biases point different ways partly cancel.
The pooling rules keep each calibration's (C, P) differences (C the candidates, P the parameters) over the window."""
POOLING = ("pooled", "mix")


def check_candidates(candidates: list[str]) -> None:
    """Raise ValueError unless `candidates` names two or more distinct corrections."""
    unknown = [c for c in candidates if c not in CORRECTIONS]
    if unknown:
        raise ValueError(f"correction.candidates: unknown correction(s) {unknown}; choose from {sorted(CORRECTIONS)}")
    if len(set(candidates)) < 2:
        raise ValueError(f"correction.candidates needs two or more distinct corrections to choose from, got "
                         f"{candidates}")  # fmt: skip


def check_mixable(candidates: list[str], options: Callable[[str], dict]) -> None:
    """Raise ValueError unless every candidate reweights every token (the mix rule's condition): a mixture of token
    weights is the same mixture of gradients only where the candidates keep the same tokens, since the loss divides
    by the number kept. options(name): that correction's keyword options. The probe is a batch with log-ratios from
    -40 to 40 in one sequence, of which a token-rejecting correction drops some (however wide its band: a veto at
    w < 1e-4 drops a log-ratio below -9.2), and sequences of log-ratio +3 and -3 throughout, which a
    sequence-rejecting one (seq_mask, geo_mask, k1_reject) drops."""
    old = torch.stack([torch.linspace(-40, 40, 161), torch.full((161,), 3.0), torch.full((161,), -3.0)])  # (3, 161)
    mask = torch.ones(3, 161, dtype=torch.bool)
    with local_only():  # a probe of this process's: no collective
        rejecting = [c for c in candidates if not correct(c, old, torch.zeros_like(old), mask, **options(c)).mask.all()]
    if rejecting:
        raise ValueError(f"correction.calibrate_rule=mix mixes token weights, which needs corrections that keep every "
                         f"token; {rejecting} reject tokens: drop them from correction.candidates or use "
                         f"calibrate_rule=pooled")  # fmt: skip


def measured(record: dict) -> bool:
    """Whether a calibration's record measured anything: a reference gradient of norm 0 (every full-precision group
    had equal rewards) or not finite (it overflowed) does not, and such a record neither enters the mean of a window
    nor takes one of its places."""
    return 0 < record["calib_ref_norm"] < float("inf")


def end_point_weights(
    candidates: list[str], low: Gradient, reference: torch.Tensor, old_logp, rollout_logp, mask, options, *,
    rule: str = "window", keep: dict[str, float] | None = None, past: Sequence[dict] = (),
) -> tuple[dict[str, float], dict[str, torch.Tensor], dict]:  # fmt: skip
    """(weights {candidate: lambda}, metrics, record): the end point to train with, from this calibration and the
    earlier ones (`past`, their records).

    low(res): the gradient of the low-precision batch trained with correction result `res`; reference: (P,) the
    full-precision batch's uncorrected gradient; old_logp, rollout_logp, mask: the low-precision batch, as for
    aisrl.correction.correct; options(name): that correction's keyword options (its cap, say); rule: a name in RULES.
    A reference of norm 0 or not finite (every full-precision group had equal rewards, or it overflowed) measures
    nothing: such a calibration is left out. With nothing measured, or no candidate finite, the weights are `keep`
    (the end point in use; None = the first candidate). Ties go to the first candidate.
    Metrics: `calib_dist_<name>` = D_c for every candidate, `calib_ref_norm` = |g_ref|, and for pooled and mix
    `calib_pooled_<name>` = |mean_r d_c(r)|^2 / mean_r |g_ref(r)|^2 over the window, and from two calibrations on
    `calib_noise_<name>`, the part of it that is noise (pooled_noise). The record (what `past` holds)
    is the first two as floats, and for pooled and mix the differences, "diff": (C, P), with the candidates' names
    in their order, "names" (a branch may reorder or change them: earlier rows are read by name).
    """
    if rule not in RULES:
        raise ValueError(f"unknown calibration rule {rule!r}; choose from {sorted(RULES)}")
    ref2 = reference.double().pow(2).sum()
    dist, diffs = {}, []
    for name in candidates:
        d = low(correct(name, old_logp, rollout_logp, mask, **options(name))).double() - reference.double()  # (P,)
        dist[name] = torch.nan_to_num(d.pow(2).sum() / ref2.clamp(min=1e-30), nan=float("inf"))  # NaN never picked
        diffs.append(d.float().cpu())  # a window of them stays in host memory, whatever device low() ran on
    metrics = {f"calib_dist_{n}": d.float() for n, d in dist.items()}
    metrics["calib_ref_norm"] = ref2.sqrt().float()
    record = {k: v.item() for k, v in metrics.items()}
    if rule in POOLING:
        record["diff"], record["names"] = torch.stack(diffs), list(candidates)  # (C, P), its rows' names
    rounds = [r for r in [*past, record] if measured(r) and all(f"calib_dist_{n}" in r for n in candidates)]
    if rule in POOLING:
        width = record["diff"].shape[1]
        rounds = [a for a in (_in_order(r, candidates, width) for r in rounds) if a is not None]
    lam, gram = None, None
    if rounds:
        mean = torch.tensor([sum(r[f"calib_dist_{n}"] for r in rounds) / len(rounds) for n in candidates],
                            dtype=torch.float64)  # (C,)  # fmt: skip
        if rule in POOLING:
            gram = pooled_gram(rounds)  # (C, C)
            metrics.update({f"calib_pooled_{n}": gram[i, i].float() for i, n in enumerate(candidates)})
            noise = pooled_noise(rounds, candidates, gram)
            if noise is not None:
                metrics.update({f"calib_noise_{n}": noise[i].float() for i, n in enumerate(candidates)})
        lam = RULES[rule](mean, gram)  # (C,) or None
    if lam is None:
        kept = {n: w for n, w in (keep or {}).items() if n in candidates and w > 0}
        total = sum(kept.values())
        return ({n: w / total for n, w in kept.items()} or {candidates[0]: 1.0}), metrics, record
    return {n: lam[i].item() for i, n in enumerate(candidates) if lam[i] > 0}, metrics, record


def _in_order(record: dict, candidates: list[str], width: int) -> dict | None:
    """`record` with its "diff" rows in the order of `candidates`, or None when it has no row for one of them or its
    gradients have another size. A record without "names" (made before they were stored) is in that order."""
    names = record.get("names", candidates)
    diff = record.get("diff")
    if diff is None or diff.shape[1] != width or diff.shape[0] != len(names) or not set(candidates) <= set(names):
        return None
    return record if names == candidates else {**record, "diff": diff[[names.index(n) for n in candidates]]}


def combine(results: dict[str, CorrectionResult], weights: dict[str, float]) -> CorrectionResult:
    """The correction whose token weights are sum_c lambda_c w_c; its mask is the union of theirs and its metrics are
    those of the candidate of largest lambda. Where the candidates keep the same tokens (check_mixable makes sure
    for the mix rule) the loss is linear in the weights, so its gradient is the same mixture of theirs. One result
    is returned as it is."""
    if len(results) == 1:
        return next(iter(results.values()))
    main = max(results, key=lambda n: weights[n])
    w = sum(weights[n] * r.weights for n, r in results.items())  # (N, T)
    mask = torch.stack([r.mask for r in results.values()]).any(dim=0)  # (N, T)
    return CorrectionResult(w, mask, dict(results[main].metrics))
