"""The verl adapter: aisrl losses registered in verl's policy-loss registry and dispatched by name give
exactly aisrl.losses.grpo_loss with the aisrl correction; misconfigured rollout IS weights are explained.

verl pulls Ray and pins its own transformers, so it is not in the test extra; the tests that call verl skip
without it (the weight checks need only torch). Run them in an environment with verl:
pip install verl pytest && python -m pytest tests/test_integrations_verl.py
"""

import math

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
    rollout = -(old + 0.3 * torch.randn(n, t, generator=g)).abs()  # a real mismatch; log-probs are <= 0
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


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize(("name", "opts"), [("ais", {}), ("tis", {"cap": 2.0}), ("icepop", {}), ("none", {})])
def test_each_loss_equals_the_aisrl_loss_without_verl_installed(agg, name, opts, stub_verl):
    """What test_dispatched_loss_equals_aisrl_losses checks through verl's registry, on the loss functions themselves,
    with verl's agg_loss stubbed: it runs wherever torch does."""
    old, rollout, logp, adv, mask, w = batch()
    loss, metrics = make_policy_loss(name, **opts)(old, logp, adv, mask, agg, CFG, w)
    res = correct(name, old, rollout, mask, **opts)
    expect, _ = grpo_loss(logp, old, adv, res.mask, weights=res.weights, clip=(0.2, 0.28), dual_clip=3.0, agg=agg)
    assert torch.allclose(loss, expect, atol=1e-6, rtol=1e-5), (loss, expect)
    assert torch.allclose(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(expect, logp)[0], atol=1e-6)
    if name == "ais":
        assert metrics["aisrl/alpha"] == pytest.approx(res.metrics["alpha"].item()) and 0 < metrics["aisrl/alpha"] <= 1
    plain, _ = grpo_loss(logp, old, adv, mask, clip=(0.2, 0.28), dual_clip=3.0, agg=agg)
    assert (name == "none") == torch.allclose(loss, plain, atol=1e-6, rtol=1e-5)  # a correction changes the loss


def test_a_vetoed_loss_equals_the_aisrl_loss(stub_verl):
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


def test_weights_divided_by_their_batch_mean_are_refused_by_the_rollout_log_probs_they_imply(stub_verl):
    """verl's rollout_is_batch_normalize=true divides every weight by the batch mean; the loss would then recover
    rollout log-probs shifted by log(mean) (a sequence-level correction by T log(mean)). Weights divided by a mean
    above 1 imply a rollout log-prob above 0 on a token the sampler was sure of; raw ones never do. (A mean below 1
    leaves no such trace: the check cannot see it.)"""
    old, rollout, logp, adv, mask, w = batch(2)
    old[:, 0], rollout[:, 0] = -1e-4, -3e-4  # a token the sampler and the trainer were both sure of
    mask[:, 0] = True
    w = torch.exp(old - rollout) * mask
    assert check_raw_weights(w, mask, old_logp=old) is True  # raw: every implied rollout log-prob is <= 0
    mean = w[mask].mean()
    assert mean > 1.002  # by construction of batch(2): a mean that a normalisation divides away
    with pytest.raises(ValueError, match=r"imply a rollout log-prob of .* > 0.*rollout_is_batch_normalize") as e:
        check_raw_weights(w / 1.002, mask, old_logp=old)  # divided by a mean of 1.002: the token implies +0.0017
    assert all(x in str(e.value) for x in REQUIRED_SETTINGS)
    with pytest.raises(ValueError, match="rollout_is_batch_normalize"):
        make_policy_loss("seq_tis")(old, logp, adv, mask, "token-mean", CFG, torch.where(mask, w / mean, 0.0))


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


def test_weights_of_a_shared_prefix_tie_without_a_threshold():
    """Completions of one prompt that begin alike give those tokens the same log-probs on both sides, so the same
    raw weight; at the batch's largest weight that read as a cap, and stopped a correctly configured run."""
    old, rollout, logp, adv, mask, w = batch(4)
    old[:, 0], rollout[:, 0] = -0.5, -1.5  # every sequence starts with one token, weight e, the largest
    mask[:, 0] = True
    w = torch.exp(old - rollout) * mask
    assert (w == w.max()).sum() >= 3
    check_raw_weights(w, mask, old_logp=old)  # one trainer log-prob among the tied tokens: one token, repeated
    with pytest.raises(ValueError, match="look truncated"):
        check_raw_weights(w, mask)  # (without old_logp, tokens are counted: the check as it was)
    capped = torch.where(mask, w.clamp(max=1.1), 0.0)  # a cap ties tokens whose trainer log-probs differ
    with pytest.raises(ValueError, match="truncated at 1.1"):
        check_raw_weights(capped, mask, old_logp=old)


