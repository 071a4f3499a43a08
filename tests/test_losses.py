"""grpo_loss and group_advantages against values computed by hand."""

import math

import pytest
import torch

from aisrl.losses import AGGREGATIONS, RATIO_LOG_CLAMP, clipped_surrogate, group_advantages, grpo_loss, tbpo_loss


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    std = math.sqrt(4 * 0.25 / 3)  # unbiased std of (1, 0, 0, 1)
    expected = [0.5 / (std + 1e-4), -0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0.5 / (std + 1e-4)] + [0.0] * 4
    torch.testing.assert_close(group_advantages(r, 4), torch.tensor(expected))
    torch.testing.assert_close(group_advantages(r, 4, scale=False), torch.tensor([0.5, -0.5, -0.5, 0.5] + [0.0] * 4))


def test_an_unscorable_completion_takes_no_part_in_its_group():
    nan, inf = float("nan"), float("inf")
    r = torch.tensor([1.0, nan, 0.0, 2.0, inf, nan, nan, 3.0, nan, nan, nan, nan])
    std = 1.0  # unbiased std of the scored (1, 0, 2)
    expected = [0.0, 0.0, -1.0 / (std + 1e-4), 1.0 / (std + 1e-4)] + [0.0] * 8  # a lone score has nothing to beat
    torch.testing.assert_close(group_advantages(r, 4), torch.tensor(expected))
    torch.testing.assert_close(group_advantages(r, 4, scale=False)[:4], torch.tensor([0.0, 0.0, -1.0, 1.0]))


@pytest.mark.parametrize("g", [1, 3])
def test_group_advantages_bad_group_size(g):
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(8), g)


def _one_token(ratio, adv, **kw):
    """(loss, metrics, d loss / d logp) of one token at `ratio`."""
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    old = torch.zeros(1, 1)
    loss, m = grpo_loss(logp, old, torch.tensor([adv]), torch.ones(1, 1, dtype=torch.bool), **kw)
    loss.backward()
    return loss.item(), m, logp.grad.item()


# The gradient of -A r with respect to log r is -A r where the unclipped term is the one taken, and 0 where a clip
# (or the dual clip) holds it: a clipped token must not push the policy further.
@pytest.mark.parametrize(
    "ratio,adv,expected,grad",
    [
        (1.5, 1.0, -1.2, 0.0),  # -min(1.5, 1.2): clipped
        (1.5, -1.0, 1.5, 1.5),  # -min(-1.5, -1.2): the unclipped term
        (0.5, 1.0, -0.5, -0.5),  # -min(0.5, 0.8): the unclipped term
        (0.5, -1.0, 0.8, 0.0),  # -min(-0.5, -0.8): clipped
        (1.1, 2.0, -2.2, -2.2),  # inside the trust region
    ],
)
def test_clipped_surrogate(ratio, adv, expected, grad):
    loss, _, g = _one_token(ratio, adv)
    assert loss == pytest.approx(expected, rel=1e-6) and g == pytest.approx(grad, abs=1e-6)


def test_asymmetric_clip_and_dual_clip():
    loss, _, g = _one_token(1.5, 1.0, clip=(0.2, 0.28))
    assert loss == pytest.approx(-1.28, rel=1e-6) and g == 0.0
    loss, m, g = _one_token(4.0, -1.0, dual_clip=3.0)  # -min(-4, -1.2) = 4, bounded by 3
    assert loss == pytest.approx(3.0) and m["pg_dual_clip_frac"] == 1.0 and g == 0.0
    loss, _, g = _one_token(4.0, 1.0, dual_clip=3.0)  # positive adv untouched by the dual clip; the clip holds it
    assert loss == pytest.approx(-1.2) and g == 0.0
    assert _one_token(2.5, -1.0, dual_clip=3.0)[2] == pytest.approx(2.5)  # under the dual bound: -A r


