"""Each correction's weights, masks and metrics on a hand-made batch.

Two sequences: A with token ratios w = (2.5, 0.4, 1) and B with w = (4, 1.5) plus one padding slot
holding garbage. Expected values are computed here with `math` from those ratios.
"""

import math

import pytest
import torch

from aisrl.correction import CORRECTIONS, ais_weights, correct, restrict
from aisrl.diagnostics import LOG_RATIO_CLAMP

W_A, W_B = [2.5, 0.4, 1.0], [4.0, 1.5]
SEQ_W = [math.prod(W_A), math.prod(W_B)]  # [1.0, 6.0]


def k3(w):
    return w - 1 - math.log(w)


@pytest.fixture
def batch():
    roll = torch.log(torch.tensor([[0.2, 0.5, 0.3], [0.1, 0.4, 0.7]]))
    ratios = torch.tensor([W_A, W_B + [1.0]])
    old = roll + ratios.log()
    old[1, 2] = float("nan")  # padding may hold anything
    roll[1, 2] = -float("inf")
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    return old, roll, mask


def close(t, expected, atol=1e-5):
    torch.testing.assert_close(t.float(), torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=1e-5)


def test_unknown_name_lists_valid_ones(batch):
    with pytest.raises(ValueError, match=r"unknown correction 'tiss'; choose from \[.*'ais'.*'tis'"):
        correct("tiss", *batch)


def test_unknown_option_names_it(batch):
    with pytest.raises(ValueError, match=r"'tis' got unknown option\(s\) \['capp'\]"):
        correct("tis", *batch, capp=2.0)


def test_none(batch):
    res = correct("none", *batch)
    close(res.weights, [[1, 1, 1], [1, 1, 0]])
    assert torch.equal(res.mask, batch[2])


def test_tis_truncates_tokens(batch):
    res = correct("tis", *batch, cap=3.0)
    close(res.weights, [[2.5, 0.4, 1.0], [3.0, 1.5, 0.0]])
    close(res.metrics["clip_frac_token"], 1 / 5)
    close(res.metrics["clip_frac_seq"], 1 / 2)
    # the applied weights over the loss's tokens 2.5, 0.4, 1, 3, 1.5 (population std), never the padding's 0
    for key, value in (("mean", 1.68), ("std", 0.953729), ("min", 0.4), ("max", 3.0)):
        close(res.metrics[f"weight_{key}"], value)


def test_tis_two_sided(batch):
    res = correct("tis", *batch, cap=3.0, floor=0.5)
    close(res.weights, [[2.5, 0.5, 1.0], [3.0, 1.5, 0.0]])
    close(res.metrics["clip_frac_token"], 2 / 5)


def test_seq_tis(batch):
    res = correct("seq_tis", *batch, cap=3.0)
    close(res.weights, [[1, 1, 1], [3, 3, 0]])
    close(res.metrics["clip_frac_seq"], 1 / 2)


def test_prefix_tis_weights_each_token_by_its_prefix(batch):
    # A: prefixes 2.5, 2.5 * 0.4 = 1, 1 * 1 = 1; B: 4, 4 * 1.5 = 6, both capped; the padding slot stays 0
    res = correct("prefix_tis", *batch, cap=3.0)
    close(res.weights, [[2.5, 1.0, 1.0], [3.0, 3.0, 0.0]])
    close(res.metrics["clip_frac_token"], 2 / 5)
    close(correct("prefix_tis", *batch, cap=3.0, floor=1.2).weights, [[2.5, 1.2, 1.2], [3.0, 3.0, 0.0]])


def test_prefix_tis_skips_masked_tokens_and_survives_extremes():
    old = torch.tensor([[0.0, -1e3, 0.0, 0.0]])
    roll = torch.tensor([[-math.log(1.5), 0.0, -1e3, -math.log(0.5)]])
    mask = torch.tensor([[True, False, True, True]])  # the -1e3 at slot 1 is not counted
    res = correct("prefix_tis", old, roll, mask, cap=2.0)
    close(res.weights, [[1.5, 0.0, 2.0, 2.0]])  # a huge ratio is capped, never inf or NaN
    assert torch.isfinite(res.weights).all()
    tiny = correct("prefix_tis", torch.tensor([[-1e3, 0.0, 0.0]]), torch.zeros(1, 3), torch.ones(1, 3).bool())
    from aisrl.diagnostics import LOG_RATIO_CLAMP

    # the log-ratio is clamped, so the vanishing prefix is exp(-clamp) for the rest of the sequence, not NaN
    torch.testing.assert_close(tiny.weights, torch.full((1, 3), math.exp(-LOG_RATIO_CLAMP)), rtol=1e-4, atol=0)