def test_a_missing_weight_names_the_settings(verl_algos):
    old, rollout, logp, adv, mask, w = batch(2)
    with pytest.raises(ValueError, match="rollout_is_threshold=inf"):
        verl_algos.get_policy_loss_fn((install(), "ais")[1])(old, logp, adv, mask, "token-mean", CFG, None)


def test_the_weights_are_checked_on_the_first_calls_only(stub_verl):
    """The settings are fixed for a run, so the heuristics (a tie at the maximum reads as a threshold) judge the
    first CHECKED_CALLS micro-batches; a later one whose raw weights happen to tie is not refused. Ties below the
    largest weight seen do not count. Missing weights are an error on every call."""
    from aisrl.integrations.verl import CHECKED_CALLS

    fn = make_policy_loss("tis", cap=2.0)
    old, rollout, logp, adv, mask, w = batch(2)
    fn(old, logp, adv, mask, "token-mean", CFG, w)
    fn(old, logp, adv, mask, "token-mean", CFG, w.clamp(max=w[mask].max() * 0.99))  # tied, but below the maximum
    top = w[mask].max()
    for seed in range(10, 10 + CHECKED_CALLS):  # other micro-batches: raw maxima of their own
        o, _, lp, a, m, ww = batch(seed)
        fn(o, lp, a, m, "token-mean", CFG, ww)
        top = max(top, ww[m].max())
    tied = w.clone()
    tied[0, :3] = 2 * top  # three tokens tied above every weight seen: read as a threshold among the first calls
    with pytest.raises(ValueError, match="truncated"):
        make_policy_loss("tis", cap=2.0)(old, logp, adv, mask, "token-mean", CFG, tied)
    fn(old, logp, adv, mask, "token-mean", CFG, tied)  # past them, not judged
    with pytest.raises(ValueError, match="no rollout_is_weights"):
        fn(old, logp, adv, mask, "token-mean", CFG, None)


def test_a_cap_few_tokens_reach_is_found_over_several_micro_batches(stub_verl):
    # verl's default threshold 2.0 under a mild mismatch: two tokens at the cap per micro-batch, never three in one
    fn = make_policy_loss("icepop")

    def capped_batch(seed):
        old, rollout, logp, adv, mask, w = batch(seed)
        capped = w.clamp(max=1.5)  # (before: taken for raw weights on the first call, then never checked again)
        capped[mask] = torch.where(capped[mask] >= 1.5, 1.0, capped[mask])
        rows, cols = mask.nonzero(as_tuple=True)
        capped[rows[:2], cols[:2]] = 2.0
        return old, logp, adv, mask, capped

    old, logp, adv, mask, two = capped_batch(2)
    fn(old, logp, adv, mask, "token-mean", CFG, two)
    fn(old, logp, adv, mask, "token-mean", CFG, two)  # the same micro-batch again (the next PPO epoch): counted once
    old, logp, adv, mask, two = capped_batch(3)
    with pytest.raises(ValueError, match="look truncated at 2"):
        fn(old, logp, adv, mask, "token-mean", CFG, two)


def test_raw_weights_replayed_over_ppo_epochs_are_not_taken_for_a_cap(stub_verl):
    # verl runs every micro-batch once per epoch: one token at the maximum read as three ties after three epochs
    fn = make_policy_loss("ais")
    old, rollout, logp, adv, mask, w = batch(0)
    assert int((w[mask] == w[mask].max()).sum()) == 1
    halves = [slice(0, 3), slice(3, 6)]
    for _ in range(3):  # ppo_epochs=3 over two micro-batches
        for h in halves:
            fn(old[h], logp[h], adv[h], mask[h], "token-mean", CFG, w[h])


