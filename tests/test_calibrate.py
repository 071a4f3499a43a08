"""Calibrated end point: the pick is the gradient nearest the full-precision one, and the trainer calibrates on
schedule, logs what it measured, trains with the pick and resumes with it."""

import json
import math

import pytest
import torch
from conftest import TINY_LAB, load_benchmark, varying_reward

from aisrl.calibrate import (
    _gram,
    check_candidates,
    check_mixable,
    combine,
    end_point_weights,
    pooled_noise,
    simplex_min,
)
from aisrl.checkpoint import latest_checkpoint
from aisrl.correction import correct
from aisrl.train_checks import validate
from aisrl.train_config import load_config
from aisrl.trainer import train


def closest_end_point(candidates, low, ref, old, roll, mask, options, keep=None, past=()):
    """The window rule's pick, a name, and the metrics."""
    w, m, _ = end_point_weights(candidates, low, ref, old, roll, mask, options, keep=keep and {keep: 1.0}, past=past)
    assert list(w.values()) == [1.0]
    return next(iter(w)), m


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AISRL_CACHE", str(tmp_path / "cache"))


def test_the_pick_is_the_candidate_whose_gradient_is_nearest_the_reference():
    # low-precision batch: token log-ratios 0.5 and -1.0 on two tokens of one sequence
    old = torch.tensor([[0.0, -1.0]])
    roll = torch.tensor([[-0.5, 0.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)

    def low(res):  # a "gradient" that is the correction's weights themselves
        return res.weights[0]

    # token weights w = (e^0.5, e^-1); tis (cap 2) = (1.6487, 0.3679); seq_tis: W = e^-0.5 = 0.6065 on both tokens;
    # prefix_tis: (e^0.5, e^-0.5) = (1.6487, 0.6065)
    ref = torch.tensor([1.6, 0.6])
    pick, m = closest_end_point(["tis", "seq_tis", "prefix_tis"], low, ref, old, roll, mask, lambda n: {"cap": 2.0})
    assert pick == "prefix_tis"
    e = torch.tensor([0.5, -1.0]).exp()
    ref2 = 1.6**2 + 0.6**2
    assert m["calib_dist_tis"].item() == pytest.approx(((e[0] - 1.6) ** 2 + (e[1] - 0.6) ** 2).item() / ref2, rel=1e-5)
    assert m["calib_dist_seq_tis"].item() == pytest.approx(((0.6065 - 1.6) ** 2 + 0.0065**2) / ref2, rel=1e-3)
    assert m["calib_ref_norm"].item() == pytest.approx(ref2**0.5)
    # the options reach each candidate: near (1.0, 0.37) tis wins at cap 1 (1, 0.3679), seq_tis at cap 2
    near = torch.tensor([1.0, 0.37])
    for cap, want in [(1.0, "tis"), (2.0, "seq_tis")]:
        assert closest_end_point(["tis", "seq_tis"], low, near, old, roll, mask, lambda n, c=cap: {"cap": c})[0] == want
    # a non-finite gradient is never picked; a zero reference measures nothing and keeps the end point in use
    def nan_for_token_weights(res):  # tis's two weights differ, seq_tis's are equal
        w = res.weights[0]
        return w * float("nan") if w[0] != w[1] else w

    pick, m = closest_end_point(["tis", "seq_tis"], nan_for_token_weights, ref, old, roll, mask, lambda n: {})
    assert m["calib_dist_tis"].item() == float("inf") and pick == "seq_tis"
    # a kept mixture of which a candidate left (a branch with fewer candidates) is renormalised: weights sum to 1
    w, _, _ = end_point_weights(["tis", "prefix_tis"], low, torch.zeros(2), old, roll, mask, lambda n: {},
                                keep={"tis": 0.3, "prefix_tis": 0.3, "seq_tis": 0.4})  # fmt: skip
    assert w == pytest.approx({"tis": 0.5, "prefix_tis": 0.5})
    # (seq_tis's weights are the smaller, so a zero reference measured anyway would pick it: keep tis to tell)
    for keep, want in (("tis", "tis"), ("seq_tis", "seq_tis"), (None, "tis")):  # None: the first candidate
        pick, _ = closest_end_point(["tis", "seq_tis"], low, torch.zeros(2), old, roll, mask, lambda n: {}, keep=keep)
        assert pick == want, keep


def test_the_pick_averages_the_distances_of_past_calibrations():
    old, roll, mask = torch.tensor([[0.0, -1.0]]), torch.tensor([[-0.5, 0.0]]), torch.ones(1, 2, dtype=torch.bool)
    ref = torch.tensor([1.6, 0.6])  # alone, prefix_tis (1.6487, 0.6065) is nearest: D = 0.0009, tis 0.0197
    pick, m = closest_end_point(["tis", "prefix_tis"], lambda res: res.weights[0], ref, old, roll, mask, lambda n: {})
    assert pick == "prefix_tis"
    d_tis, d_prefix = m["calib_dist_tis"].item(), m["calib_dist_prefix_tis"].item()
    past = [{"calib_dist_tis": 0.0, "calib_dist_prefix_tis": 0.05, "calib_ref_norm": 1.0}]
    pick, _ = closest_end_point(["tis", "prefix_tis"], lambda res: res.weights[0], ref, old, roll, mask, lambda n: {},
                                past=past)  # fmt: skip
    assert (d_tis + 0.0) / 2 < (d_prefix + 0.05) / 2 and pick == "tis"
    # a past calibration whose reference was 0 measured nothing and is left out of the mean
    zero = [{"calib_dist_tis": 0.0, "calib_dist_prefix_tis": 1e30, "calib_ref_norm": 0.0}]
    pick, _ = closest_end_point(["tis", "prefix_tis"], lambda res: res.weights[0], ref, old, roll, mask, lambda n: {},
                                past=zero)  # fmt: skip
    assert pick == "prefix_tis"


def test_simplex_min_matches_a_grid_search_over_the_simplex():
    # diagonal M: lambda proportional to 1 / M_ii, value 1 / sum(1 / M_ii)
    lam = simplex_min(torch.diag(torch.tensor([1.0, 4.0, 9.0])))
    inv = torch.tensor([1.0, 1 / 4, 1 / 9], dtype=torch.float64)
    assert torch.allclose(lam, inv / inv.sum())
    # two end points whose differences point the same way: the least one alone, an edge of the simplex
    d = torch.tensor([[1.0, 0.0], [2.0, 0.0], [3.0, 1.0]])
    assert simplex_min(d @ d.T).tolist() == [1.0, 0.0, 0.0]
    # opposite biases cancel: (1, 0) and (-1, 0) half and half, the third unused
    d = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0]])
    assert torch.allclose(simplex_min(d @ d.T), torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64))
    # the minimiser does not depend on the scale of M: gradients' squared norms can be 1e-14 and less
    assert torch.allclose(simplex_min(d @ d.T * 1e-15), torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64))
    assert torch.allclose(simplex_min(torch.diag(torch.tensor([1.0, 4.0, 9.0], dtype=torch.float64)) * 1e-20),
                          inv / inv.sum())  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    grid = torch.tensor([(i / 60, j / 60, 1 - (i + j) / 60) for i in range(61) for j in range(61 - i)],
                        dtype=torch.float64)  # (1891, 3)  # fmt: skip
    for _ in range(5):
        d = torch.randn(3, 4, generator=gen, dtype=torch.float64) + torch.randn(4, generator=gen, dtype=torch.float64)
        M = d @ d.T
        lam = simplex_min(M)
        assert lam.min() >= 0 and lam.sum().item() == pytest.approx(1.0)
        assert lam @ M @ lam <= ((grid @ M) * grid).sum(1).min() + 1e-12  # at least as low as the best grid point


