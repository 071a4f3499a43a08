"""The verl adapter: aisrl losses registered in verl's policy-loss registry and dispatched by name give
exactly aisrl.losses.grpo_loss with the aisrl correction; misconfigured rollout IS weights are explained.

verl pulls Ray and pins its own transformers, so it is not in the test extra; the tests that call verl skip
without it (the weight checks need only torch). Run them in an environment with verl:
pip install verl pytest && python -m pytest tests/test_integrations_verl.py
"""

import pytest
import torch

from aisrl.correction import correct
from aisrl.integrations.verl import REQUIRED_SETTINGS, check_raw_weights, check_verl, install, make_policy_loss
from aisrl.losses import grpo_loss


@pytest.fixture
def verl_algos():
    return pytest.importorskip("verl.trainer.ppo.core_algos")


def batch(seed=0, n=6, t=8):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g) * 3
    rollout = old + 0.3 * torch.randn(n, t, generator=g)  # a real mismatch
    logp = (old + 0.05 * torch.randn(n, t, generator=g)).requires_grad_(True)
    adv = torch.randn(n, generator=g)[:, None].expand(n, t).contiguous()
    mask = torch.arange(t)[None] < torch.tensor([8, 5, 8, 3, 7, 6])[:, None]
    w = torch.exp(old - rollout) * mask  # what verl passes with rollout_is=token, threshold=inf
    return old, rollout, logp, adv, mask, w


CFG = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0, "global_batch_info": {}}


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize(
    ("loss_mode", "name", "opts"),
    [
        ("ais", "ais", {}),
        ("aisrl_tis", "tis", {"cap": 2.0}),
        ("aisrl_icepop", "icepop", {}),
        ("aisrl_none", "none", {}),
    ],
)
def test_dispatched_loss_equals_aisrl_losses(agg, loss_mode, name, opts, verl_algos):
    names = install()
    assert {"ais", "aisrl_ais", "aisrl_tis", "aisrl_seq_mask"} <= set(names)
    old, rollout, logp, adv, mask, w = batch()
    fn = verl_algos.get_policy_loss_fn(loss_mode)
    loss, metrics = fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask, loss_agg_mode=agg,
                       config=CFG, rollout_is_weights=w)  # fmt: skip
    res = correct(name, old, rollout, mask, **opts)
    expect, _ = grpo_loss(logp, old, adv, res.mask, weights=res.weights, clip=(0.2, 0.28), dual_clip=3.0, agg=agg)
    assert torch.allclose(loss, expect, atol=1e-6, rtol=1e-5), (loss, expect)
    g1 = torch.autograd.grad(loss, logp)[0]
    g2 = torch.autograd.grad(expect, logp)[0]
    assert torch.allclose(g1, g2, atol=1e-6)
    if name == "ais":
        assert metrics["aisrl/alpha"] == pytest.approx(res.metrics["alpha"].item())
        assert 0 < metrics["aisrl/alpha"] <= 1 and "aisrl/weight_reliability" in metrics
    assert {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"} <= set(metrics)


def test_with_verl_actor_config_and_vanilla_agreement(verl_algos):
    from verl.workers.config import ActorConfig, PolicyLossConfig

    install()
    old, rollout, logp, adv, mask, w = batch(1)
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_high=0.28,
                      policy_loss=PolicyLossConfig(loss_mode="aisrl_none"))  # fmt: skip
    ours, _ = verl_algos.get_policy_loss_fn("aisrl_none")(old, logp, adv, mask, "token-mean", cfg, w)
    # verl's own vanilla loss without IS weights is the uncorrected loss: the same number
    vanilla, _ = verl_algos.get_policy_loss_fn("vanilla")(old, logp, adv, mask, "token-mean", cfg, None)
    assert torch.allclose(ours, vanilla, atol=1e-6)


def test_a_vetoed_loss_equals_the_aisrl_loss(verl_algos):
    old, rollout, logp, adv, mask, w = batch()
    fn = make_policy_loss("tis", cap=2.0, veto=0.8)
    loss, metrics = fn(old, logp, adv, mask, "token-mean", CFG, w)
    res = correct("tis", old, rollout, mask, cap=2.0, veto=0.8)
    assert 0 < res.metrics["veto_frac_seq"] < 1 and metrics["aisrl/veto_frac_seq"] == pytest.approx(
        res.metrics["veto_frac_seq"].item())
    expect, _ = grpo_loss(logp, old, adv, res.mask, weights=res.weights, clip=(0.2, 0.28), dual_clip=3.0)
    assert torch.allclose(loss, expect, atol=1e-6, rtol=1e-5)