def test_a_micro_batch_with_no_scored_token_leaves_the_alpha_ema_alone(stub_verl):
    fn = make_policy_loss("ais", ema=0.9)
    old, rollout, logp, adv, mask, w = batch(0)
    _, first = fn(old, logp, adv, mask, "token-mean", CFG, w)
    unscored = torch.full_like(w, float("nan"))  # the rollout engine could score no token of this one
    fn(old, logp, adv, mask, "token-mean", CFG, unscored)
    _, again = fn(old, logp, adv, mask, "token-mean", CFG, w)
    batch_alpha = again["aisrl/alpha_batch"]
    assert again["aisrl/alpha"] == pytest.approx(0.9 * first["aisrl/alpha"] + 0.1 * batch_alpha)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_a_micro_batch_that_keeps_no_token_has_loss_0_not_nan(stub_verl, agg):
    # verl's legacy path passes no global counts (CFG's global_batch_info is empty): agg_loss divides by the mask
    # verl's model-engine path fills global_batch_info but may leave its counts None: the same division by the mask
    no_counts = {**CFG, "global_batch_info": {"dp_size": 1, "batch_num_tokens": None, "global_batch_size": None}}
    old, rollout, logp, adv, mask, w = batch(0)
    for name, weights in (("icepop", w * 10), ("tis", torch.full_like(w, float("nan")))):  # all outside [0.5, 2]
        for cfg in (CFG, no_counts):
            loss, metrics = make_policy_loss(name)(old, logp, adv, mask, agg, cfg, weights)  # no token in the loss
            assert metrics["aisrl/mask_frac_token" if name == "icepop" else "aisrl/nonfinite_frac"] == 1.0
            assert loss.item() == 0.0 and loss.requires_grad  # before: NaN, which verl logs as the step's pg_loss
            assert torch.equal(torch.autograd.grad(loss, logp)[0], torch.zeros_like(logp))


def _older_verl_agg_loss(loss_mat, loss_mask, loss_agg_mode, **info):
    """agg_loss as some verl releases fall back without global counts: every sequence of the micro-batch counts (a
    wholly rejected one too), and a sequence's token mean divides by its own mask (0/0 for a rejected one)."""
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    per_seq = (loss_mat * mask).sum(-1)
    return (per_seq / mask.sum(-1) if loss_agg_mode == "seq-mean-token-mean" else per_seq).mean()


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_without_global_counts_the_loss_is_the_aisrl_loss_whatever_verls_fallback(stub_verl, agg, monkeypatch):
    """The legacy path passes no global counts; what verl's agg_loss then divides by differs between releases. The
    adapter aggregates over the kept tokens and sequences itself: the aisrl trainer's loss, with an older fallback
    in place too (which gave 1/6 of it for seq_mask here, or NaN)."""
    import sys

    monkeypatch.setattr(sys.modules["verl.trainer.ppo.core_algos"], "agg_loss", _older_verl_agg_loss)
    old, rollout, logp, adv, mask, w = batch(5)
    loss, metrics = make_policy_loss("seq_mask", low=0.7, high=1.4)(old, logp, adv, mask, agg, CFG, w)
    res = correct("seq_mask", old, rollout, mask, low=0.7, high=1.4)
    assert 0 < metrics["aisrl/mask_frac_seq"] < 1  # some sequences rejected whole, not all
    expect, _ = grpo_loss(logp, old, adv, res.mask, weights=res.weights, clip=(0.2, 0.28), dual_clip=3.0, agg=agg)
    assert torch.allclose(loss, expect, atol=1e-6, rtol=1e-5), (loss, expect)
    assert torch.allclose(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(expect, logp)[0], atol=1e-6)


def test_a_missing_verl_and_a_broken_one_are_told_apart(tmp_path, monkeypatch):
    """Any ImportError read as 'pip install verl', though verl pins its own transformers: an installed verl whose
    import fails on a dependency got advice that could not help."""
    import importlib.util
    import sys

    from aisrl.integrations import import_error

    not_installed = ModuleNotFoundError("No module named 'verl'", name="verl")
    assert str(import_error(not_installed, "verl", "FIX", "verl>=0.7")) == "FIX"
    too_old = ImportError("cannot import name 'GRPOTrainer' from 'trl'", name="trl")  # a TRL without it
    assert "trl is installed, but a version without what" in str(import_error(too_old, "trl", "FIX", "trl>=1"))
    if importlib.util.find_spec("verl") is None:  # the real thing, where verl is not installed
        with pytest.raises(ImportError, match=r"^aisrl.integrations.verl.install\(\) needs verl: pip install "
                                              r"'verl>=0.7'$"):  # fmt: skip
            install()
    for name in [m for m in sys.modules if m == "verl" or m.startswith("verl.")]:
        monkeypatch.delitem(sys.modules, name)
    (tmp_path / "verl").mkdir()
    (tmp_path / "verl" / "__init__.py").write_text("")  # a verl without verl.trainer.ppo: another version
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(ImportError, match=r"verl is installed, but a version without what aisrl uses "
                                              r"\(ModuleNotFoundError: .*verl.trainer.*pip install -U 'verl>=0.7'"):
            install()
        for name in [m for m in sys.modules if m == "verl" or m.startswith("verl.")]:
            del sys.modules[name]
        pkg = tmp_path / "verl" / "trainer" / "ppo"
        pkg.mkdir(parents=True)
        for folder in (tmp_path / "verl" / "trainer", pkg):
            (folder / "__init__.py").write_text("")
        (pkg / "core_algos.py").write_text("from transformers import NoSuchThingInThisVersion\n")
        with pytest.raises(ImportError, match=r"verl is installed but does not import \(ImportError: cannot import "
                                              r"name 'NoSuchThingInThisVersion'.*pip check"):  # fmt: skip
            install()
    finally:  # the fake package's modules, imported above, must not stand in for verl in later tests
        for name in [m for m in sys.modules if m == "verl" or m.startswith("verl.")]:
            del sys.modules[name]


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


