"""The estimator benchmark measures what it claims: exact gradient, unbiased on-policy estimate, oracle."""

import itertools

import pytest
import torch
from conftest import load_benchmark

from aisrl.bench.estimator import (
    EstimatorBenchConfig,
    MarkovPolicy,
    TabularPolicy,
    _batch_gradients,
    _bias_variance,
    _instance,
    _oracle_at_horizon,
    check,
    horizon_markdown,
    markdown,
    run,
    run_point,
    summarize,
)
from aisrl.bench.variants import VARIANTS
from aisrl.config import apply_overrides


def test_enumeration_is_a_distribution():
    pol = TabularPolicy(3, 3)
    assert pol.seqs.shape == (27, 3) and pol.num_rows == 1 + 3 + 9
    logits = torch.randn(pol.num_rows, 3, dtype=torch.float64)
    assert torch.isclose(pol.token_logp(logits).sum(-1).exp().sum(), torch.tensor(1.0, dtype=torch.float64))


def test_exact_gradient_matches_finite_differences():
    cfg = EstimatorBenchConfig(vocab=3, length=3)
    pol = TabularPolicy(3, 3)
    theta, _, _, reward, grad = _instance(cfg, pol, 1.0, 0.3, torch.Generator().manual_seed(0))

    def J(th):
        return (pol.token_logp(th).sum(-1).exp() * reward).sum()

    eps = 1e-6
    for i in (0, 5, 17, 30):
        d = torch.zeros_like(theta).view(-1)
        d[i] = eps
        fd = (J(theta + d.view_as(theta)) - J(theta - d.view_as(theta))) / (2 * eps)
        assert abs(fd - grad[i]) < 1e-7


def test_on_policy_estimate_is_unbiased():
    """With no mismatch, the mean of the batch estimates converges to the exact gradient."""
    cfg = EstimatorBenchConfig(vocab=3, length=3)
    pol = TabularPolicy(3, 3)
    gen = torch.Generator().manual_seed(1)
    theta, logp, _, reward, grad = _instance(cfg, pol, 1.0, 0.0, gen)
    K, B, G = 4000, 4, 4
    idx = torch.multinomial(logp.sum(-1).exp().float().expand(K, -1), B * G, replacement=True, generator=gen)
    r = reward[idx].view(K, B, G)
    adv = (r - (r.sum(-1, keepdim=True) - r) / (G - 1)).view(K, B * G)
    g = _batch_gradients(theta, pol.rows[idx], pol.seqs[idx], adv[..., None].expand(K, B * G, 3).clone())
    err = (g.mean(0) - grad).norm() / grad.norm()
    sem = g.std(0).norm() / K**0.5 / grad.norm()  # standard error of the mean, relative
    assert err < 4 * sem and err < 0.1


def test_oracle_is_never_beaten_by_its_end_points():
    cfg = EstimatorBenchConfig(vocab=3, length=3, batches=40, groups=2, group_size=4, variants=["design"])
    mse, diag = run_point(cfg, TabularPolicy(3, 3), 1.5, 0.6, torch.Generator().manual_seed(2))
    assert mse["oracle"] <= min(mse["none"], mse["tis"]) + 1e-12
    assert 0.0 <= diag["oracle_alpha"] <= 1.0 and 0.0 < diag["ais_alpha_mean"] <= 1.0
    assert set(mse) >= {"none", "tis", "seq_tis", "icepop", "ais", "oracle", "variant:design"}


def test_run_summary_and_markdown():
    from aisrl.bench.estimator import markdown

    cfg = EstimatorBenchConfig(vocab=3, length=2, batches=8, instances=1, strengths=[0.3], sharpness=[1.0])
    result = run(cfg)
    s = result["summary"]
    assert s["ais_over_oracle_mean"] >= 1.0 - 1e-9
    table = markdown(result)
    assert "| 1.0 | 0.3 |" in table and "mean MSE / MSE(oracle alpha*)" in table