def test_pooled_noise_is_the_noise_part_of_the_pooled_distance():
    # two calibrations, |g_ref|^2 = 1 and 4: d_a = (1, 0) then (3, 0), d_b = (0, 1) then (0, -1); pooled units 2.5
    rounds = [{"calib_dist_a": 1.0, "calib_dist_b": 1.0, "calib_ref_norm": 1.0,
               "diff": torch.tensor([[1.0, 0.0], [0.0, 1.0]])},
              {"calib_dist_a": 9.0 / 4, "calib_dist_b": 1.0 / 4, "calib_ref_norm": 2.0,
               "diff": torch.tensor([[3.0, 0.0], [0.0, -1.0]])}]  # fmt: skip
    gram = _gram(rounds) / 2.5
    assert gram.diagonal().tolist() == pytest.approx([4 / 2.5, 0.0])
    # tr Cov over the two: |d - mean|^2 is 1 + 1 for each; / (n - 1) / n / 2.5 = 0.4
    assert pooled_noise(rounds, ["a", "b"], gram).tolist() == pytest.approx([0.4, 0.4])
    assert pooled_noise(rounds[:1], ["a", "b"], gram) is None
    # the same difference in every calibration has no noise: rounding of the records leaves +-1e-8, never below 0
    for seed in range(10):  # (before: 5 of these 10 were negative)
        d = torch.rand(1000, generator=torch.Generator().manual_seed(seed)) * 0.1
        same = [{"calib_dist_a": float((d * d).sum() / 7.3), "calib_ref_norm": 7.3**0.5, "diff": d[None]}] * 4
        assert 0 <= pooled_noise(same, ["a"], _gram(same) / 7.3).item() < 1e-7
    # a candidate whose gradient overflowed in one calibration: its noise is inf, as its distance is, not NaN
    bad = [rounds[0], dict(rounds[1], calib_dist_b=float("inf"), diff=torch.tensor([[3.0, 0.0], [float("inf"), 0]]))]
    noise = pooled_noise(bad, ["a", "b"], _gram(bad) / 2.5)
    assert noise[0].item() == pytest.approx(0.4) and noise[1].item() == float("inf")
    # E[pooled - noise] is the persisting bias^2: d(r) = b + e(r), |b|^2 = 0.25, E|e|^2 = 2, |g_ref| = 1, 8 rounds
    gen = torch.Generator().manual_seed(3)
    b = torch.tensor([0.3, 0.4] + [0.0] * 18, dtype=torch.float64)
    pooled, est = [], []
    for _ in range(2000):
        d = b + torch.randn(8, 20, generator=gen, dtype=torch.float64) * 0.1**0.5  # (8, 20)
        rounds = [{"calib_dist_a": (x @ x).item(), "calib_ref_norm": 1.0, "diff": x[None]} for x in d]
        gram = _gram(rounds)
        pooled.append(gram[0, 0].item())
        est.append(pooled[-1] - pooled_noise(rounds, ["a"], gram)[0].item())
    pooled, est = torch.tensor(pooled), torch.tensor(est)
    assert est.mean().item() == pytest.approx(0.25, abs=4 * est.std().item() / 2000**0.5)
    # the pooled distance alone carries the noise as well: 0.25 + 2 / 8
    assert pooled.mean().item() == pytest.approx(0.5, abs=4 * pooled.std().item() / 2000**0.5)