def test_aggregations_by_hand():
    # per-token loss at ratio 1 is -A * w; two sequences with 3 and 1 counted tokens, T = 4
    logp = torch.zeros(2, 4, requires_grad=True)
    adv = torch.tensor([1.0, 2.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    w = torch.tensor([[1.0, 2.0, 3.0, 9.0], [0.5, 9.0, 9.0, 9.0]])
    tok = [[-1.0, -2.0, -3.0], [-1.0]]
    expected = {
        "token-mean": (sum(tok[0]) + sum(tok[1])) / 4,
        "seq-mean-token-mean": (sum(tok[0]) / 3 + sum(tok[1]) / 1) / 2,
        "seq-mean-token-sum": (sum(tok[0]) + sum(tok[1])) / 2,
        "seq-mean-token-sum-norm": (sum(tok[0]) + sum(tok[1])) / (2 * 4),
    }
    assert set(expected) == set(AGGREGATIONS)
    for agg, value in expected.items():
        loss, _ = grpo_loss(logp, torch.zeros(2, 4), adv, mask, weights=w, agg=agg, horizon=4)
        assert loss.item() == pytest.approx(value), agg


def test_gradient_at_ratio_one_is_weighted_policy_gradient():
    logp = torch.zeros(2, 3, requires_grad=True)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    w = torch.tensor([[2.0, 0.5, 7.0], [1.0, 1.0, 3.0]])
    loss, _ = grpo_loss(logp, torch.zeros(2, 3), adv, mask, weights=w)
    loss.backward()
    expected = -(adv[:, None] * w * mask) / mask.sum()  # d/dlogp of -A r w, r = exp(logp - old)
    torch.testing.assert_close(logp.grad, expected)


def test_per_token_advantages_and_kl_to_reference():
    logp = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_(True)
    ref = torch.log(torch.tensor([[0.25, 0.25]]))
    adv = torch.tensor([[1.0, -1.0]])
    loss, m = grpo_loss(logp, logp.detach(), adv, torch.ones(1, 2, dtype=torch.bool), ref_logp=ref, kl_coef=0.1)
    k3 = (0.5 - 1 - math.log(0.5)) / 2  # token 1: exp(d) - d - 1 with d = log(0.25/0.5); token 2: 0
    assert m["kl_ref"].item() == pytest.approx(k3, rel=1e-5)
    assert loss.item() == pytest.approx((-1.0 + 1.0) / 2 + 0.1 * k3, rel=1e-5)


def test_empty_mask_gives_zero_loss_with_zero_gradient():
    logp = torch.randn(3, 4, requires_grad=True)
    old = torch.full((3, 4), float("nan"))  # padding garbage never leaks
    for agg in AGGREGATIONS:
        loss, m = grpo_loss(logp, old, torch.ones(3), torch.zeros(3, 4, dtype=torch.bool), agg=agg, horizon=4)
        (g,) = torch.autograd.grad(loss, logp)
        assert loss.item() == 0.0 and torch.equal(g, torch.zeros_like(g))
        assert all(torch.isfinite(v) for v in m.values())


def test_metrics_are_detached_scalars():
    logp = torch.randn(2, 3, requires_grad=True)
    _, m = grpo_loss(logp, logp.detach() + 0.3, torch.tensor([1.0, -1.0]), torch.ones(2, 3, dtype=torch.bool))
    assert {"loss", "pg_loss", "pg_clip_frac", "ratio_mean", "approx_kl", "kl_ref"} <= set(m)
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())
    # ratio e^-0.3 = 0.741 < 1 - 0.2 everywhere: the clipped term binds for A = -1 (-0.8 < -0.741), not for A = +1
    assert m["pg_clip_frac"].item() == pytest.approx(0.5)


def test_bad_arguments_are_clear_errors():
    x = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    adv = torch.zeros(2)
    with pytest.raises(ValueError, match="unknown aggregation 'mean'; choose from"):
        grpo_loss(x, x, adv, mask, agg="mean")
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        grpo_loss(x, x, adv, mask, dual_clip=0.5)
    with pytest.raises(ValueError, match="share one"):
        grpo_loss(x, x[:, :2], adv, mask)
    with pytest.raises(ValueError, match="needs ref_logp"):
        grpo_loss(x, x, adv, mask, kl_coef=0.1)
    for loss_fn, agg in ((grpo_loss, "token-mean"), (tbpo_loss, "seq-mean")):  # silently broadcast before
        with pytest.raises(ValueError, match=r"adv must be \(N,\) .* got \(1,\)"):
            loss_fn(x, x, torch.zeros(1), mask, agg=agg)
        with pytest.raises(ValueError, match=r"adv must be .* got \(3, 2\)"):
            loss_fn(x, x, torch.zeros(3, 2), mask, agg=agg)
        with pytest.raises(ValueError, match=r"weights must have logp's \(N, T\) shape \(2, 3\); got \(3,\)"):
            loss_fn(x, x, adv, mask, weights=torch.ones(3), agg=agg)
        with pytest.raises(ValueError, match=r"ref_logp must have .* got \(2, 1\)"):
            loss_fn(x, x, adv, mask, ref_logp=torch.zeros(2, 1), kl_coef=0.1, agg=agg)
        loss_fn(x, x, torch.zeros(2, 3), mask, weights=torch.ones(2, 3), agg=agg)  # (N, T) advantages are fine
        # a NaN dual clip, or a clip band whose top lies under its bottom, made the loss NaN or its gradient 0
        with pytest.raises(ValueError, match="dual_clip must be > 1"):
            loss_fn(x, x, adv, mask, dual_clip=float("nan"), agg=agg)
        for clip in ((0.2, -0.5), (float("nan"), 0.2), (1.0, 0.2), (0.2,), 0.2):  # 0.2: was a TypeError of len()
            with pytest.raises(ValueError, match=r"clip must be \(low, high\) with 0 <= low < 1 and high >= 0"):
                loss_fn(x, x, adv, mask, clip=clip, agg=agg)
        loss_fn(x, x, adv, mask, clip=(0.0, float("inf")), agg=agg)  # no clip above: allowed
    with pytest.raises(ValueError, match=r"clip must be"):
        clipped_surrogate(x, x, adv, mask, (0.2, -0.5))
    for horizon in (True, 8.0, 0):  # True is an int to Python, and would have been a horizon of 1
        with pytest.raises(ValueError, match=r"a positive int .* got horizon="):
            grpo_loss(x, x, adv, mask, agg="seq-mean-token-sum-norm", horizon=horizon)


def test_approx_kl_keeps_its_precision_for_a_tiny_mismatch():
    # k3 = exp(d) - 1 - d ~ d^2 / 2: in float32 exp(d) - 1 - d is rounding noise at |d| ~ 1e-5 (and can be < 0)
    g = torch.Generator().manual_seed(0)
    logp = -5 * torch.rand(4, 1024, generator=g)
    old = logp + 1e-5 * torch.randn(4, 1024, generator=g)
    d = (logp - old).double()
    exact = (torch.expm1(d) - d).mean().item()  # float64: about 5e-11
    for loss_fn, agg in ((grpo_loss, "token-mean"), (tbpo_loss, "seq-mean")):
        _, m = loss_fn(logp, old, torch.ones(4), torch.ones(4, 1024, dtype=torch.bool), agg=agg)
        assert m["approx_kl"].item() == pytest.approx(exact, rel=0.05)


def test_sum_norm_uses_a_constant_horizon_not_the_padded_width():
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, 1.0])
    kw = {"agg": "seq-mean-token-sum-norm", "horizon": 8}
    loss, _ = grpo_loss(logp, torch.zeros(2, 3), adv, mask, **kw)
    wide = torch.zeros(2, 9, requires_grad=True)  # the same batch padded to a wider tensor
    mask_wide = torch.zeros(2, 9, dtype=torch.bool)
    mask_wide[:, :3] = mask
    loss_wide, _ = grpo_loss(wide, torch.zeros(2, 9), adv, mask_wide, **kw)
    assert loss.item() == loss_wide.item() == pytest.approx(-3 / (2 * 8))
    with pytest.raises(ValueError, match="needs horizon="):
        grpo_loss(logp, torch.zeros(2, 3), adv, mask, agg="seq-mean-token-sum-norm")