def test_a_sweep_point_with_no_gradient_to_compare_against_is_named():
    # vocab 2, length 2, one instance: the rewards can all be equal, and an error relative to |g|^2 = 0 is no number
    cfg = EstimatorBenchConfig(vocab=2, length=2, groups=1, group_size=2, batches=2, instances=1, strengths=[0.2],
                               sharpness=[1.0])  # fmt: skip
    with pytest.raises(ValueError, match="exact gradient of every instance is 0"):
        run(cfg)


def _markov_count_dist_by_enumeration(pol: MarkovPolicy, theta: torch.Tensor) -> torch.Tensor:
    lp = theta.log_softmax(-1)
    dist = torch.zeros(pol.L + 1, dtype=torch.float64)
    for seq in itertools.product(range(pol.V), repeat=pol.L):
        prev, logp = pol.V, 0.0
        for t, y in enumerate(seq):
            logp += lp[t * (pol.V + 1) + prev, y]
            prev = y
        dist[sum(y == 0 for y in seq)] += logp.exp()
    return dist


def test_markov_recursion_matches_enumeration():
    pol = MarkovPolicy(3, 4)
    theta = torch.randn(pol.num_rows, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(pol._count_dist(theta), _markov_count_dist_by_enumeration(pol, theta))


def test_markov_exact_gradient_matches_finite_differences():
    cfg = EstimatorBenchConfig(vocab=3, length=5, batches=2, groups=2, group_size=2, policy="markov")
    pol = MarkovPolicy(3, 5)
    d = pol.draw(cfg, 1.0, 0.3, torch.Generator().manual_seed(3))
    tails = pol._count_dist(d.theta).flip(0).cumsum(0).flip(0)  # J = P(count >= k) for the draw's k
    k = int((tails - cfg.reward_p).abs().argmin())
    eps = 1e-6
    used = d.grad.nonzero().flatten()  # rows the policy never visits have a zero gradient: skip them
    assert len(used) > 20
    for i in used[:: len(used) // 6].tolist():
        e = torch.zeros_like(d.theta).view(-1)
        e[i] = eps
        hi = pol._count_dist(d.theta + e.view_as(d.theta))[k:].sum()
        lo = pol._count_dist(d.theta - e.view_as(d.theta))[k:].sum()
        assert abs((hi - lo) / (2 * eps) - d.grad[i]) < 1e-7


def test_markov_samples_follow_mu_and_on_policy_estimate_is_unbiased():
    K, B, G, L = 3000, 4, 4, 4
    cfg = EstimatorBenchConfig(vocab=3, length=L, batches=K, groups=B, group_size=G, policy="markov")
    pol = MarkovPolicy(3, L)
    d = pol.draw(cfg, 1.0, 0.0, torch.Generator().manual_seed(1))
    assert torch.equal(d.old, d.roll)  # strength 0: mu = pi
    # the rewarded fraction of the samples estimates J = P_pi(count >= k)
    tails = pol._count_dist(d.theta).flip(0).cumsum(0).flip(0)
    k = int((tails - cfg.reward_p).abs().argmin())
    assert abs(d.reward.mean() - tails[k]) < 4 * (tails[k] * (1 - tails[k]) / (K * B * G)) ** 0.5
    r = d.reward.view(K, B, G)
    adv = (r - (r.sum(-1, keepdim=True) - r) / (G - 1)).view(K, B * G)
    g = _batch_gradients(d.theta, d.rows, d.toks, adv[..., None].expand(K, B * G, L).clone())
    err = (g.mean(0) - d.grad).norm() / d.grad.norm()
    sem = g.std(0).norm() / K**0.5 / d.grad.norm()
    assert err < 4 * sem and err < 0.1


def test_bias_variance_split_adds_up_to_the_mse():
    gen = torch.Generator().manual_seed(4)
    grad = torch.randn(6, dtype=torch.float64, generator=gen)
    g = grad + 0.3 + torch.randn(50, 6, dtype=torch.float64, generator=gen)  # bias 0.3 per coordinate
    bias2, var = _bias_variance(g, grad)
    mse = (g - grad).pow(2).sum(-1).mean().item()
    assert mse == pytest.approx(bias2 + var)  # so h = 1 is the per-batch MSE the headline table reports


def test_bias_and_variance_estimates_are_unbiased():
    # 4 coordinates with bias 0.1 each (|b|^2 = 0.04) and unit noise, K = 5 batches: the naive |mean - g|^2
    # would average 0.04 + 4 / 5 = 0.84; the corrected estimate must average 0.04, the variance 4.
    gen = torch.Generator().manual_seed(6)
    grad = torch.zeros(4, dtype=torch.float64)
    runs = [_bias_variance(0.1 + torch.randn(5, 4, dtype=torch.float64, generator=gen), grad) for _ in range(4000)]
    bias2 = torch.tensor([b for b, _ in runs])
    var = torch.tensor([v for _, v in runs])
    assert abs(bias2.mean() - 0.04) < 4 * bias2.std() / len(runs) ** 0.5
    assert abs(var.mean() - 4.0) < 4 * var.std() / len(runs) ** 0.5


def test_oracle_at_horizon_beats_both_end_points_and_shrinks_with_h():
    gen = torch.Generator().manual_seed(5)
    d0 = 0.5 + torch.randn(80, 4, dtype=torch.float64, generator=gen)  # none: biased, less noisy
    d01 = d0 - 1.5 * torch.randn(80, 4, dtype=torch.float64, generator=gen)  # tis = d0 - d01: unbiased, noisy

    def at(a, h):
        e = d0 - a * d01
        b2, v = _bias_variance(e, torch.zeros(4, dtype=torch.float64))
        return b2 + v / h

    for h in (1, 10, 100):
        best = _oracle_at_horizon(d0, d01, h)
        assert best <= min(at(0.0, h), at(1.0, h)) + 1e-12
        grid = min(at(a / 200, h) for a in range(201))
        assert best == pytest.approx(grid, rel=1e-3, abs=1e-9)
    assert _oracle_at_horizon(d0, d01, 100) < _oracle_at_horizon(d0, d01, 1)
    # beyond K batches the variance term enters with a negative weight: the quadratic can turn concave,
    # and then the minimum over [0, 1] is at an end point
    few0, few01 = d0[:3], d01[:3]
    best = _oracle_at_horizon(few0, few01, 1000)
    ends = []
    for a in (0.0, 1.0):
        b2, v = _bias_variance(few0 - a * few01, torch.zeros(4, dtype=torch.float64))
        ends.append(b2 + v / 1000)
    assert best <= min(ends) + 1e-12


def test_markov_run_reports_every_horizon():
    cfg = EstimatorBenchConfig(vocab=3, length=6, groups=2, group_size=4, batches=10, instances=1,
                               strengths=[0.3], sharpness=[1.0], policy="markov", horizons=[1, 10],
                               methods=["none", "tis", "prefix_tis", "ais"], variants=["c4"])  # fmt: skip
    result = run(cfg)
    p = result["points"][0]
    assert {"bias2:prefix_tis", "var:ais", "oracle@10"} <= set(p) and "oracle@1" not in p
    for m in ("none", "tis", "prefix_tis", "ais"):  # pooled like the MSE, so they add up to it
        assert p["mse"][m] == pytest.approx(p[f"bias2:{m}"] + p[f"var:{m}"])
    assert p["oracle@10"] <= min(p[f"bias2:{m}"] + p[f"var:{m}"] / 10 for m in ("none", "tis")) + 1e-12
    text = horizon_markdown(result)
    assert "MSE over h = 10 steps" in text and "Squared bias alone" in text and "| 1.0 | 0.3 |" in text


def test_unknown_policy_and_bad_sizes_are_clear_errors():
    with pytest.raises(ValueError, match=r"unknown policy 'hmm'; choose from \['markov', 'tabular'\]"):
        run(EstimatorBenchConfig(policy="hmm"))
    with pytest.raises(ValueError, match="batches >= 2"):
        run(EstimatorBenchConfig(batches=1))
    with pytest.raises(ValueError, match="horizon >= 1"):
        run(EstimatorBenchConfig(horizons=[0]))
    bad = {
        "methods": (["tis", "magic"], r"unknown methods \['magic'\]; choose from \['ais'"),
        "variants": (["c4", "c5"], r"unknown variants \['c5'\]; choose from \['adopted'"),
        "strengths": ([], "strengths and sharpness each need at least one value"),
        "vocab": (1, "vocab must be >= 2, got 1"),
        "group_size": (1, "group_size must be >= 2, got 1"),
        "length": (20, r"enumerates vocab\^length = 5\^20 sequences, more than 1048576; .* policy=markov"),
        # every reward 1: a gradient of rounding error, and every method's relative MSE exactly 1 (was accepted)
        "reward_p": (1.0, "need 0 < reward_p < 1"),
        "cap": (0.0, "cap > 0; got reward_p=0.3, cap=0.0"),
        "sharpness": ([float("nan")], "strengths and sharpness must be finite"),  # (was a multinomial error)
    }
    for key, (value, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            run(EstimatorBenchConfig(**{key: value}))
    with pytest.raises(ValueError, match=r"variants \['c4'\] are scored from AIS's diagnostics .*: add ais"):
        run(EstimatorBenchConfig(methods=["none", "tis"], variants=["c4"]))  # before: no variant, no error
    run(EstimatorBenchConfig(policy="markov", length=20, batches=2, instances=1, strengths=[0.1], sharpness=[1.0]))


def test_a_run_with_other_settings_than_a_published_one_gets_its_own_name():
    # benchmarks/estimator.py: before, the name held N and the seed only, so a smoke run replaced the headline figures
    names = load_benchmark("estimator").names

    def of(command: str):
        return names(apply_overrides(EstimatorBenchConfig(), command.split()))

    # the commands BENCHMARKS.md, README.md and docs/ais.md give keep their sections
    assert of("") == ("N64", "estimator", "### Batch N = 64")
    assert of("seed=1")[:2] == ("N64_seed1", "estimator_N64_seed1")
    assert of("groups=4 group_size=4")[:2] == ("N16", "estimator_N16")
    assert of("policy=markov length=24 groups=32 group_size=8 batches=240 instances=8 strengths=[0.05,0.1,0.2,0.35] "
              "methods=[none,tis,prefix_tis,suffix_tis,seq_tis,icepop,ais] horizons=[1,10,100]")[:2] == (
        "markov_L24_N256", "estimator_markov_L24_N256")  # fmt: skip
    # a smoke run, another split of the same N, a markov run with other settings: a hash of their settings
    smoke = of("batches=10 instances=1")
    tag = smoke[0]
    assert tag.startswith("N64_") and len(tag) == len("N64_") + 8 and smoke[1] == f"estimator_{tag}"
    assert of("instances=1 batches=10") == smoke  # stable: the same settings, the same name
    assert of("batches=10 instances=1 seed=2")[0] == f"N64_seed2_{tag[4:]}"
    assert of("batches=11 instances=1")[0] not in (tag, "N64")
    assert of("groups=16 group_size=4")[1] not in ("estimator", "estimator_N64")
    assert of("policy=markov length=24 groups=32 group_size=8")[0].startswith("markov_L24_N256_")


def test_the_variant_formulas_agree_with_ais_below_its_no_mismatch_cut_off():
    from aisrl.bench.variants import VARIANTS

    def alpha(name, s):
        t = lambda x: torch.tensor([x], dtype=torch.float64)  # noqa: E731
        return VARIANTS[name](t(1.0), t(s), t(1 + 2 * s), t(64.0), t(256.0)).item()

    # at L = 4 (t / n) the adopted formula is `design`; at or below S = 1e-8 both are 0 (before: design ~0.985)
    assert alpha("design", 5e-9) == alpha("adopted", 5e-9) == alpha("c4", 5e-9) == 0.0
    assert alpha("design", 1e-4) == pytest.approx(alpha("adopted", 1e-4)) and alpha("design", 1e-4) > 0.9


# Found by mutation testing: each case below failed a plausible slip that the tests above let pass.

def test_on_policy_none_is_unbiased_and_seq_ess_is_1():
    cfg = EstimatorBenchConfig(vocab=3, length=3, batches=400, groups=4, group_size=4, methods=["none", "tis"],
                               variants=[])
    _, diag = run_point(cfg, TabularPolicy(3, 3), 1.0, 0.0, torch.Generator().manual_seed(0))
    assert abs(diag["bias2:none"]) / diag["grad_norm2"] < 0.03  # leave-one-out baseline: unbiased (was 1/9 off)
    assert diag["seq_ess"] == pytest.approx(1.0)  # mu = pi: every weight 1, ESS/N = 1


def test_oracle_alpha_stays_in_0_1():
    cfg = EstimatorBenchConfig(vocab=3, length=3, batches=20, groups=2, group_size=2, methods=["none", "tis"],
                               variants=[])
    alphas = [run_point(cfg, TabularPolicy(3, 3), 1.0, 0.05, torch.Generator().manual_seed(s))[1]["oracle_alpha"]
              for s in range(10)]
    assert all(0.0 <= a <= 1.0 for a in alphas)


def _point():
    return {"sharpness": 1.0, "strength": 0.3, "k3_kl": 0.01, "seq_ess": 0.9, "oracle_alpha": 0.5,
            "ais_alpha_mean": 0.4, "mse": {"none": 2.0, "tis": 1.0, "ais": 1.5, "oracle": 0.5},
            "bias2:none": 0.1, "var:none": 1.0, "bias2:tis": 0.0, "var:tis": 3.0, "oracle@10": 0.15}


def test_summary_ratios():
    p2 = _point() | {"mse": {"none": 2.0, "tis": 1.0, "ais": 0.5, "oracle": 0.5}}
    s = summarize([_point(), p2])
    assert s["ais"]["over_oracle_mean"] == pytest.approx((3.0 + 1.0) / 2)
    assert s["ais"]["over_best_fixed_max"] == pytest.approx(1.5)  # 1.5 / min(2, 1)


def test_markdown_table():
    result = {"points": [_point()]}
    result["summary"] = summarize(result["points"])
    table = markdown(result)
    lines = table.splitlines()
    assert lines[1] == "|" + "---|" * 10  # 4 fixed + 4 estimators + 2 alpha columns
    assert "**1.0000**" in table and "**0.5000**" not in table  # the oracle is not an estimator to bold
    assert "\n| oracle |" not in table  # the summary table has no oracle row


def test_horizon_table():
    text = horizon_markdown({"points": [_point()], "config": {"horizons": [1, 10]}})
    assert "| 1.0 | 0.3 | 0.900 | **0.2000** | 0.3000 | 0.1500 |" in text  # 0.1 + 1/10, 0 + 3/10


def test_k3_estimates_the_per_token_kl_of_mu_from_pi():
    cfg = EstimatorBenchConfig(vocab=3, length=3, batches=400, groups=4, group_size=4, methods=["none", "tis"],
                               variants=[])
    pol = TabularPolicy(3, 3)
    _, lp, lm, _, _ = _instance(cfg, pol, 1.0, 0.5, torch.Generator().manual_seed(0))
    kl = (lm.sum(-1).exp() * (lm - lp).sum(-1)).sum().item() / 3  # KL(mu || pi) per token
    _, diag = run_point(cfg, pol, 1.0, 0.5, torch.Generator().manual_seed(0))
    assert diag["k3_kl"] == pytest.approx(kl, rel=0.1)


def test_checks():
    with pytest.raises(ValueError, match="need 0 < reward_p < 1"):
        run(EstimatorBenchConfig(reward_p=0.0))
    check(EstimatorBenchConfig(vocab=2, length=20))  # 2^20 sequences: at the limit, allowed


def test_reward_rate():
    cfg = EstimatorBenchConfig()
    reward = _instance(cfg, TabularPolicy(5, 4), 1.0, 0.2, torch.Generator().manual_seed(0))[3]
    assert abs(reward.mean().item() - 0.3) < 0.07  # 625 Bernoulli(0.3): sd 0.018


def test_batches_are_sampled_from_mu():
    cfg = EstimatorBenchConfig(vocab=3, length=3, batches=400, groups=4, group_size=4)
    d = TabularPolicy(3, 3).draw(cfg, 1.0, 1.0, torch.Generator().manual_seed(0))
    w = (d.old.double() - d.roll.double()).sum(-1).exp()  # pi / mu: mean 1 under mu
    assert w.mean().item() == pytest.approx(1.0, abs=0.05)


def test_the_tis_end_point_uses_the_configured_cap():
    cfg = EstimatorBenchConfig(vocab=3, length=3, batches=10, groups=2, group_size=4, cap=3.0,
                               methods=["none", "tis", "ais"], variants=[])
    run_point(cfg, TabularPolicy(3, 3), 1.0, 0.6, torch.Generator().manual_seed(0))  # (its end-point assert)


def test_variants_get_the_diagnostics_in_order():
    # at L = 4 (num_tokens / num_seqs) `design` is the adopted formula: its alpha is AIS's own, batch by batch
    cfg = EstimatorBenchConfig(vocab=3, length=4, batches=10, groups=2, group_size=4,
                               methods=["none", "tis", "ais"], variants=["adopted", "design"])
    _, diag = run_point(cfg, TabularPolicy(3, 4), 1.0, 0.05, torch.Generator().manual_seed(0))
    assert 0.05 < diag["ais_alpha_mean"] < 0.95
    assert diag["alpha:adopted"] == pytest.approx(diag["ais_alpha_mean"], rel=1e-4)
    assert diag["alpha:design"] == pytest.approx(diag["ais_alpha_mean"], rel=1e-4)


def test_oracle_at_h_is_pooled_like_the_mse():
    cfg = EstimatorBenchConfig(vocab=3, length=6, groups=2, group_size=4, batches=10, instances=1, strengths=[0.3],
                               sharpness=[1.0], policy="markov", horizons=[1, 10], methods=["none", "tis", "ais"],
                               variants=["c4"])
    p = run(cfg)["points"][0]
    _, d = run_point(cfg, MarkovPolicy(3, 6), 1.0, 0.3, torch.Generator().manual_seed(0))  # run's one instance
    assert p["oracle@10"] == pytest.approx(d["oracle@10"] / d["grad_norm2"])


def test_a_concave_horizon_quadratic_takes_its_best_end_point():
    d0 = torch.tensor([[-1.0], [1.0]], dtype=torch.float64)
    d01 = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
    # e0 = e1 = 0, v00 = v11 = 2, v01 = -2, c = 1/h - 1/2: f(0) = 2c, f(1) = 8c < f(0)
    assert _oracle_at_horizon(d0, d01, 10**6) == pytest.approx(8 * (1e-6 - 0.5))


# Found by mutation testing: each case below failed a plausible slip that the tests above let pass.

def alpha(name, s, rho=1.0, n=64.0):
    t = lambda x: torch.tensor([x], dtype=torch.float64)  # noqa: E731
    return VARIANTS[name](t(rho), t(s), t(1 + 2 * s), t(n), t(4 * n)).item()


def test_variant_formulas_by_hand():
    assert alpha("c4", 1e-3) == pytest.approx(16 / 17)  # var = 2S / (64 / 4)
    assert alpha("sqrt_n", 1e-3) == pytest.approx(8 / 9)  # var = 2S / sqrt(64)
    assert alpha("no_rho", 1e-3, rho=0.5) == pytest.approx(64 / 65)  # rho left out
    assert alpha("design", 7.5e-9) == 0.0  # 2S = 1.5e-8 <= 2 * SEVERITY_EPS
    assert alpha("half", 1e-3) == 0.5