def test_suffix_tis_weights_each_token_by_the_rest_of_its_sequence(batch):
    # A: suffixes 2.5 * 0.4 * 1 = 1, 0.4 * 1 = 0.4, 1; B: 4 * 1.5 = 6 (capped at 3), 1.5; padding stays 0
    res = correct("suffix_tis", *batch, cap=3.0)
    close(res.weights, [[1.0, 0.4, 1.0], [3.0, 1.5, 0.0]])
    close(res.metrics["clip_frac_token"], 1 / 5)
    close(correct("suffix_tis", *batch, cap=3.0, floor=0.5).weights, [[1.0, 0.5, 1.0], [3.0, 1.5, 0.0]])
    # the first token's suffix is the whole sequence, the last token's is its own ratio: seq_tis and tis there
    first, last = correct("suffix_tis", *batch, cap=10.0).weights[:, 0], correct("suffix_tis", *batch).weights[0, 2]
    close(first, SEQ_W)
    close(last, W_A[2])


def test_suffix_tis_skips_masked_tokens_and_survives_extremes():
    old = torch.tensor([[0.0, -1e3, 0.0, 0.0]])
    roll = torch.tensor([[-math.log(1.5), 0.0, math.log(4.0), -1e3]])
    mask = torch.tensor([[True, False, True, True]])  # the -1e3 at slot 1 is not counted
    res = correct("suffix_tis", old, roll, mask, cap=2.0)
    # slot 3's ratio is huge (capped at 2); slot 2's suffix is 0.25 * huge, capped too; slot 0 likewise
    close(res.weights, [[2.0, 0.0, 2.0, 2.0]])
    assert torch.isfinite(res.weights).all()


def test_geo_tis(batch):
    g = math.sqrt(6.0)
    close(correct("geo_tis", *batch, cap=3.0).weights, [[1, 1, 1], [g, g, 0]])
    close(correct("geo_tis", *batch, cap=2.0).weights, [[1, 1, 1], [2, 2, 0]])


def test_icepop_band(batch):
    res = correct("icepop", *batch, low=0.3, high=3.0)
    assert res.mask.tolist() == [[True, True, True], [False, True, False]]
    close(res.weights, [[2.5, 0.4, 1.0], [0.0, 1.5, 0.0]])
    close(res.metrics["mask_frac_token"], 1 / 5)
    close(res.metrics["mask_frac_seq"], 0.0)
    for key, value in (("mean", 1.35), ("std", 0.769740), ("min", 0.4), ("max", 2.5)):  # over the kept 2.5, 0.4, 1, 1.5
        close(res.metrics[f"weight_{key}"], value)


def test_seq_and_geo_masks(batch):
    for name, opts in [("seq_mask", {"low": 0.5, "high": 2.0}), ("geo_mask", {})]:
        res = correct(name, *batch, **opts)
        assert res.mask.tolist() == [[True, True, True], [False, False, False]], name
        close(res.weights, [[1, 1, 1], [0, 0, 0]])
        close(res.metrics["mask_frac_seq"], 1 / 2)
        close(res.metrics["mask_frac_token"], 2 / 5)


@pytest.mark.parametrize(
    "level,threshold,keep",
    [
        ("token", 0.35, [[False, True, True], [False, True, False]]),  # k3: .584 .316 0 | 1.614 .095
        ("seq_mean", 0.35, [[True, True, True], [False, False, False]]),  # means .300 | .854
        ("seq_max", 0.6, [[True, True, True], [False, False, False]]),  # maxima .584 | 1.614
        ("seq_max", 0.5, [[False, False, False], [False, False, False]]),
        ("seq_sum", 1.0, [[True, True, True], [False, False, False]]),  # sums .900 | 1.708
    ],
)
def test_k3_reject_levels(batch, level, threshold, keep):
    assert sum(k3(w) for w in W_A) / 3 == pytest.approx(0.29998, abs=1e-4)  # the hand values above
    res = correct("k3_reject", *batch, level=level, threshold=threshold)
    assert res.mask.tolist() == keep


def test_k1_k2_reject(batch):
    # k1 per token = -log w; seq means: A = 0, B = -(log 4 + log 1.5)/2 = -0.896
    assert correct("k1_reject", *batch, threshold=0.5).mask.tolist() == [[True] * 3, [False] * 3]
    # k2 = (log w)^2 / 2: A0 .420, A1 .420, A2 0, B0 .961, B1 .082
    res = correct("k2_reject", *batch, level="token", threshold=0.5)
    assert res.mask.tolist() == [[True, True, True], [False, True, False]]


def test_veto_drops_sequence_with_tiny_ratio(batch):
    res = correct("veto", *batch, threshold=0.45)
    assert res.mask.tolist() == [[False, False, False], [True, True, False]]


def test_veto_option_wraps_any_correction(batch):
    # sequence A holds w = 0.4 < 0.45: vetoed; B (4.0, 1.5) is kept with its TIS weights (cap 3)
    res = correct("tis", *batch, cap=3.0, veto=0.45)
    assert res.mask.tolist() == [[False, False, False], [True, True, False]]
    close(res.weights, [[0.0, 0.0, 0.0], [3.0, 1.5, 0.0]])
    close(res.metrics["veto_frac_seq"], 0.5)
    close(res.metrics["mask_frac_seq"], 0.5)
    close(res.metrics["weight_mean"], 2.25)
    ais = correct("ais", *batch, cap=3.0, alpha=1.0, veto=0.45)
    assert torch.equal(ais.weights, res.weights)  # alpha 1 is TIS, with or without the veto
    kept = correct("tis", *batch, cap=3.0, veto=0.39)  # 0.4 is above the bar: nothing vetoed
    assert kept.mask.tolist() == [[True, True, True], [True, True, False]]
    close(kept.metrics["veto_frac_seq"], 0.0)
    assert "veto_frac_seq" not in correct("tis", *batch).metrics
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match=r"veto threshold is a token weight in \(0, 1\)"):
            correct("tis", *batch, veto=bad)