def test_non_finite_log_ratio_at_a_counted_token_does_not_poison_the_loss():
    inf = float("inf")
    logp = torch.tensor([[-1.0, -inf, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -inf, -inf]])  # -inf - -inf = NaN; -2 - -inf = +inf
    loss, m = grpo_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 3, dtype=torch.bool))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert all(torch.isfinite(v) for v in m.values())
    # by hand, A = -1 so a token's term is max(r, clip(r)): token 0 has r = 1; the NaN log-ratio counts as 0 (r = 1);
    # the +inf one is clamped to 20 (r = e^20). Token mean (2 + e^20) / 3; only token 0 has a gradient (r' = 1, / 3)
    assert loss.item() == pytest.approx((2 + math.exp(20)) / 3, rel=1e-6)
    assert logp.grad.tolist() == [[pytest.approx(1 / 3), 0.0, 0.0]]


def test_tbpo_matches_its_formula_on_hand_made_inputs():
    from aisrl.losses import LOSSES, tbpo_loss

    assert LOSSES["tbpo"] is tbpo_loss
    old = torch.zeros(4, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    # mean log-ratios per sequence: 0.1, ln 2 (ratio 2), ln 0.1 (ratio 0.1), empty
    logp = torch.tensor([[0.05, 0.15, 9.0], [math.log(2)] * 3, [math.log(0.1), 5.0, 5.0], [1.0, 1.0, 1.0]])
    logp.requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, -2.0, 5.0])
    loss, m = tbpo_loss(logp, old, adv, mask, clip=(0.2, 0.2), dual_clip=3.0)
    s0, s1, s2 = math.exp(0.1), 2.0, 0.1
    l0 = -min(s0 * 1.0, min(s0, 1.2) * 1.0)  # inside the band: -s0
    l1 = min(max(1.0 * s1, 1.0 * 1.2), 3.0)  # A = -1: max(2, 1.2) = 2, under the dual bound 3
    l2 = min(max(2.0 * s2, 2.0 * 0.8), 3.0 * 2.0)  # A < 0, ratio below the band: max(0.2, 1.6) = 1.6
    assert loss.item() == pytest.approx((l0 + l1 + l2) / 3, rel=1e-6)
    assert m["pg_clip_frac"].item() == pytest.approx(1 / 3) and m["pg_dual_clip_frac"].item() == 0
    # dual clip binds when the ratio is large and the advantage negative: s = e^2, A = -1 -> min(e^2, 3) = 3
    big = torch.full((1, 2), 2.0, requires_grad=True)
    loss_d, m_d = tbpo_loss(big, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2, dtype=torch.bool))
    assert loss_d.item() == pytest.approx(3.0) and m_d["pg_dual_clip_frac"].item() == 1.0
    loss_d.backward()
    assert torch.equal(big.grad, torch.zeros(1, 2))  # the dual clip is flat
    # gradient of an unclipped sequence: d(-A s)/d logp_t = -A s / |o|
    loss.backward()
    assert torch.allclose(logp.grad[0, :2], torch.full((2,), -s0 / 2 / 3)) and logp.grad[0, 2] == 0
    # sequence weights: the masked mean of token weights multiplies each sequence's term
    w = torch.tensor([[2.0, 4.0, 100.0], [1.0, 1.0, 1.0], [0.5, 9.0, 9.0], [1.0, 1.0, 1.0]])
    lw, _ = tbpo_loss(logp.detach(), old, adv, mask, weights=w, dual_clip=3.0)
    assert lw.item() == pytest.approx((3.0 * l0 + l1 + 0.5 * l2) / 3, rel=1e-6)
    # per-token advantages are averaged over the mask; off-mask values, even NaN or inf, never enter
    adv_t = adv[:, None].expand(4, 3).clone()
    adv_t[0, 2], adv_t[2, 1] = float("nan"), float("inf")
    lt, _ = tbpo_loss(logp.detach(), old, adv_t, mask, clip=(0.2, 0.2), dual_clip=3.0)
    assert lt.item() == pytest.approx(loss.item(), rel=1e-6)
    with pytest.raises(ValueError, match="agg must be 'seq-mean'"):
        tbpo_loss(logp, old, adv, mask, agg="token-mean")