def test_pooled_and_mix_average_the_differences_not_the_distances():
    old, roll, mask = torch.tensor([[0.0, -1.0]]), torch.tensor([[-0.5, 0.0]]), torch.ones(1, 2, dtype=torch.bool)
    low = lambda res: res.weights[0]  # noqa: E731  tis (cap 2): (1.6487, 0.3679); seq_tis: (0.6065, 0.6065)
    ref = torch.tensor([1.0, 0.5])  # d_tis = (0.6487, -0.1321), d_seq = (-0.3935, 0.1065)
    # an earlier calibration: tis's difference then was the opposite of now, seq_tis's the same as now
    past = [{"calib_dist_tis": 0.3, "calib_dist_seq_tis": 0.1, "calib_ref_norm": 1.0,
             "diff": torch.tensor([[-0.6487, 0.1321], [-0.3935, 0.1065]])}]  # fmt: skip
    args = (["tis", "seq_tis"], low, ref, old, roll, mask, lambda n: {"cap": 2.0})
    # window: mean D, tis (0.3506 + 0.3) / 2 > seq_tis (0.1329 + 0.1) / 2
    w, m, rec = end_point_weights(*args, rule="window", past=past)
    assert w == {"seq_tis": 1.0} and "diff" not in rec
    assert m["calib_dist_tis"].item() == pytest.approx((0.6487**2 + 0.1321**2) / 1.25, rel=1e-3)
    # pooled: tis's differences cancel (mean 0), seq_tis's stay
    w, m, rec = end_point_weights(*args, rule="pooled", past=past)
    assert w == {"tis": 1.0} and rec["diff"].shape == (2, 2)
    assert m["calib_pooled_tis"].item() == pytest.approx(0.0, abs=1e-6)
    assert m["calib_pooled_seq_tis"].item() == pytest.approx((0.3935**2 + 0.1065**2) / ((1.0 + 1.25) / 2), rel=1e-3)
    # two calibrations give a noise estimate; with the past record's D consistent with its differences, tis's two
    # opposite differences are all noise (2 |d|^2 / 1 / 2 / 1.125) and seq_tis's two equal ones none
    past_d = {"calib_dist_tis": 0.6487**2 + 0.1321**2, "calib_dist_seq_tis": 0.3935**2 + 0.1065**2}
    _, m, _ = end_point_weights(*args, rule="pooled", past=[{**past[0], **past_d}])
    assert m["calib_noise_tis"].item() == pytest.approx(2 * past_d["calib_dist_tis"] / 2 / 1.125, rel=1e-3)
    assert m["calib_noise_seq_tis"].item() == pytest.approx(0.0, abs=1e-6)
    assert not any(k.startswith("calib_noise") for k in end_point_weights(*args, rule="pooled")[1])  # one: none
    # mix: with a persistent difference on both, opposite ones cancel in a mixture
    past = [{"calib_dist_tis": 0.3, "calib_dist_seq_tis": 0.1, "calib_ref_norm": 1.0,
             "diff": torch.tensor([[0.6487, -0.1321], [-0.3935, 0.1065]])}]  # fmt: skip
    w, _, _ = end_point_weights(*args, rule="mix", past=past)
    # minimise |l d_tis + (1 - l) d_seq|^2 over l in [0, 1]: l = -<d_s, d_t - d_s> / |d_t - d_s|^2
    dt, ds = torch.tensor([0.6487, -0.1321]), torch.tensor([-0.3935, 0.1065])
    best = (-(ds @ (dt - ds)) / (dt - ds).pow(2).sum()).item()
    assert w["tis"] == pytest.approx(best, rel=1e-3) and w["seq_tis"] == pytest.approx(1 - best, rel=1e-3)
    # an earlier calibration of other candidates (another shape) is left out, and unknown rules are refused
    w, _, _ = end_point_weights(*args, rule="pooled", past=[{**past[0], "diff": torch.zeros(3, 2)}])
    assert w == {"seq_tis": 1.0}  # this calibration alone: |d_seq|^2 < |d_tis|^2
    # an earlier calibration's rows are read by name: of candidates in another order (a branch reordered them), or of
    # more candidates (before: read by position, each candidate charged with another's past differences)
    w, m, rec = end_point_weights(*args, rule="mix", past=past)
    assert rec["names"] == ["tis", "seq_tis"]
    swapped = {**past[0], "diff": past[0]["diff"].flip(0), "names": ["seq_tis", "tis"]}
    more = {**past[0], "diff": torch.cat([torch.full((1, 2), 9.0), past[0]["diff"]]), "names": ["x", "tis", "seq_tis"]}
    for other in (swapped, more):
        w2, m2, _ = end_point_weights(*args, rule="mix", past=[{**other, "calib_dist_x": 0.0}])
        assert w2 == pytest.approx(w) and m2["calib_pooled_tis"] == pytest.approx(m["calib_pooled_tis"])
    # no candidate's gradient finite: nothing to judge by, the end point in use is kept
    nan = (["tis", "seq_tis"], lambda res: res.weights[0] * float("nan"), ref, old, roll, mask, lambda n: {})
    for rule in ("window", "pooled", "mix"):
        assert end_point_weights(*nan, rule=rule, keep={"seq_tis": 1.0})[0] == {"seq_tis": 1.0}
    with pytest.raises(ValueError, match=r"unknown calibration rule 'best'; choose from \['mix', 'pooled', 'window'\]"):
        end_point_weights(*args, rule="best")