def test_weights_that_cannot_be_raw_are_explained():
    old, rollout, logp, adv, mask, w = batch(2)
    check_raw_weights(w, mask)  # the right configuration passes
    seq_w = torch.exp((old - rollout).mul(mask).sum(-1, keepdim=True)).expand_as(w) * mask  # rollout_is=sequence
    for bad, why in [(None, "no rollout_is_weights"), (w.clamp(max=1.05), "truncated at 1.05"),
                     (torch.where(w > 1.2, 0.0, w), "zeros"), (seq_w, "constant within")]:  # fmt: skip
        with pytest.raises(ValueError, match=why) as e:
            check_raw_weights(bad, mask)
        assert all(s in str(e.value) for s in REQUIRED_SETTINGS)


def test_weights_at_verls_safety_bound_are_raw_not_truncated():
    """verl computes exp(clamp(log-ratio, -20, 20)); tokens at that bound tie at exp(20) without any threshold.
    aisrl clamps log-ratios at the same 20 (aisrl.diagnostics.LOG_RATIO_CLAMP), so nothing is lost."""
    old, rollout, logp, adv, mask, w = batch(3)
    bound = torch.tensor(20.0).exp()
    w[0, :3] = bound  # three tokens whose rollout log-prob is far below the trainer's
    check_raw_weights(w, mask)
    w[0, :3] = 7.5  # a tie below the bound is a threshold
    with pytest.raises(ValueError, match="truncated at 7.5"):
        check_raw_weights(w, mask)


def test_a_missing_weight_names_the_settings(verl_algos):
    old, rollout, logp, adv, mask, w = batch(2)
    with pytest.raises(ValueError, match="rollout_is_threshold=inf"):
        verl_algos.get_policy_loss_fn((install(), "ais")[1])(old, logp, adv, mask, "token-mean", CFG, None)


def test_the_weights_are_checked_on_the_first_call_only(verl_algos):
    """The settings are fixed for a run, so the heuristics (a tie at the maximum reads as a threshold) run once; a
    later micro-batch whose raw weights happen to tie is not refused. Missing weights are an error on every call."""
    fn = make_policy_loss("tis", cap=2.0)
    old, rollout, logp, adv, mask, w = batch(2)
    fn(old, logp, adv, mask, "token-mean", CFG, w)
    fn(old, logp, adv, mask, "token-mean", CFG, w.clamp(max=1.05))  # would read as truncated on a first call
    with pytest.raises(ValueError, match="no rollout_is_weights"):
        fn(old, logp, adv, mask, "token-mean", CFG, None)


def test_verl_external_module_hook_registers_the_losses(tmp_path, verl_algos):
    import os
    import subprocess
    import sys

    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "aisrl.integrations.verl_plugin"}
    code = "import verl.trainer.ppo.core_algos as c; print(c.get_policy_loss_fn('ais').__name__)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("aisrl_ais_policy_loss")


def test_verl_older_than_the_interface_is_refused_with_the_version_needed():
    from types import SimpleNamespace

    def current(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                rollout_is_weights=None):  # fmt: skip
        pass

    def before_oct_2025(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                        rollout_log_probs=None):  # fmt: skip
        pass

    new = SimpleNamespace(compute_policy_loss_vanilla=current)
    old = SimpleNamespace(compute_policy_loss_vanilla=before_oct_2025)
    for algos, version in [(new, "0.7.0"), (new, "0.9.1.dev0"), (new, "1.0"), (new, "")]:
        check_verl(algos, version)  # accepted
    for algos, version in [(old, "0.5.0"), (old, "0.9.0"), (new, "0.6.1"), (SimpleNamespace(), "0.8.0")]:
        with pytest.raises(ImportError, match=r"need verl >= 0\.7 .*pip install -U 'verl>=0\.7'"):
            check_verl(algos, version)


def test_installed_verl_passes_the_version_check(verl_algos):
    from aisrl.integrations.verl import _verl_version

    check_verl(verl_algos, _verl_version())