@pytest.mark.parametrize("loss_fn", [grpo_loss, tbpo_loss])
def test_losses_take_advantages_and_weights_from_another_device(loss_fn):
    """Rewards live on the CPU while log-probs are on the accelerator; 'meta' stands in for a GPU here."""
    logp = torch.zeros(4, 3, device="meta", requires_grad=True)
    old, mask = torch.zeros(4, 3, device="meta"), torch.ones(4, 3, dtype=torch.bool, device="meta")
    adv, weights = torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.ones(4, 3)  # CPU
    loss, metrics = loss_fn(logp, old, adv, mask, weights=weights, ref_logp=torch.zeros(4, 3), kl_coef=0.1)
    assert loss.device.type == "meta" and all(v.device.type == "meta" for v in metrics.values())


@pytest.mark.parametrize("loss_fn", [grpo_loss, tbpo_loss])
def test_kl_metrics_stay_finite_for_extreme_log_ratios(loss_fn):
    logp = torch.tensor([[100.0, 0.0], [-math.inf, 0.0]])
    old = torch.zeros(2, 2)
    _, m = loss_fn(logp, old, torch.tensor([1.0, -1.0]), torch.ones(2, 2, dtype=torch.bool),
                   ref_logp=torch.zeros(2, 2), kl_coef=0.1)  # fmt: skip
    bound = math.exp(RATIO_LOG_CLAMP)  # the k3 of the clamped log-ratio, the largest a token can give
    for key in ("approx_kl", "kl_ref"):
        assert math.isfinite(m[key].item()) and 0 < m[key].item() <= bound, key
    # and exactly: approx_kl is k3 of the clamped log-ratios (+20, 0, -20, 0) over the 4 tokens; kl_ref is k3 of
    # ref - logp clamped to -20 at the 100 token, 0 elsewhere, the -inf token skipped and counted (19 / 4)
    k3 = lambda d: math.expm1(d) - d  # noqa: E731
    assert m["approx_kl"].item() == pytest.approx((k3(20.0) + k3(-20.0)) / 4, rel=1e-6)
    assert m["kl_ref"].item() == pytest.approx(k3(-20.0) / 4, rel=1e-6) and m["kl_ref_skipped_frac"].item() == 0.25