def test_combine_mixes_the_token_weights():
    old, roll = torch.tensor([[0.0, -1.0], [0.0, 0.0]]), torch.tensor([[-0.5, 0.0], [0.0, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    tis, seq = correct("tis", old, roll, mask, cap=2.0), correct("seq_tis", old, roll, mask, cap=2.0)
    res = combine({"tis": tis, "seq_tis": seq}, {"tis": 0.3, "seq_tis": 0.7})
    assert torch.allclose(res.weights, 0.3 * tis.weights + 0.7 * seq.weights)
    assert res.weights[1, 1] == 0 and res.mask.tolist() == mask.tolist()
    assert res.metrics == seq.metrics and res.metrics is not seq.metrics  # the larger weight's, copied: the trainer
    # adds its own metrics to the result's
    assert combine({"tis": tis}, {"tis": 1.0}) is tis


def test_the_applied_mixture_is_that_of_the_candidates_as_calibration_measured_them():
    # with normalize and QaRL's error masking, calibration measures each candidate restricted and renormalised on its
    # own; the update mixed first and renormalised the mixture, another set of weights (0.009 apart here)
    from aisrl.correction import restrict
    from aisrl.train_config import load_config
    from aisrl.trainer import _applied

    g = torch.Generator().manual_seed(0)
    old, roll = -torch.rand(4, 6, generator=g) * 3, -torch.rand(4, 6, generator=g) * 3
    mask = torch.ones(4, 6, dtype=torch.bool)
    keep = torch.rand(4, 6, generator=g) > 0.3
    cfg = load_config("lab")
    cfg.correction.options = {"normalize": True}
    rs = {c: correct(c, old, roll, mask, cap=2.0, normalize=True) for c in ("tis", "seq_tis")}
    lam = {"tis": 0.5, "seq_tis": 0.5}
    expected = sum(lam[c] * restrict(rs[c], keep, normalize=True).weights for c in rs)
    res = _applied(cfg, rs, lam, keep)
    torch.testing.assert_close(res.weights, expected)
    assert res.mask.tolist() == keep.tolist()
    close = restrict(combine(rs, lam), keep, normalize=True).weights
    assert (close - expected).abs().max() > 1e-3  # the order matters on this batch: the test can tell them apart
    assert _applied(cfg, {"tis": rs["tis"]}, {"tis": 1.0}, keep).weights.equal(
        restrict(rs["tis"], keep, normalize=True).weights)  # fmt: skip


def test_candidates_and_settings_are_checked_before_anything_is_built():
    with pytest.raises(ValueError, match=r"unknown correction\(s\) \['tiss'\]"):
        check_candidates(["tis", "tiss"])
    with pytest.raises(ValueError, match="two or more distinct"):
        check_candidates(["tis", "tis"])
    for bad, match in [("correction.calibrate_every=-1", "calibrate_every must be 0"),
                       ("correction.bypass=true", "correction.bypass=false"),
                       ("correction.calibrate_window=0", "calibrate_window must be >= 1"),
                       ("correction.calibrate_rule=best", r"unknown correction.calibrate_rule 'best'; choose from"),
                       ("correction.candidates=[tis,icepop] correction.calibrate_rule=mix",
                        r"needs corrections that keep every token; \['icepop'\] reject tokens"),
                       ("correction.alpha=0.5", r"'tis' got unknown option\(s\) \['alpha'\]")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            validate(load_config("lab", ["correction.calibrate_every=2", "correction.cap=3", *bad.split()]))
    # a correction that drops whole sequences rejects tokens too (before: passed, its probe's net log-ratio was 0)
    for seq_level in ("seq_mask", "geo_mask", "k1_reject"):
        with pytest.raises(ValueError, match=rf"\['{seq_level}'\] reject tokens"):
            check_mixable(["tis", seq_level], lambda name: {})
    check_mixable(["tis", "ais", "seq_tis"], lambda name: {})  # reweighting only
    # however wide a band or threshold: a veto drops sequences only at w < 1e-4 (before: passed the probe's +-4)
    with pytest.raises(ValueError, match=r"\['veto'\] reject tokens"):
        check_mixable(["tis", "veto"], lambda name: {})
    with pytest.raises(ValueError, match=r"\['tis'\] reject tokens"):  # the veto option, on any correction
        check_mixable(["tis"], lambda name: {"veto": 1e-6})
    with pytest.raises(ValueError, match=r"\['icepop'\] reject tokens"):
        check_mixable(["icepop"], lambda name: {"low": 1e-5, "high": 1e5})
    # a rejecting correction may still be chosen whole, by the other rules
    validate(load_config("lab", ["correction.calibrate_every=2", "correction.candidates=[tis,icepop]",
                                 "correction.calibrate_rule=pooled"]))  # fmt: skip


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("quant", ["none", "fp8_e4m3_w8a8"])
def test_trainer_calibrates_on_schedule_and_trains_with_the_pick(tmp_path, monkeypatch, quant):
    # a reward that varies with the completion, so groups have advantages (an untrained policy scores 0 everywhere)
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    seen = []
    monkeypatch.setattr("aisrl.trainer.correct", lambda name, *a, **k: seen.append(name) or correct(name, *a, **k))
    out = tmp_path / "run"
    cfg = load_config("lab", [*TINY_LAB, "max_steps=3", f"output_dir={out}", f"rollout.quant={quant}",
                              "correction.calibrate_every=2", "correction.calibrate_window=1",
                              "correction.candidates=[seq_tis,tis]"])  # fmt: skip
    train(cfg, log=lambda _: None)
    r = rows(out)
    cal = [x["step"] for x in r if "calib_dist_tis" in x]
    assert cal == [1, 3] and all("time_calibrate" in x for x in r if x["step"] in cal)
    for x in r:
        if "calib_dist_tis" in x:
            d = [x["calib_dist_seq_tis"], x["calib_dist_tis"]]
            assert x["end_point"] == d.index(min(d))  # the nearest candidate, trained from this step on
            assert x["calib_ref_norm"] > 0
            if quant == "none":  # same weights, same seeds: the same samples, every weight 1, every gradient equal
                assert max(d) < 1e-8
    assert r[1]["end_point"] == r[0]["end_point"]  # kept between calibrations
    picks = [cfg.correction.candidates[int(x["end_point"])] for x in r]
    assert [n for n in seen if n != "none"] == picks  # what each step trained with (the reference is "none")


def test_the_trainer_trains_with_the_mixture_it_logs(tmp_path, monkeypatch):
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    seen = []
    monkeypatch.setattr("aisrl.trainer.correct", lambda name, *a, **k: seen.append(name) or correct(name, *a, **k))
    mixed = []
    monkeypatch.setattr("aisrl.trainer.combine", lambda res, w: mixed.append(dict(w)) or combine(res, w))
    out = tmp_path / "run"
    train(load_config("lab", [*TINY_LAB, "max_steps=3", f"output_dir={out}", "rollout.quant=fp8_e4m3_w8a8",
                              "correction.calibrate_every=1", "correction.calibrate_rule=mix"]), log=lambda _: None)
    r = rows(out)
    names = ["tis", "prefix_tis", "seq_tis"]
    for x, w in zip(r, mixed, strict=True):
        lam = [x[f"end_weight_{n}"] for n in names]
        assert sum(lam) == pytest.approx(1.0) and min(lam) >= 0
        assert w == pytest.approx({n: v for n, v in zip(names, lam, strict=True) if v > 0})
        assert x["end_point"] == lam.index(max(lam)) and all(f"calib_pooled_{n}" in x for n in names)
    assert [n for n in seen if n != "none"] == [n for w in mixed for n in w]  # each weighted candidate, every step
    assert any(len(w) > 1 for w in mixed)  # a mixture of end points was trained, not only single ones


@pytest.mark.parametrize("rule", ["window", "mix"])
def test_a_resumed_run_keeps_its_pick_and_the_calibrations_it_averages(tmp_path, monkeypatch, rule):
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    a, b = tmp_path / "a", tmp_path / "b"
    base = [*TINY_LAB, "rollout.quant=fp8_e4m3_w8a8", "checkpoint_every=2", "correction.calibrate_every=2",
            "correction.calibrate_window=2", f"correction.calibrate_rule={rule}"]  # fmt: skip
    train(load_config("lab", [*base, "max_steps=4", f"output_dir={a}"]), log=lambda _: None)
    train(load_config("lab", [*base, "max_steps=2", f"output_dir={b}"]), log=lambda _: None)
    train(load_config("lab", [*base, "max_steps=4", f"output_dir={b}"]), log=lambda _: None)
    ra, rb = rows(a), rows(b)
    assert "calib_dist_tis" not in rb[1]  # step 2 is no calibration step: its pick came from step 1
    names = ["tis", "prefix_tis", "seq_tis"]  # the default candidates
    if rule == "window":
        mean = [(rb[0][f"calib_dist_{n}"] + rb[2][f"calib_dist_{n}"]) / 2 for n in names]
        assert rb[2]["end_point"] == mean.index(min(mean))  # step 3 averaged step 1's calibration, from the checkpoint
    for x, y in zip(ra, rb, strict=True):  # mix: step 3's weights pooled step 1's differences, from the checkpoint
        for key in ("end_point", "reward", "k3_kl", "loss", *(f"end_weight_{n}" for n in names)):
            assert x[key] == y[key], key
        for key in (f"calib_pooled_{n}" for n in names):  # step 3's pooled step 1's differences, from the checkpoint
            assert x.get(key) == y.get(key) and (key in x) == (rule == "mix" and "calib_dist_tis" in x), key


def test_a_calibration_that_measured_nothing_keeps_no_place_in_the_window(tmp_path, monkeypatch):
    # a zero reference gradient (every full-precision group tied) is left out of the mean, and must not push a
    # calibration that measured something out of the window either
    from aisrl import trainer

    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    real, calls = trainer._full_precision_gradient, []

    def zero_at_step_3(*a, **k):
        g = real(*a, **k)
        calls.append(1)
        return torch.zeros_like(g) if len(calls) == 2 else g

    monkeypatch.setattr(trainer, "_full_precision_gradient", zero_at_step_3)
    out = tmp_path / "run"
    train(load_config("lab", [*TINY_LAB, "rollout.quant=fp8_e4m3_w8a8", "max_steps=4", f"output_dir={out}",
                              "correction.calibrate_every=2", "correction.calibrate_window=2",
                              "correction.calibrate_rule=pooled", "checkpoint_every=1"]), log=lambda _: None)
    kept = torch.load(latest_checkpoint(out) / "state.pt", weights_only=True)["extra"]["calibrations"]
    r = rows(out)
    assert r[2]["calib_ref_norm"] == 0.0 and [c["calib_ref_norm"] for c in kept] == [r[0]["calib_ref_norm"]]
    train(load_config("lab", [*TINY_LAB, "rollout.quant=fp8_e4m3_w8a8", "max_steps=5", f"output_dir={out}",
                              "correction.calibrate_every=2", "correction.calibrate_window=2",
                              "correction.calibrate_rule=pooled", "checkpoint_every=1"]), log=lambda _: None)
    r = rows(out)  # step 5 pooled its calibration with step 1's (two of them: a noise estimate), not step 3's
    assert all(f"calib_noise_{n}" in r[4] for n in ("tis", "prefix_tis", "seq_tis"))


def test_with_error_masking_a_calibration_judges_each_candidate_on_the_tokens_it_would_train_on(tmp_path, monkeypatch):
    import aisrl.trainer as trainer

    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    # every completion's first two tokens flagged as errors: the trained mask is then known in advance
    completions = []
    monkeypatch.setattr(trainer, "error_tokens",
                        lambda ids, mask, ratio: completions.append(mask) or mask & (mask.cumsum(-1) <= 2))
    judged, trained = [], []
    real_acc, real_update = trainer.accumulate_gradient, trainer.policy_update
    monkeypatch.setattr(trainer, "accumulate_gradient", lambda *a: judged.append(a[6].mask.clone()) or real_acc(*a))
    monkeypatch.setattr(trainer, "policy_update", lambda *a: trained.append(a[7].mask.clone()) or real_update(*a))
    out = tmp_path / "run"
    train(load_config("lab", [*TINY_LAB, "max_steps=1", f"output_dir={out}", "rollout.quant=fp8_e4m3_w8a8",
                              "correction.calibrate_every=1", "correction.candidates=[tis,seq_tis]",
                              "correction.mask_errors=true"]), log=lambda _: None)  # fmt: skip
    (completion,), (_, *candidates), (mask,) = completions, judged, trained  # the reference first, then candidates
    assert torch.equal(mask, completion & (completion.cumsum(-1) > 2)) and mask.any()  # the flagged tokens left out
    assert len(candidates) == 2 and all(torch.equal(c, mask) for c in candidates)  # judged on what trains


def test_a_tripped_step_neither_changes_the_pick_nor_enters_the_calibration_window(tmp_path, monkeypatch):
    from aisrl.update import MismatchGuard

    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    real, calls = MismatchGuard.tripped, []

    def trips_at_step_3(self, k3):
        calls.append(k3)
        return real(self, k3) or len(calls) == 3

    monkeypatch.setattr(MismatchGuard, "tripped", trips_at_step_3)
    out = tmp_path / "run"
    train(load_config("lab", [*TINY_LAB, "rollout.quant=fp8_e4m3_w8a8", "max_steps=3", f"output_dir={out}",
                              "correction.guard=4", "correction.calibrate_every=1", "correction.calibrate_window=2",
                              "checkpoint_every=1"]), log=lambda _: None)  # fmt: skip
    r = rows(out)
    assert [x["guard_rollback"] for x in r] == [0.0, 0.0, 1.0] and all("calib_dist_tis" in x for x in r)
    kept = torch.load(latest_checkpoint(out) / "state.pt", weights_only=True)["extra"]["calibrations"]
    assert [c["calib_ref_norm"] for c in kept] == [r[1]["calib_ref_norm"]]  # step 2's, not the undone step 3's
    assert r[1]["calib_ref_norm"] != r[2]["calib_ref_norm"]
    assert r[2]["end_point"] == r[1]["end_point"]  # the pick of step 2 carries on past the undone step


def test_a_tripped_step_of_a_run_resumed_with_other_candidates_logs_its_end_point(tmp_path, monkeypatch):
    # The checkpoint's end point (AIS, trained without calibration) is none of the resumed run's candidates, and the
    # step that calibrates trips the guard, so that end point stays (before: ValueError, 'ais' is not in list)
    from aisrl.update import MismatchGuard

    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    real, calls = MismatchGuard.tripped, []
    trips = lambda self, k3: calls.append(k3) or real(self, k3) or len(calls) == 3  # noqa: E731
    monkeypatch.setattr(MismatchGuard, "tripped", trips)
    out, base = tmp_path / "run", [*TINY_LAB, "rollout.quant=fp8_e4m3_w8a8", "correction.name=ais"]
    base.append("correction.guard=4")
    train(load_config("lab", [*base, "max_steps=2", f"output_dir={out}"]), log=lambda _: None)
    (out / "config.json").unlink()  # continued under new settings, as a branch does
    train(load_config("lab", [*base, "max_steps=3", f"output_dir={out}", "correction.calibrate_every=2"]),
          log=lambda _: None)  # fmt: skip
    last = rows(out)[2]
    assert last["guard_rollback"] == 1.0 and "calib_dist_tis" in last
    assert last["end_point"] is None or math.isnan(last["end_point"])  # none of the candidates
    assert [last[f"end_weight_{n}"] for n in ("tis", "prefix_tis", "seq_tis")] == [0.0, 0.0, 0.0]


def test_calibration_noise_reads_the_calibrations_a_checkpoint_keeps(tmp_path):
    bench = load_benchmark("calibration_noise")
    # three calibrations of |g_ref| = 1: a's differences (1, 0), (3, 0), (2, 0): mean (2, 0), pooled 4, tr Cov = 1,
    # noise 1 / 3; b's (0, 0), (0, 2), (0, -2): pooled 0, tr Cov = 4, noise 4 / 3
    diffs = [([1.0, 0.0], [0.0, 0.0]), ([3.0, 0.0], [0.0, 2.0]), ([2.0, 0.0], [0.0, -2.0])]
    cal = [{"calib_dist_a": sum(x * x for x in a), "calib_dist_b": sum(x * x for x in b), "calib_ref_norm": 1.0,
            "diff": torch.tensor([a, b])} for a, b in diffs]  # fmt: skip
    path = tmp_path / "state.pt"
    torch.save({"extra": {"calibrations": cal}}, path)
    fig = bench.checkpoint_figures(path)
    assert fig["n"] == 3 and fig["names"] == ["a", "b"]
    assert fig["pooled_a"] == pytest.approx(4.0) and fig["noise_a"] == pytest.approx(1 / 3)
    assert fig["pooled_b"] == pytest.approx(0.0) and fig["noise_b"] == pytest.approx(4 / 3)
    assert fig["gap"] == pytest.approx((4 - 1 / 3) - (0 - 4 / 3)) and fig["gap_se"] > 0
    torch.save({"extra": {"calibrations": cal[:2]}}, path)
    assert bench.checkpoint_figures(path) is None  # too few to jackknife


def test_calibration_noise_never_picks_a_candidate_whose_gradient_was_not_finite(tmp_path, monkeypatch):
    """A candidate with an inf in one calibration's difference has debiased inf - inf = NaN, which Python's min
    returned as the pick whenever it came first; its NaN noise share went into the median too."""
    bench = load_benchmark("calibration_noise")
    monkeypatch.setattr(bench, "ROOT", tmp_path)  # results under tmp_path, never the repository's
    diffs = [([math.inf, 0.0], [1.0, 0.0]), ([3.0, 0.0], [0.0, 2.0]), ([2.0, 0.0], [0.0, -2.0])]
    cal = [{"calib_dist_a": sum(x * x for x in a), "calib_dist_b": sum(x * x for x in b), "calib_ref_norm": 1.0,
            "diff": torch.tensor([a, b])} for a, b in diffs]  # fmt: skip
    state = tmp_path / "runs" / "r" / "checkpoints" / "step_000010" / "state.pt"
    state.parent.mkdir(parents=True)
    torch.save({"extra": {"calibrations": cal}}, state)
    out = bench.main(tmp_path / "runs", [10], "t")
    assert out["picks_debiased"] == {"b": 1} and out["picks_pooled"] == {"b": 1}
    assert math.isfinite(out["median_noise_share"])


def test_combine_keeps_a_token_any_candidate_keeps():
    # two rejection rules that keep different tokens: the mixture keeps the union, each token weighted by the
    # candidates that kept it (a dropped token's weight is 0 in its own result)
    old, roll = torch.tensor([[1.0, 0.0, -1.0]]), torch.zeros(1, 3)  # w = e, 1, 1/e
    mask = torch.ones(1, 3, dtype=torch.bool)
    high = correct("icepop", old, roll, mask, low=0.5, high=2.0)  # drops w = e
    low = correct("icepop", old, roll, mask, low=0.5, high=3.0)  # keeps w = e, drops 1/e (below 0.5)
    assert high.mask.tolist() == [[False, True, False]] and low.mask.tolist() == [[True, True, False]]
    res = combine({"a": high, "b": low}, {"a": 0.25, "b": 0.75})
    assert res.mask.tolist() == [[True, True, False]]
    torch.testing.assert_close(res.weights, torch.tensor([[0.75 * math.e, 1.0, 0.0]]))
