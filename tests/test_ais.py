"""The properties AIS must have, plus hypothesis robustness:
1. no mismatch: every weight 1, the loss and its gradient those of uncorrected GRPO, for any alpha;
2. alpha = 0 is the uncorrected loss, alpha = 1 token TIS with cap C;
3. 1 - alpha <= omega <= max(1, C), and nothing NaN/inf for log-ratios of +-1e3 or -inf;
4. alpha in [0, 1], rising with severity, falling with amplification and with low reliability;
5. padding changes no diagnostic, and no gradient flows through omega, alpha, old_logp or rollout_logp;
6. (tests/test_dist.py) sharded batches give the single-process diagnostics."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aisrl.ais import ais_alpha
from aisrl.correction import CORRECTIONS, correct
from aisrl.losses import grpo_loss


def _batch(seed=0, n=6, t=5, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g) * 3 - 0.1
    roll = old + scale * torch.randn(n, t, generator=g)
    mask = torch.rand(n, t, generator=g) > 0.2
    mask[:, 0] = True
    logp = (old + 0.1 * torch.randn(n, t, generator=g)).requires_grad_(True)
    adv = torch.randn(n, generator=g)
    return logp, old, roll, adv, mask


def _loss_and_grad(logp, old, adv, mask, weights=None):
    logp = logp.detach().clone().requires_grad_(True)
    loss, _ = grpo_loss(logp, old, adv, mask, weights=weights)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad


def test_no_mismatch_recovers_on_policy_loss_and_gradient():
    logp, old, _, adv, mask = _batch()
    res = correct("ais", old, old.clone(), mask)
    assert torch.equal(res.weights[mask], torch.ones(int(mask.sum())))
    assert res.metrics["alpha"] == 0.0 and res.metrics["divergence_severity"] == 0.0
    for fixed in (0.3, 1.0):  # for any alpha, w == 1 gives omega == 1
        assert torch.equal(correct("ais", old, old.clone(), mask, alpha=fixed).weights, res.weights)
    loss_w, grad_w = _loss_and_grad(logp, old, adv, res.mask, res.weights)
    loss_0, grad_0 = _loss_and_grad(logp, old, adv, mask)
    assert torch.equal(loss_w, loss_0) and torch.equal(grad_w, grad_0)


def test_alpha_zero_is_none_and_alpha_one_is_tis():
    logp, old, roll, adv, mask = _batch(scale=0.8)
    none = correct("none", old, roll, mask)
    tis = correct("tis", old, roll, mask, cap=2.0)
    a0 = correct("ais", old, roll, mask, cap=2.0, alpha=0.0)
    a1 = correct("ais", old, roll, mask, cap=2.0, alpha=1.0)
    assert torch.equal(a0.weights, none.weights)
    torch.testing.assert_close(a1.weights, tis.weights)
    for x, y in ((a0, none), (a1, tis)):
        lx, gx = _loss_and_grad(logp, old, adv, x.mask, x.weights)
        ly, gy = _loss_and_grad(logp, old, adv, y.mask, y.weights)
        torch.testing.assert_close(lx, ly)
        torch.testing.assert_close(gx, gy)


def test_gradient_is_the_interpolation_of_none_and_tis():
    logp, old, roll, adv, mask = _batch(scale=0.8)
    res = correct("ais", old, roll, mask, cap=2.0)
    a = res.metrics["alpha"].item()
    assert 0.0 < a < 1.0
    _, g = _loss_and_grad(logp, old, adv, mask, res.weights)
    _, g0 = _loss_and_grad(logp, old, adv, mask)
    _, g1 = _loss_and_grad(logp, old, adv, mask, correct("tis", old, roll, mask, cap=2.0).weights)
    torch.testing.assert_close(g, (1 - a) * g0 + a * g1)


def test_alpha_range_and_monotonicity():
    rho, s, gam, n, t = (torch.tensor(x, dtype=torch.float64) for x in (0.5, 1e-3, 1.2, 16.0, 64.0))
    base = ais_alpha(rho, s, gam, n, t)
    assert 0.0 < base < 1.0
    assert ais_alpha(rho, s * 4, gam, n, t) > base  # more severe -> more correction
    assert ais_alpha(rho, s, gam * 1.5, n, t) < base  # more variance amplification -> less
    assert ais_alpha(rho * 0.2, s, gam, n, t) < base  # less reliable weights -> less (strictly, as gam > 1)
    assert ais_alpha(rho, s, gam, n * 4, t * 4) > base  # larger batch -> variance matters less
    assert ais_alpha(rho, s, gam, n, t * 4) > base  # longer sequences drift further -> more correction
    assert ais_alpha(rho, torch.zeros((), dtype=torch.float64), gam, n, t) == 0.0
    assert ais_alpha(rho, s, torch.ones((), dtype=torch.float64), n, t) == 1.0  # no variance cost
    grid = torch.tensor([0.0, 1e-6, 1e-3, 0.1, 10.0, 1e6], dtype=torch.float64)
    for s_ in grid:
        for g_ in 1 + grid:
            for r_ in (1e-6, 0.3, 1.0):
                for t_ in (0.0, 1.0, 64.0):  # t = 0: an all-padding batch
                    a = ais_alpha(torch.tensor(r_, dtype=torch.float64), s_, g_, n, torch.tensor(t_).double())
                    assert 0.0 <= a <= 1.0 and math.isfinite(a)


def test_diagnostics_and_alpha_on_a_real_batch_by_hand():
    _, old, roll, _, mask = _batch(n=32, t=8, scale=0.4)
    m = correct("ais", old, roll, mask, cap=2.0).metrics
    d = (old - roll)[mask].double()
    w = d.exp()
    seq_w = torch.stack([(old - roll)[i][mask[i]].double().sum().exp() for i in range(32)])
    rho = seq_w.sum() ** 2 / (32 * (seq_w**2).sum())
    sev = (w - 1 - d).mean()
    wbar = w.clamp(max=2.0)
    gam = (wbar**2).mean() / wbar.mean() ** 2
    torch.testing.assert_close(m["weight_reliability"].double(), rho, rtol=1e-5, atol=0)
    torch.testing.assert_close(m["divergence_severity"].double(), sev, rtol=1e-4, atol=0)
    torch.testing.assert_close(m["variance_amplification"].double(), gam, rtol=1e-5, atol=0)
    lbar = mask.sum() / 32  # tokens per sequence: the sequence KL is Lbar * S (chain rule)
    expected = rho * 32 * lbar * sev / (rho * 32 * lbar * sev + 2 * (gam - 1))  # docs/ais.md, eq. (alpha)
    torch.testing.assert_close(m["alpha"].double(), expected, rtol=1e-4, atol=0)
    assert 0.0 < m["alpha"] < 1.0


def test_weights_bounded():
    _, old, roll, _, mask = _batch(scale=3.0)
    for cap in (0.5, 2.0, 5.0):
        res = correct("ais", old, roll, mask, cap=cap)
        a = res.metrics["alpha"].item()
        w = res.weights[mask]
        assert (w >= 1 - a - 1e-6).all() and (w <= max(1.0, cap) + 1e-6).all()
    # at a fixed alpha far from 1 the bounds are sharp: w = 1 - a + a min(w_raw, cap), token by token
    w_raw = (old - roll).exp()[mask]
    for cap in (0.5, 2.0, 5.0):
        w = correct("ais", old, roll, mask, cap=cap, alpha=0.3).weights[mask]
        torch.testing.assert_close(w, 0.7 + 0.3 * w_raw.clamp(max=cap), rtol=1e-5, atol=1e-6)
        assert w.min() >= 0.7 and w.max() <= 0.7 + 0.3 * cap + 1e-6


def test_padding_never_changes_anything():
    _, old, roll, _, mask = _batch(scale=0.7)
    n, t = old.shape
    pad = torch.full((n + 2, t + 3), float("nan"))
    old_p, roll_p = pad.clone(), pad.clone()
    roll_p[:, -1] = float("-inf")
    old_p[:n, :t], roll_p[:n, :t] = old, roll
    mask_p = torch.zeros(n + 2, t + 3, dtype=torch.bool)
    mask_p[:n, :t] = mask
    for name in CORRECTIONS:
        a = correct(name, old, roll, mask)
        b = correct(name, old_p, roll_p, mask_p)
        torch.testing.assert_close(b.weights[:n, :t], a.weights)
        assert (b.weights[~mask_p] == 0).all()
        for k, v in a.metrics.items():
            torch.testing.assert_close(b.metrics[k], v, msg=f"{name}:{k}")


def test_no_gradient_flows_through_weights():
    logp, old, roll, adv, mask = _batch(scale=0.5)
    old = old.clone().requires_grad_(True)
    roll = roll.clone().requires_grad_(True)
    res = correct("ais", old, roll, mask)
    assert not res.weights.requires_grad
    assert not any(v.requires_grad for v in res.metrics.values())
    loss, _ = grpo_loss(logp, old, adv, res.mask, weights=res.weights)
    loss.backward()
    assert old.grad is None and roll.grad is None and logp.grad is not None


# ---------------------------------------------------------------- property-based robustness
EXTREMES = st.sampled_from([0.0, 1e3, -1e3, float("-inf"), float("inf"), 1e-3, -30.0, 30.0])
values = st.one_of(st.floats(-5, 5), EXTREMES)


@st.composite
def nasty_batches(draw):
    n = draw(st.integers(1, 5))
    t = draw(st.integers(1, 6))
    logr = torch.tensor(draw(st.lists(values, min_size=n * t, max_size=n * t))).view(n, t)
    base = torch.tensor(draw(st.lists(st.floats(-8, 0), min_size=n * t, max_size=n * t))).view(n, t)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=n * t, max_size=n * t))).view(n, t)
    old = base.clone()
    roll = base - logr  # log-ratio old - roll = logr (inf - inf gives NaN: also fine)
    roll = torch.where(torch.isinf(logr) & (logr < 0), base, roll)
    old = torch.where(torch.isinf(logr) & (logr < 0), torch.full_like(base, -float("inf")), old)
    old = torch.where(mask, old, torch.full_like(old, float("nan")))  # NaN at masked positions
    return old, roll, mask


@settings(max_examples=60, deadline=None)
@given(nasty_batches(), st.sampled_from(sorted(CORRECTIONS)), st.booleans())
def test_nothing_nonfinite_escapes(b, name, normalize):
    old, roll, mask = b
    res = correct(name, old, roll, mask, normalize=normalize)
    assert torch.isfinite(res.weights).all()
    assert (res.weights >= 0).all()
    assert not (res.mask & ~mask).any()  # never un-masks padding
    for k, v in res.metrics.items():
        assert torch.isfinite(v), (name, k, v)
    logp = torch.where(mask, old, 0.0).nan_to_num(neginf=-50.0).requires_grad_(True)
    adv = torch.randn(old.shape[0])
    loss, metrics = grpo_loss(logp, old.nan_to_num(neginf=-50.0), adv, res.mask, weights=res.weights)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())


def test_all_masked_and_all_rejected_batches():
    _, old, roll, adv, mask = _batch()
    empty = torch.zeros_like(mask)
    for name in CORRECTIONS:
        res = correct(name, old, roll, empty)
        assert not res.mask.any() and all(torch.isfinite(v) for v in res.metrics.values())
    rejected = correct("geo_mask", old, roll + 1.0, mask, low=0.999, high=1.001)
    assert not rejected.mask.any()
    assert rejected.metrics["mask_frac_seq"] == 1.0 and rejected.metrics["mask_frac_token"] == 1.0
    logp = old.clone().requires_grad_(True)
    loss, _ = grpo_loss(logp, old, adv, rejected.mask, weights=rejected.weights)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros_like(logp))


@pytest.mark.parametrize("value", [1e3, -1e3])
def test_huge_log_ratios_stay_finite(value):
    old = torch.zeros(2, 3) - 1.0
    roll = old - value
    mask = torch.ones(2, 3, dtype=torch.bool)
    for name in CORRECTIONS:
        res = correct(name, old, roll, mask)
        assert torch.isfinite(res.weights).all() and all(torch.isfinite(v) for v in res.metrics.values())