@pytest.mark.parametrize("loss_fn", [grpo_loss, tbpo_loss])
def test_kl_to_reference_of_a_token_impossible_under_both_is_not_nan(loss_fn):
    inf = float("inf")
    logp = torch.tensor([[-1.0, -inf]], requires_grad=True)  # the second token is outside both nuclei
    ref = torch.tensor([[-1.5, -inf]])  # -inf - -inf = NaN
    loss, m = loss_fn(logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool),
                      ref_logp=ref, kl_coef=0.1)  # fmt: skip
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    k3 = math.exp(-0.5) + 0.5 - 1  # the first token's; the NaN one counts as no divergence
    assert m["kl_ref"].item() == pytest.approx(k3 / 2, rel=1e-5)


@pytest.mark.parametrize("loss_fn", [grpo_loss, tbpo_loss])
def test_bf16_log_probs_keep_the_weights_exact(loss_fn):
    """Small AIS weights such as 1.0015 round to 1 in BF16; the loss upcasts BF16 log-probs to FP32 so they do not."""
    w = torch.tensor([[1.0015, 0.9985, 1.003, 1.0]])
    logp = torch.zeros(1, 4, dtype=torch.bfloat16, requires_grad=True)
    agg = {"agg": "seq-mean"} if loss_fn is tbpo_loss else {}
    loss, _ = loss_fn(logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 4, dtype=torch.bool), weights=w, **agg)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(-w.mean().item(), rel=1e-6)  # -A mean_t(w_t r_t) at r = 1: -1.000750
    loss.backward()
    assert logp.grad.dtype == torch.bfloat16 and torch.isfinite(logp.grad.float()).all()


