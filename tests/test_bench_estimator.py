"""The estimator benchmark measures what it claims: exact gradient, unbiased on-policy estimate, oracle."""

import torch

from aisrl.bench.estimator import (
    EstimatorBenchConfig,
    TabularPolicy,
    _batch_gradients,
    _instance,
    run,
    run_point,
)


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
    g = _batch_gradients(pol, theta, idx, adv[..., None].expand(K, B * G, 3).clone())
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