def _verl_agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
                   loss_scale_factor=None):  # fmt: skip
    """verl's verl.trainer.ppo.core_algos.agg_loss (token-mean and the seq-mean modes) as verl documents it: with global
    batch information it divides by verl's global counts, not by the mask it is given, times dp_size to cancel the
    data-parallel gradient average. (Some verl releases divide the seq-mean modes by global_batch_size * dp_size, a
    dp_size**2 scale bug, verl PR #5798; the stub follows the intended, parallelism-invariant form.)"""
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        batch_num_tokens = mask.sum() if batch_num_tokens is None else batch_num_tokens
        return (loss_mat * mask).sum() / batch_num_tokens * dp_size
    seq_tokens = mask.sum(-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = (loss_mat * mask).sum(-1) / (seq_tokens + 1e-8)
    elif loss_agg_mode == "seq-mean-token-sum":
        seq_losses = (loss_mat * mask).sum(-1)
    else:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")
    seq_mask = (seq_tokens > 0).to(loss_mat.dtype)
    global_batch_size = seq_mask.sum() if global_batch_size is None else global_batch_size
    return (seq_losses * seq_mask).sum() / global_batch_size * dp_size


@pytest.fixture
def stub_verl(monkeypatch):
    """A stub verl.trainer.ppo.core_algos holding `_verl_agg_loss` (in place of verl, installed or not, for the test's
    duration), so that make_policy_loss's own import of agg_loss finds it."""
    import sys
    import types

    for name in ("verl", "verl.trainer", "verl.trainer.ppo", "verl.trainer.ppo.core_algos"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["verl.trainer.ppo.core_algos"].agg_loss = _verl_agg_loss


def test_a_nan_rollout_log_prob_on_the_first_call_is_dropped_not_refused(stub_verl):
    """verl's weights are exp(clamp(old - rollout, -20, 20)): clamp keeps NaN, so a token whose rollout log-prob is NaN
    arrives as a NaN weight. That is no misconfiguration: the token leaves the loss on the first micro-batch as on any
    later one (counted in nonfinite_frac), and the settings heuristics still judge the other tokens."""
    old, rollout, logp, adv, mask, w = batch(4)
    rollout[1, 2] = float("nan")  # one token the rollout engine could not score (inside sequence 1's 5 tokens)
    w = torch.exp((old - rollout).clamp(-20, 20)) * mask  # what verl passes: NaN at (1, 2)
    assert torch.isnan(w[1, 2])
    keep = mask.clone()
    keep[1, 2] = False  # worked out by hand: the NaN token out, every other valid token in
    w_tis = torch.where(keep, torch.exp(old - rollout).clamp(max=2.0), 0.0)
    for agg in ("token-mean", "seq-mean-token-mean"):
        fn = make_policy_loss("tis", cap=2.0)  # a fresh loss: this is its first call
        loss, metrics = fn(old, logp, adv, mask, agg, CFG, w)
        expect, _ = grpo_loss(logp, old, adv, keep, weights=w_tis, clip=(0.2, 0.28), dual_clip=3.0, agg=agg)
        assert torch.isfinite(loss) and torch.allclose(loss, expect, atol=1e-6, rtol=1e-5), (agg, loss, expect)
        g, g_expect = torch.autograd.grad(loss, logp)[0], torch.autograd.grad(expect, logp)[0]
        assert torch.isfinite(g).all() and torch.allclose(g, g_expect, atol=1e-6) and g[1, 2] == 0
        assert metrics["aisrl/nonfinite_frac"] == pytest.approx(1 / mask.sum().item())
    # the NaN does not blind the heuristics: truncated weights around it are still refused on a first call
    with pytest.raises(ValueError, match="truncated at 1.05"):
        make_policy_loss("tis")(old, logp, adv, mask, "token-mean", CFG, w.clamp(max=1.05))
    assert check_raw_weights(w, mask) is True
    # a first micro-batch whose weights are all NaN has nothing to judge: the next one is checked
    fn = make_policy_loss("tis")
    fn(old, logp, adv, mask, "token-mean", CFG, torch.full_like(w, float("nan")))
    with pytest.raises(ValueError, match="truncated at 1.05"):
        fn(old, logp, adv, mask, "token-mean", CFG, w.clamp(max=1.05))


def _kept_by_hand(name, old, rollout, mask):
    """(N, T) bool: the tokens a rejecting correction keeps, from its definition (aisrl.correction's docstring)."""
    w = torch.exp(old - rollout)
    if name == "icepop":  # token kept when w in [0.8, 1.25]
        return mask & (w >= 0.8) & (w <= 1.25)
    if name == "seq_mask":  # sequence kept when W = prod w in [0.7, 1.4]
        big_w = torch.exp(((old - rollout) * mask).sum(-1, keepdim=True))
        return mask & (big_w >= 0.7) & (big_w <= 1.4)
    vetoed = (mask & (w < 0.8)).any(-1, keepdim=True)  # tis with veto=0.8: sequences holding a w < 0.8 leave
    return mask & ~vetoed


@pytest.mark.parametrize("dp_size", [1, 2])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize(
    ("name", "opts"),
    [
        ("icepop", {"low": 0.8, "high": 1.25}),
        ("seq_mask", {"low": 0.7, "high": 1.4}),
        ("tis", {"cap": 2.0, "veto": 0.8}),
    ],
)
def test_with_verls_global_batch_counts_a_rejecting_loss_is_the_aisrl_loss_times_the_kept_fraction(
    name, opts, agg, dp_size, stub_verl
):
    """verl >= 0.7 passes global_batch_info (dp_size, batch_num_tokens, global_batch_size) counted from its response
    mask before the correction ran, so rejected tokens and sequences stay in the denominators: the adapter's loss
    (and step), summed over micro-batches (dp_size=1: gradient accumulation) or averaged over ranks (dp_size=2: each
    micro-batch one rank, as DDP averages), is aisrl's grpo_loss on the whole batch times the kept fraction, tokens
    for token-mean and sequences for the seq-mean modes. The documented convention (module docstring)."""
    old, rollout, logp, adv, mask, w = batch(5)
    keep = _kept_by_hand(name, old, rollout, mask)
    n_tok, n_seq = mask.sum().item(), mask.any(-1).sum().item()
    kept_tok, kept_seq = keep.sum().item(), keep.any(-1).sum().item()
    assert 0 < kept_tok < n_tok and kept_seq > 0  # a real rejection, not all of it
    frac = kept_tok / n_tok if agg == "token-mean" else kept_seq / n_seq
    if agg != "token-mean" and name == "icepop":
        assert kept_seq == n_seq  # icepop keeps every sequence here: only the token mean inside them changes
    info = {"dp_size": dp_size, "batch_num_tokens": n_tok, "global_batch_size": n_seq}  # counts over all ranks
    cfg = {**CFG, "global_batch_info": info}
    fn = make_policy_loss(name, **opts)
    total = sum(fn(old[s], logp[s], adv[s], mask[s], agg, cfg, w[s])[0] for s in (slice(0, 3), slice(3, 6)))
    total = total / dp_size
    w_token = {"icepop": torch.exp(old - rollout), "seq_mask": torch.ones_like(old),
               "tis": torch.exp(old - rollout).clamp(max=2.0)}[name]  # fmt: skip
    weights = torch.where(keep, w_token, 0.0)  # each correction's weights, by hand
    core, _ = grpo_loss(logp, old, adv, keep, weights=weights, clip=(0.2, 0.28), dual_clip=3.0, agg=agg)
    assert torch.allclose(total, core * frac, atol=1e-6, rtol=1e-5), (total, core, frac)
    g, g_core = torch.autograd.grad(total, logp)[0], torch.autograd.grad(core, logp)[0]
    assert torch.allclose(g, g_core * frac, atol=1e-6, rtol=1e-5)
    if frac < 1:
        assert not torch.allclose(total, core, atol=1e-6, rtol=1e-5)  # the relation has teeth: the two differ


# Found by mutation testing: each case below failed a plausible slip that the tests above let pass.


def _one(logp_minus_old, adv, cfg):
    old = torch.tensor([[-1.0]])
    logp = (old + logp_minus_old).requires_grad_(True)
    return make_policy_loss("none")(old, logp, torch.tensor([[adv]]), torch.tensor([[True]]), "token-mean", cfg,
                                    torch.ones(1, 1))


def test_asymmetric_clip_range(stub_verl):
    # ratio 1.25, A = +1, clip_ratio_low 0.2 / high 0.28: 1.25 lies inside [0.8, 1.28], so loss = -1.25 (unclipped)
    loss, m = _one(math.log(1.25), 1.0, CFG)
    assert loss.item() == pytest.approx(-1.25)
    assert m["actor/pg_clipfrac"] == 0.0
    # ratio 0.75, A = -1: below 1 - 0.2 = 0.8, so clipped at 0.8: -min(-0.75, -0.8) = 0.8
    loss, m = _one(math.log(0.75), -1.0, CFG)
    assert loss.item() == pytest.approx(0.8)
    assert m["actor/pg_clipfrac"] == 1.0


def test_dual_clip_default_is_3(stub_verl):
    # no clip_ratio_c in the config: verl's default 3.0. ratio 5, A = -1: -min(-5, -1.2) = 5, dual clip min(5, 3) = 3
    loss, m = _one(math.log(5.0), -1.0, {"clip_ratio": 0.2})
    assert loss.item() == pytest.approx(3.0)
    assert m["actor/pg_clipfrac_lower"] == 1.0


def test_ppo_kl_and_clipfrac_lower_signs(stub_verl):
    # ratio 1.25 (log 0.2231), A = +1: verl's ppo_kl = mean(old - logp) = -log 1.25; the dual clip is not active
    loss, m = _one(math.log(1.25), 1.0, CFG)
    assert m["actor/ppo_kl"] == pytest.approx(-math.log(1.25), rel=1e-5)
    # ratio 1.5, A = +1: clipped at 1.28 (pg_clipfrac 1) but dual clip (only for A < 0) not: lower frac 0
    loss, m = _one(math.log(1.5), 1.0, CFG)
    assert m["actor/pg_clipfrac"] == 1.0 and m["actor/pg_clipfrac_lower"] == 0.0


def test_one_token_responses_are_not_taken_for_sequence_weights():
    w = torch.tensor([[1.1, 0.0], [0.9, 0.0]])
    mask = torch.tensor([[True, False], [True, False]])
    assert check_raw_weights(w, mask) is True  # no sequence has 2 tokens: nothing to call constant


def test_two_constant_sequences_are_sequence_weights():
    with pytest.raises(ValueError, match="constant within every sequence"):
        check_raw_weights(torch.tensor([[1.1, 1.1], [0.9, 0.9]]), torch.ones(2, 2, dtype=torch.bool))


def test_replays_without_old_logp_are_counted_once():
    a = (torch.tensor([[1.5, 1.2]]), torch.ones(1, 2, dtype=torch.bool))
    tally = {"top": -math.inf}
    for b in (torch.tensor([[1.1, 1.05]]), torch.tensor([[1.3, 0.9]])):  # A, B, A, C, A: A's one top token, once
        check_raw_weights(*a, tally)
        check_raw_weights(b, a[1], tally)
    assert check_raw_weights(*a, tally) is True


def test_the_ais_ema_carries_alpha_across_different_micro_batches(stub_verl):
    fn = make_policy_loss("ais", ema=0.9)
    old, _, logp, adv, mask, w = batch(0)
    _, first = fn(old, logp, adv, mask, "token-mean", CFG, w)
    old, _, logp, adv, mask, w = batch(1)
    _, second = fn(old, logp, adv, mask, "token-mean", CFG, w)
    assert second["aisrl/alpha_batch"] != pytest.approx(first["aisrl/alpha"])  # different batches
    assert second["aisrl/alpha"] == pytest.approx(0.9 * first["aisrl/alpha"] + 0.1 * second["aisrl/alpha_batch"])