@pytest.mark.parametrize("loss_name", ["grpo", "tbpo"])
def test_reference_kl_skips_tokens_outside_a_truncated_support(loss_name):
    # top-k = 2: the trainer's processed distribution gives token 2 of the second position no probability, so its
    # log-prob is -inf; its k3 would be exp(20) with a zero gradient. It leaves the KL term and is counted instead.
    from aisrl.losses import LOSSES
    from aisrl.rollout import SamplingParams, process_logits

    logits = torch.tensor([[[0.3, 1.0, -0.5], [0.3, 1.0, -0.5]]], requires_grad=True)  # (1, 2, V)
    logp = process_logits(logits, SamplingParams(top_k=2)).gather(-1, torch.tensor([[[1], [2]]])).squeeze(-1)
    assert torch.isfinite(logp[0, 0]) and logp[0, 1] == -math.inf
    old, ref = logp.detach().clone(), torch.tensor([[-0.9, -1.1]])
    old[0, 1] = -1.2
    mask, adv = torch.ones(1, 2, dtype=torch.bool), torch.tensor([1.0])
    loss, m = LOSSES[loss_name](logp, old, adv, mask, ref_logp=ref, kl_coef=0.05)
    loss.backward()
    x = ref[0, 0].item() - logp[0, 0].item()
    assert m["kl_ref"].item() == pytest.approx((math.exp(x) - x - 1) / 2, rel=1e-5)  # token 1's k3 over 2 tokens
    assert m["kl_ref_skipped_frac"].item() == 0.5
    assert torch.isfinite(loss) and loss.abs().item() < 10 and torch.isfinite(logits.grad).all()
    no_ref, m0 = LOSSES[loss_name](logp.detach(), old, adv, mask)
    assert m0["kl_ref_skipped_frac"].item() == 0.0


def test_surrogate_edge_cases_by_hand():
    """Values worked out by hand where a plausible slip in the code would change them (found by mutation testing)."""
    # the old policy is a constant: with old_logp the very tensor logp (on-policy), r = 1 and dl/dlogp = -A / N_tok
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    loss, _ = grpo_loss(logp, logp, torch.tensor([2.0]), torch.ones(1, 3, dtype=torch.bool))
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.full((1, 3), -2 / 3))
    # a token inside the band is not clipped: ratios 1 and e^0.5 > 1.2, so half the tokens are
    _, m = grpo_loss(torch.tensor([[-1.0, -0.5]]), torch.tensor([[-1.0, -1.0]]), torch.tensor([1.0]),
                     torch.ones(1, 2, dtype=torch.bool))  # fmt: skip
    assert m["pg_clip_frac"].item() == pytest.approx(0.5)
    # weights off the mask (padding) never reach the loss, NaN included: -A r w / N_tok = -1 x 1 x 2 / 1
    loss, _ = grpo_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([1.0]), torch.tensor([[True, False]]),
                        weights=torch.tensor([[2.0, float("nan")]]))  # fmt: skip
    assert loss.item() == -2.0


def test_clip_flags_are_off_at_equality():
    """A clip that changes nothing is not counted active: at r = 1 with clip (0, 0) the clipped and unclipped
    terms are equal; at r = 2 exactly (exp of FP32 log 2) with A = -1/2 the loss -A r = 1 equals the dual clip's
    bound -A c = 1 for c = 2, and is bounded (flagged) for c = 1.5 (found by mutation testing)."""
    one = torch.ones(1, 1, dtype=torch.bool)
    _, m = grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.tensor([1.0]), one, clip=(0.0, 0.0))
    assert m["pg_clip_frac"].item() == 0.0
    logp = torch.tensor([[math.log(2.0)]])
    assert logp.exp().item() == 2.0
    for c, flagged, loss_value in ((2.0, 0.0, 1.0), (1.5, 1.0, 0.75)):
        loss, m = grpo_loss(logp, torch.zeros(1, 1), torch.tensor([-0.5]), one, clip=(0.2, 0.2), dual_clip=c)
        assert m["pg_dual_clip_frac"].item() == flagged, c
        assert loss.item() == pytest.approx(loss_value), c