def test_rejection_bounds_past_the_clamp_mean_what_they_say():
    # token log-ratios -30, +25 and 0: the weights clamp them at +-20, but a band or threshold beyond e^+-20 decides on
    # the true value (before: icepop low=1e-12 kept w = e^-30 as the clamped e^-20 = 2e-9 sat above it)
    old = torch.tensor([[-31.0, -1.0, -1.0]])
    roll = torch.tensor([[-1.0, -26.0, -1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    cases = [
        ("icepop", {"low": 1e-12, "high": 1e12}, [False, True, True]),  # e^-27.6 > e^-30; e^25 < e^27.6
        ("icepop", {"low": 1e-12, "high": 1e10}, [False, False, True]),  # e^25 > e^23.0
        ("icepop", {"low": 1e-14, "high": 1e11}, [True, True, True]),  # e^-32.2 < e^-30; e^25 < e^25.3
        ("k1_reject", {"level": "token", "threshold": 27.0}, [False, True, True]),  # |k1| 30 and 25
        ("k2_reject", {"level": "token", "threshold": 400.0}, [False, True, True]),  # k2 450 and 312.5
    ]
    for name, opts, kept in cases:
        assert correct(name, old, roll, mask, **opts).mask[0].tolist() == kept, (name, opts)
    # sequences: the -30 token alone, then with the +25 one (sum -5)
    for cols, low, kept in [([0], math.exp(-29), False), ([0], math.exp(-31), True), ([0, 1], math.exp(-6), True)]:
        res = correct("seq_mask", old[:, cols], roll[:, cols], mask[:, cols], low=low, high=1e12)
        assert res.mask[0].tolist() == [kept] * len(cols), (cols, low)  # the clamped sum 0 of [0, 1] passes too
    res = correct("geo_mask", old[:, :2], roll[:, :2], mask[:, :2], low=math.exp(-2.4), high=1.0)
    assert res.mask[0].tolist() == [False, False]  # mean (-30 + 25) / 2 = -2.5 < -2.4 (the clamped mean is 0)
    res = correct("geo_mask", old[:, :2], roll[:, :2], mask[:, :2], low=math.exp(-2.6), high=1.0)
    assert res.mask[0].tolist() == [True, True]


def test_ais_fixed_alpha_interpolates(batch):
    res = correct("ais", *batch, cap=3.0, alpha=0.5)
    close(res.weights, [[1.75, 0.7, 1.0], [2.0, 1.25, 0.0]])
    close(res.metrics["alpha"], 0.5)
    # a floor lifts the small weights before the mix (0.4 -> 0.5), and Gamma is of the floored, capped weights
    res = correct("ais", *batch, cap=3.0, floor=0.5, alpha=0.5)
    close(res.weights, [[1.75, 0.75, 1.0], [2.0, 1.25, 0.0]])
    wbar = torch.tensor([2.5, 0.5, 1.0, 3.0, 1.5], dtype=torch.float64)
    close(res.metrics["variance_amplification"], ((wbar**2).mean() / wbar.mean() ** 2).item())  # 1.29758


def test_ais_ema_uses_previous_alpha(batch):
    batch_alpha = correct("ais", *batch).metrics["alpha"]
    res = correct("ais", *batch, ema=0.75, prev_alpha=0.2)
    close(res.metrics["alpha"], 0.75 * 0.2 + 0.25 * batch_alpha.item())
    close(res.metrics["alpha_batch"], batch_alpha.item())
    a = 0.75 * 0.2 + 0.25 * batch_alpha.item()  # the weights are drawn with the smoothed alpha, not the batch's
    close(res.weights, [[1 + a, 1 - 0.6 * a, 1.0], [1 + a, 1 + 0.5 * a, 0.0]])  # 1 + a (min(w, 2) - 1)
    with pytest.raises(ValueError, match="prev_alpha .* only matters for the ema: pass ema > 0"):
        correct("ais", *batch, prev_alpha=0.2)  # would silently do nothing


def test_ais_weights_house_style(batch):
    w, metrics = ais_weights(*batch, cap=2.0)
    assert torch.equal(w, correct("ais", *batch, cap=2.0).weights)
    assert {"alpha", "weight_reliability", "divergence_severity", "variance_amplification"} <= set(metrics)


def test_normalize_divides_by_batch_mean(batch):
    res = correct("tis", *batch, cap=3.0, normalize=True)
    mean = (2.5 + 0.4 + 1 + 3 + 1.5) / 5
    close(res.weights, [[2.5 / mean, 0.4 / mean, 1 / mean], [3 / mean, 1.5 / mean, 0]])


def test_metrics_only_applies_nothing(batch):
    applied = correct("icepop", *batch, low=0.3, high=3.0)
    res = correct("icepop", *batch, low=0.3, high=3.0, metrics_only=True)
    assert torch.equal(res.mask, batch[2])
    close(res.weights, [[1, 1, 1], [1, 1, 0]])
    assert res.metrics["mask_frac_token"] == applied.metrics["mask_frac_token"]


def test_mismatch_metrics_by_hand(batch):
    m = correct("none", *batch).metrics
    ws = W_A + W_B
    logs = [math.log(w) for w in ws]
    close(m["kl"], -sum(logs) / 5)
    close(m["k3_kl"], sum(k3(w) for w in ws) / 5)
    close(m["chi2_token"], sum(w * w for w in ws) / 5 - 1)
    close(m["chi2_seq"], sum(w * w for w in SEQ_W) / 2 - 1)
    close(m["ess"], sum(SEQ_W) ** 2 / (2 * sum(w * w for w in SEQ_W)))
    close(m["logprob_abs_diff_mean"], sum(map(abs, logs)) / 5)
    close(m["logprob_abs_diff_max"], math.log(4))
    close(m["token_prob_mult_error"], math.exp(sum(map(abs, logs)) / 5))
    close(m["ratio_frac_above_2"], 2 / 5)
    close(m["ratio_frac_below_half"], 1 / 5)
    close(m["is_weight_max"], 4.0)
    close(m["is_weight_min"], 0.4)
    close(m["is_weight_mean"], sum(ws) / 5)
    close(m["is_weight_std"], math.sqrt(sum(w * w for w in ws) / 5 - (sum(ws) / 5) ** 2))
    old, roll, mask = batch
    nll_t, nll_r = -old[mask].mean().item(), -roll[mask].mean().item()
    close(m["training_ppl"], math.exp(nll_t))
    close(m["rollout_ppl"], math.exp(nll_r))
    close(m["ppl_ratio"], math.exp(nll_t - nll_r))
    close(m["ppl_ratio"], math.exp(m["kl"].item()))  # identity: ppl ratio = exp(k1)
    close(m["ppl_diff"], math.exp(nll_t) - math.exp(nll_r), atol=1e-4)


def test_every_correction_reports_the_full_metric_set(batch):
    required = {
        "ess", "kl", "k3_kl", "chi2_token", "chi2_seq", "training_ppl", "rollout_ppl", "ppl_diff",
        "ppl_ratio", "logprob_abs_diff_mean", "logprob_abs_diff_max", "token_prob_mult_error",
        "clip_frac_token", "clip_frac_seq", "mask_frac_token", "mask_frac_seq", "ratio_frac_above_2",
        "ratio_frac_below_half", "is_weight_mean", "is_weight_std", "is_weight_min", "is_weight_max",
        "weight_mean", "weight_std", "weight_min", "weight_max",
    }  # fmt: skip
    trio = {"weight_reliability", "divergence_severity", "variance_amplification", "alpha_batch"}
    ais = correct("ais", *batch).metrics
    for name in CORRECTIONS:
        res = correct(name, *batch)
        assert required | trio <= set(res.metrics), (name, required | trio - set(res.metrics))
        assert ("alpha" in res.metrics) == (name == "ais")  # the applied coefficient belongs to AIS alone
        for k in trio:  # what AIS would see and choose: the same whatever corrects the batch (at the same cap)
            assert res.metrics[k] == ais[k], (name, k)
        for k, v in res.metrics.items():
            assert v.dim() == 0 and not v.requires_grad and torch.isfinite(v), (name, k)


def test_nan_at_counted_position_is_dropped_not_propagated(batch):
    old, roll, mask = batch
    old = old.clone()
    old[0, 1] = float("nan")
    res = correct("tis", old, roll, mask, cap=3.0)
    assert not res.mask[0, 1] and res.mask[0, 0]
    close(res.metrics["nonfinite_frac"], 1 / 5)
    assert all(torch.isfinite(v) for v in res.metrics.values())


@pytest.mark.parametrize("bad", [{"cap": -1.0}, {"cap": 2.0, "floor": 3.0}])
def test_bad_cap_is_a_clear_error(batch, bad):
    with pytest.raises(ValueError, match=r"need cap > 0 and 0 <= floor <= cap, got cap="):
        correct("tis", *batch, **bad)


@pytest.mark.parametrize("name", ["seq_tis", "prefix_tis", "suffix_tis"])
def test_an_unbounded_cap_keeps_product_weights_finite(name):
    # a sequence log-weight of 8 x 12 = 96 overflows FP32's exp (past 88.7); cap=inf asks for untruncated products
    old, roll = torch.zeros(2, 8), torch.full((2, 8), -12.0)
    roll[1] = 0.0
    res = correct(name, old, roll, torch.ones(2, 8, dtype=torch.bool), cap=float("inf"))
    assert torch.isfinite(res.weights).all() and all(torch.isfinite(v).all() for v in res.metrics.values())
    assert res.weights.max().item() == pytest.approx(math.exp(80.0), rel=1e-5)  # held at exp(EXP_CLAMP)
    assert res.weights[1].tolist() == [1.0] * 8  # an exact sequence is untouched
    small = correct(name, old, old - 0.1, torch.ones(2, 8, dtype=torch.bool), cap=float("inf"))
    assert small.weights[0, 0].item() == pytest.approx(math.exp(0.1 if name == "prefix_tis" else 0.8), rel=1e-5)


def test_bad_shapes_and_levels(batch):
    old, roll, mask = batch
    with pytest.raises(ValueError, match=r"share one \(N, T\) shape"):
        correct("tis", old, roll[:, :2], mask)
    with pytest.raises(ValueError, match=r"must have shape \(N, T\)"):
        correct("tis", old[0], roll[0], mask[0])
    with pytest.raises(ValueError, match="unknown level 'seq' for k3_reject"):
        correct("k3_reject", *batch, level="seq")
    with pytest.raises(ValueError, match="band"):
        correct("icepop", *batch, low=2.0, high=1.0)


def test_trainer_minus_inf_logp_drops_the_token(batch):
    old, roll, mask = batch
    old = old.clone()
    old[1, 0] = -float("inf")  # the trainer gives the sampled token no probability
    res = correct("ais", old, roll, mask)
    assert not res.mask[1, 0] and res.mask[1, 1]
    close(res.metrics["nonfinite_frac"], 1 / 5)


def test_zero_probability_token_is_w_zero_in_every_product():
    # The trainer gives the second token of sequence 0 no probability (outside its top-p nucleus): w = 0 there. It
    # leaves the loss, but the sequence's weight, the prefix / suffix products, ESS and the rejection rules see it.
    inf = float("inf")
    old = torch.tensor([[-1.0, -inf, -1.0], [-1.0, -1.0, -1.0]])
    roll = torch.tensor([[-1.0, -0.1, -1.0], [-1.0, -1.0, -1.0]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    tiny = math.exp(-LOG_RATIO_CLAMP)  # the clamped w = 0
    expected = {
        "tis": [1.0, 0.0, 1.0],
        "seq_tis": [tiny, 0.0, tiny],
        "prefix_tis": [1.0, 0.0, tiny],
        "suffix_tis": [tiny, 0.0, 1.0],
    }
    for name, row in expected.items():
        res = correct(name, old, roll, mask)
        assert res.mask[0].tolist() == [True, False, True], name
        assert torch.allclose(res.weights[0], torch.tensor(row), rtol=1e-5, atol=0), (name, res.weights[0])
        assert res.weights[1].tolist() == [1.0, 1.0, 1.0]
        close(res.metrics["ess"], 0.5)  # W = (~0, 1): (0 + 1)^2 / (2 * 1)
        close(res.metrics["zero_prob_frac"], 1 / 6)
        close(res.metrics["nonfinite_frac"], 1 / 6)
    # a sequence whose only token has probability 0 is the batch's worst, not absent (before: ESS 1, one sequence)
    alone = correct("tis", old[:, :2], roll[:, :2], torch.tensor([[False, True], [True, True]]))
    close(alone.metrics["ess"], 0.5)
    close(alone.metrics["num_seqs"], 2.0)
    close(alone.metrics["mask_frac_seq"], 0.5)  # it leaves the loss whole
    nothing = correct("ais", old[:1, 1:2].expand(2, 1), roll[:1, 1:2].expand(2, 1), torch.ones(2, 1, dtype=torch.bool))
    for key in ("ess", "chi2_seq", "weight_reliability", "alpha"):  # no scored token: nothing to rely on (not ESS 1)
        close(nothing.metrics[key], 0.0)
    close(correct("tis", old[:, :2], roll[:, :2], torch.tensor([[False, True], [True, True]]), veto=1e-3).metrics[
        "veto_frac_seq"], 0.5)  # fmt: skip
    # a veto below the clamp's e^-20 too (before: 1e-10 vetoed nothing, the clamped w = 2e-9 being above it)
    for name, opts in [("seq_mask", {}), ("veto", {"threshold": 1e-3}), ("veto", {"threshold": 1e-10}),
                       ("k3_reject", {"level": "seq_max"})]:  # fmt: skip
        res = correct(name, old, roll, mask, **opts)
        assert res.mask.tolist() == [[False] * 3, [True] * 3], name
    # Geometric means divide by the tokens the products see, the zero-probability one included: sequence 0's
    # mean log-ratio is (0 - 20 + 0) / 3, not / 2.
    geo = math.exp(-LOG_RATIO_CLAMP / 3)
    res = correct("geo_tis", old, roll, mask)
    assert torch.allclose(res.weights[0], torch.tensor([geo, 0.0, geo]), rtol=1e-5, atol=0), res.weights[0]
    # KL rules: w = 0 has KL estimate inf (k3 = 0 - 1 + inf), so any threshold rejects the sequence (before: the
    # clamped -20 gave a seq-mean k3 of ~6.33, kept under a threshold of 6.4); so does a geo band reaching 0
    for name, opts in [("k3_reject", {"level": "seq_mean", "threshold": 1e6}),
                       ("k1_reject", {"level": "seq_sum", "threshold": 1e6}),
                       ("geo_mask", {"low": 1e-30, "high": 2.0})]:  # fmt: skip
        res = correct(name, old, roll, mask, **opts)
        assert res.mask.tolist() == [[False] * 3, [True] * 3], name
    # A NaN is not a zero probability: it stays neutral (w = 1) in the products.
    res = correct("seq_tis", old.nan_to_num(nan=0.0, neginf=float("nan")), roll, mask)
    close(res.metrics["zero_prob_frac"], 0.0)
    assert res.weights[0].tolist() == [1.0, 0.0, 1.0]


def test_rollout_logp_of_plus_inf_is_unusable_not_a_tiny_weight():
    # No sampled token has a positive log-prob; +inf from the engine is corrupt, so the token leaves the loss
    # (like NaN) instead of entering it with w = exp(-20).
    old = torch.full((1, 3), -1.0)
    roll = torch.tensor([[-1.0, float("inf"), -1.0]])
    res = correct("tis", old, roll, torch.ones(1, 3, dtype=torch.bool))
    assert res.mask.tolist() == [[True, False, True]] and res.weights[0].tolist() == [1.0, 0.0, 1.0]
    close(res.metrics["nonfinite_frac"], 1 / 3)
    close(res.metrics["zero_prob_frac"], 0.0)
    # ... also where the trainer gives it -inf: a corrupt token, not a zero-probability one (before: w = 0 in the
    # products, so its whole sequence weighed e^-20)
    res = correct("seq_tis", torch.tensor([[-1.0, -float("inf"), -1.0]]), roll, torch.ones(1, 3, dtype=torch.bool))
    assert res.weights[0].tolist() == [1.0, 0.0, 1.0] and res.mask.tolist() == [[True, False, True]]
    close(res.metrics["zero_prob_frac"], 0.0)


def test_option_checks_issue_no_collective(monkeypatch):
    # under accelerate's NCCL group a collective on these CPU probes has no backend: check_options must stay local
    import aisrl.dist
    from aisrl.calibrate import check_mixable
    from aisrl.correction import check_options

    monkeypatch.setattr(aisrl.dist.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(aisrl.dist.dist, "all_reduce", lambda *a, **k: pytest.fail("a collective was issued"))
    check_options("ais", cap=2.0)
    check_mixable(["tis", "ais"], lambda name: {})
    with pytest.raises(pytest.fail.Exception):  # the patch is live: outside the checks a batch statistic reduces
        correct("tis", torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool))


def test_rejection_threshold_must_be_a_number():
    old, roll, mask = torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    for bad in (float("nan"), -0.1):
        with pytest.raises(ValueError, match="threshold must be a number >= 0"):
            correct("k3_reject", old, roll, mask, threshold=bad)


def test_restrict_recomputes_what_the_loss_keeps(batch):
    res = correct("tis", *batch, cap=3.0)
    keep = torch.ones_like(res.mask)
    keep[0] = False  # a veto of the first sequence
    out = restrict(res, keep)
    assert out.mask.tolist() == (res.mask & keep).tolist() and (out.weights[0] == 0).all()
    assert torch.equal(out.weights[1:], res.weights[1:])
    n, kept = res.mask.sum().item(), res.mask[1:].sum().item()
    close(out.metrics["mask_frac_token"], (n - kept) / n)
    close(out.metrics["mask_frac_seq"], 1 / res.mask.shape[0])
    close(out.metrics["weight_mean"], res.weights[1:][res.mask[1:]].mean().item())
    close(out.metrics["k3_kl"], res.metrics["k3_kl"].item())  # the mismatch itself is what the rollouts had
    none = restrict(res, torch.zeros_like(res.mask))
    close(none.metrics["mask_frac_token"], 1.0)
    close(none.metrics["weight_mean"], 0.0)
    # a per-sequence keep would broadcast over the columns: refused, naming the shape to give
    with pytest.raises(ValueError, match=r"keep must be an \(N, T\) mask .*per sequence: keep\[:, None\]"):
        restrict(res, keep[:, 0])
    assert torch.equal(restrict(res, keep.float()).mask, out.mask)  # a 0/1 float mask reads as one
    # a normalized result keeps its promise on the tokens left: weights averaging 1 (before: the mean of the
    # correction's own mask, here 1.16 once the first sequence left)
    normed = correct("tis", *batch, cap=3.0, normalize=True)
    kept = restrict(normed, keep, normalize=True)
    close(kept.weights[kept.mask].mean(), 1.0)
    close(kept.metrics["weight_mean"], 1.0)
    ratio = (kept.weights[1:][kept.mask[1:]] / res.weights[1:][res.mask[1:]]).tolist()
    assert max(ratio) - min(ratio) < 1e-5  # one scale for every token: the correction's weights, renormalized
    assert torch.equal(restrict(normed, torch.zeros_like(keep), normalize=True).weights, torch.zeros_like(res.weights))


def test_seq_max_rejection_of_an_empty_batch():
    empty = torch.zeros(3, 0), torch.zeros(3, 0), torch.zeros(3, 0, dtype=torch.bool)
    res = correct("k3_reject", *empty, level="seq_max")
    assert res.mask.shape == (3, 0) and all(torch.isfinite(v) for v in res.metrics.values())


@pytest.mark.parametrize(
    "opts,match",
    [
        ({"prev_alpha": float("nan"), "ema": 0.9}, "prev_alpha must be a number in"),
        ({"prev_alpha": 5.0, "ema": 0.9}, "prev_alpha must be a number in"),
        ({"alpha": 0.5, "ema": 0.9}, "either a fixed alpha or ema"),
        ({"ema": 1.0}, "ema must be in"),
    ],
)
def test_ais_smoothing_arguments_are_checked(batch, opts, match):
    with pytest.raises(ValueError, match=match):
        correct("ais", *batch, **opts)


def test_k3_rejection_is_precise_for_tiny_mismatch():
    # k3 of a log-ratio 1e-5 is 5.0e-11; FP32's exp(d) - 1 - d read it as 1.4e-8 and rejected it at threshold 1e-9
    old, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    roll = torch.tensor([[-1e-5, -1e-4]])  # k3: 5.0e-11 and 5.0e-9
    res = correct("k3_reject", old, roll, mask, threshold=1e-9, level="token")
    assert res.mask.tolist() == [[True, False]]


def test_band_with_zero_upper_bound_is_a_clear_error(batch):
    with pytest.raises(ValueError, match="high > 0"):
        correct("seq_mask", *batch, low=0.0, high=0.0)


def test_severity_is_precise_for_tiny_mismatch():
    d = 1e-4
    old = torch.full((4, 8), -2.0)
    roll = old - d * torch.tensor([1.0, -1.0]).repeat(4, 4)  # log-ratios +-1e-4
    m = correct("none", old, roll, torch.ones(4, 8, dtype=torch.bool)).metrics
    # k3 = e^d - 1 - d = d^2/2 + d^3/6 + ..., averaged over +-d: d^2/2 to 1e-8 relative
    assert m["k3_kl"].item() == pytest.approx(d * d / 2, rel=0.02)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_inputs_from_another_device_are_brought_to_the_trainers():
    old = torch.full((2, 3), -1.0, device="cuda")
    roll, mask = torch.full((2, 3), -1.2), torch.ones(2, 3, dtype=torch.bool)  # from a CPU-side rollout
    res = correct("ais", old, roll, mask)
    assert res.weights.device == old.device
    torch.testing.assert_close(res.weights.cpu(), correct("ais", old.cpu(), roll, mask).weights)  # exp's rounding


def test_a_veto_below_the_clamp_sees_the_log_ratio_before_it():
    """Log-ratios are clamped to +-20 (weights), but a veto's tiny threshold (1e-10: only the near impossible) is
    compared with the log-ratio before the clamp: old = -31, rollout = -1 (w = e^-30) was kept by veto 1e-10."""
    old, roll, mask = torch.tensor([[-31.0, -1.0]]), torch.tensor([[-1.0, -1.0]]), torch.ones(1, 2, dtype=torch.bool)
    assert not correct("veto", old, roll, mask, threshold=1e-10).mask.any()
    assert correct("veto", old, roll, mask, threshold=1e-14).mask.all()  # e^-30 = 9.4e-14 is above it
    assert not correct("tis", old, roll, mask, veto=1e-10).mask.any()  # the veto option of any correction too


def test_edge_cases_of_the_metrics_and_masks_by_hand():
    """Values worked out by hand where a plausible slip in the code would change them (found by mutation testing)."""
    from aisrl.diagnostics import k3_per_token

    ones = lambda t: torch.ones(1, t, dtype=torch.bool)  # noqa: E731
    # the severity is the k3 mean over the tokens the trainer can score: a zero-probability token adds 0, not its
    # clamped e^20-sized k3 (which made alpha ~1 here)
    r = correct("ais", torch.tensor([[0.1, -math.inf, 0.0]]), torch.zeros(1, 3), ones(3))
    assert r.metrics["divergence_severity"].item() == pytest.approx((math.exp(0.1) - 1.1) / 2, rel=1e-6)
    # k1 = -delta is compared in absolute value: a token the trainer finds likelier (k1 = -1) is rejected too
    old, roll = torch.tensor([[1.0, 0.0]]), torch.zeros(1, 2)
    assert correct("k1_reject", old, roll, ones(2), threshold=0.05, level="token").mask.tolist() == [[False, True]]
    assert correct("k1_reject", old, roll, ones(2), threshold=0.05, level="seq_max").mask.tolist() == [[False, False]]
    # the AIS view is at token TIS's cap whatever cap another correction takes: w = (e^3 -> 2, 1), Gamma = 2.5 / 1.5^2
    r = correct("seq_tis", torch.tensor([[3.0, 0.0]]), torch.zeros(1, 2), ones(2), cap=5.0)
    assert r.metrics["variance_amplification"].item() == pytest.approx(2.5 / 2.25, rel=1e-6)
    # equal weights have spread 0, not a NaN from a rounding below 0
    r = correct("tis", torch.full((1, 37), -0.025), torch.zeros(1, 37), ones(37))
    assert r.metrics["weight_std"].item() == 0.0 and r.metrics["is_weight_std"].item() == 0.0
    # a rollout log-prob of -inf is floored at -1e4 for the perplexity: exp((1e4 + 199 x 1) / 200)
    old = torch.full((1, 200), -1.0)
    roll = old.clone()
    roll[0, 0] = -math.inf
    assert correct("tis", old, roll, ones(200)).metrics["rollout_ppl"].item() == pytest.approx(
        math.exp((1e4 + 199) / 200), rel=1e-6)
    # k3 = e^d - 1 - d keeps its precision for a tiny d: d^2 / 2 + d^3 / 6
    assert k3_per_token(torch.tensor([1e-10], dtype=torch.float64)).item() == pytest.approx(5e-21, rel=1e-6)
    # a weight at the cap is not clipped (w = 1, cap 1); an empty batch has chi-square 0
    assert correct("tis", torch.zeros(1, 2), torch.zeros(1, 2), ones(2), cap=1.0).metrics["clip_frac_token"] == 0
    assert correct("tis", torch.zeros(1, 2), torch.zeros(1, 2), ~ones(2)).metrics["chi2_token"] == 0


def test_clip_fractions_count_every_valid_token_and_the_ais_flag_sees_its_floor():
    """A clipped token counts among the valid tokens, whether or not a veto drops it later (clip and mask are two
    questions: what the correction bounded, what the loss kept): worked out by hand on two sequences of two tokens."""
    old = torch.tensor([[math.log(3.0), -30.0], [0.0, 0.0]])  # w = 3 (above the cap 2), e^-30 (vetoed), 1, 1
    roll, mask = torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bool)
    m = correct("tis", old, roll, mask, cap=2.0, veto=1e-10).metrics
    assert (m["clip_frac_token"].item(), m["clip_frac_seq"].item()) == (0.25, 0.5)
    assert (m["mask_frac_token"].item(), m["mask_frac_seq"].item()) == (0.5, 0.5)
    # AIS flags a weight under its floor as clipped, as TIS does: w = 1/4 and 1 with floor 1/2
    low = torch.tensor([[math.log(0.25), 0.0]])
    for name in ("tis", "ais"):
        res = correct(name, low, torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), cap=2.0, floor=0.5)
        assert res.metrics["clip_frac_token"].item() == 0.5, name


def test_bands_and_thresholds_at_their_exact_bounds():
    """The documented inequalities hold at equality: a band [low, high] is closed, a veto drops w < v (strictly),
    a KL rejection keeps |k| <= threshold. Bounds are e^x with log(e^x) == x in float64 for x = +-0.5 and -1, and
    the rules decide on the float64 log-ratio, so a token sits exactly on a bound (found by mutation testing)."""
    assert math.log(math.exp(0.5)) == 0.5 and math.log(math.exp(-0.5)) == -0.5 and math.log(math.exp(-1.0)) == -1.0
    step = 2.0**-20  # a log-ratio step FP32 holds exactly near 0.5 and 1
    low, high = math.exp(-0.5), math.exp(0.5)
    old = torch.tensor([[-0.5, 0.5, -0.5 - step, 0.5 + step]])
    roll, ones = torch.zeros(1, 4), torch.ones(1, 4, dtype=torch.bool)
    assert correct("icepop", old, roll, ones, low=low, high=high).mask.tolist() == [[True, True, False, False]]
    # sequence bands: a log weight summing exactly to log(high) or log(low) is kept, a step past it is not
    for total, kept in ((0.5, True), (-0.5, True), (0.5 + step, False), (-0.5 - step, False)):
        one = torch.tensor([[total, 0.0]])
        got = correct("seq_mask", one, torch.zeros(1, 2), ones[:, :2], low=low, high=high).mask.tolist()
        assert got == [[kept, kept]], total
    # a veto at v = e^-1 keeps a token of w = e^-1 and drops one of w just below, as a rule and around a correction
    for lr, vetoed in ((-1.0, False), (-1.0 - step, True)):
        one = torch.tensor([[lr, 0.0]])
        assert correct("veto", one, torch.zeros(1, 2), ones[:, :2], threshold=math.exp(-1.0)).mask.tolist() == [
            [not vetoed] * 2], lr
        r = correct("tis", one, torch.zeros(1, 2), ones[:, :2], veto=math.exp(-1.0))
        assert r.metrics["veto_frac_seq"].item() == float(vetoed), lr
    # a token KL of exactly the threshold is kept: k1 = |-d| = 0.5, k2 = d^2 / 2 = 0.125 at d = -0.5
    for est, thr in (("k1", 0.5), ("k2", 0.125)):
        kept = correct(f"{est}_reject", torch.tensor([[-0.5]]), torch.zeros(1, 1), ones[:, :1], threshold=thr,
                       level="token").mask  # fmt: skip
        assert kept.tolist() == [[True]], est
