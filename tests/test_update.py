"""The GRPO update step (aisrl.update): what it logs over several epochs."""

from types import SimpleNamespace

import pytest
import torch

import aisrl.update as up


def test_grad_norm_is_the_mean_over_epochs_like_the_other_metrics(monkeypatch):
    model = torch.nn.Linear(2, 1, bias=False)
    grads = iter([torch.tensor([[3.0, 4.0]]), torch.tensor([[0.0, 1.0]])])  # norms 5 and 1

    def one_epoch(*args):
        model.weight.grad = next(grads).clone()
        return {"loss": 2.0}

    monkeypatch.setattr(up, "accumulate_gradient", one_epoch)
    cfg = SimpleNamespace(epochs=2, grad_clip=100.0)
    res = SimpleNamespace(mask=torch.ones(1, 3, dtype=torch.bool))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    acc = up.policy_update(cfg, model, None, opt, None, None, None, res, None, None)
    assert acc["grad_norm"] == pytest.approx(3.0) and acc["loss"] == pytest.approx(2.0)
    assert acc["update_skipped"] == 0.0


def test_update_seconds_add_up_over_epochs_and_metrics_average(monkeypatch):
    model = torch.nn.Linear(2, 1, bias=False)
    calls = []

    def one_epoch(*args):
        calls.append(1)
        model.weight.grad = torch.ones_like(model.weight)
        return {"loss": float(len(calls)), "time_forward": 0.5, "time_backward": 1.5}  # 1, 2, 3

    monkeypatch.setattr(up, "accumulate_gradient", one_epoch)
    cfg = SimpleNamespace(epochs=3, grad_clip=1.0)
    res = SimpleNamespace(mask=torch.ones(1, 3, dtype=torch.bool))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = up.policy_update(cfg, model, None, sgd, None, None, None, res, None, None)
    assert len(calls) == 3 and acc["loss"] == pytest.approx(2.0)  # metrics: means over epochs (not the last's 3)
    assert acc["time_forward"] == pytest.approx(1.5) and acc["time_backward"] == pytest.approx(4.5)  # seconds: sums
    assert 0.0 < acc["time_optimizer"] < 5.0


def test_grad_norm_with_clipping_off_measures_and_leaves_the_gradients_alone():
    from aisrl.update import _grad_norm

    a, b, c = (torch.nn.Parameter(torch.zeros(n)) for n in (3, 2, 4))
    a.grad, b.grad = torch.tensor([1.0, 2.0, 2.0]), torch.tensor([0.0, 4.0])  # c has no gradient
    assert _grad_norm([a, b, c]) == 5.0 == torch.nn.utils.clip_grad_norm_([a, b, c], 100.0).item()
    a.grad = torch.tensor([1.0, float("inf"), 2.0])  # one bad value: reported, and no other value is touched
    assert _grad_norm([a, b, c]) == float("inf")
    assert torch.equal(b.grad, torch.tensor([0.0, 4.0])) and a.grad[0] == 1.0 and a.grad[2] == 2.0


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_a_non_finite_gradient_takes_no_step(monkeypatch, clip):
    # before: clipping scaled inf to NaN (or Adam divided inf by inf), and the weights stayed NaN for good
    model = torch.nn.Linear(2, 1, bias=False)
    grads = iter([torch.tensor([[float("inf"), 1.0]]), torch.tensor([[1.0, 1.0]])])

    def one_epoch(*args):
        model.weight.grad = next(grads).clone()
        return {"loss": 1.0}

    monkeypatch.setattr(up, "accumulate_gradient", one_epoch)
    before = model.weight.detach().clone()
    res = SimpleNamespace(mask=torch.ones(1, 3, dtype=torch.bool))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    acc = up.policy_update(SimpleNamespace(epochs=1, grad_clip=clip), model, None, opt, None, None, None, res, None,
                           None)  # fmt: skip
    assert acc["update_skipped"] == 1.0 and acc["grad_norm"] == float("inf")
    assert torch.equal(model.weight.detach(), before) and not opt.state  # no step: Adam holds no moments either
    acc = up.policy_update(SimpleNamespace(epochs=1, grad_clip=clip), model, None, opt, None, None, None, res, None,
                           None)  # fmt: skip
    assert acc["update_skipped"] == 0.0 and torch.isfinite(model.weight).all() and not model.weight.equal(before)


def test_guard_copies_no_frozen_weight_even_one_tied_under_a_second_name():
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 5, bias=False))
    model[2].weight = model[0].weight  # tied, as an LM head to its embeddings
    model[0].weight.requires_grad_(False)
    guard = up.MismatchGuard(4.0)
    guard.save(model, torch.optim.SGD(model[1].parameters(), lr=0.1))
    assert sorted(guard.saved[0]) == ["1.bias", "1.weight"]  # before: "2.weight", the frozen embedding, was copied
    guard.forget()
    assert guard.saved is None and not guard.restore(model, None)


def test_a_step_with_every_token_rejected_is_skipped_whole_at_any_epoch_count(monkeypatch):
    # the trainer tests update_skipped == 1 to know nothing moved; before, six epochs summed 1/6 six times to 0.999...
    model = torch.nn.Linear(2, 1, bias=False)

    def one_epoch(*args):
        model.weight.grad = torch.ones_like(model.weight)
        return {"loss": 0.0}

    monkeypatch.setattr(up, "accumulate_gradient", one_epoch)
    nothing = SimpleNamespace(mask=torch.zeros(1, 3, dtype=torch.bool))
    for epochs in (1, 3, 6, 7, 10):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        acc = up.policy_update(SimpleNamespace(epochs=epochs, grad_clip=1.0), model, None, opt, None, None, None,
                               nothing, None, None)  # fmt: skip
        assert acc["update_skipped"] == 1.0, epochs


@pytest.mark.parametrize(("loss", "agg"), [("grpo", "token-mean"), ("grpo", "seq-mean-token-mean"),
                                          ("grpo", "seq-mean-token-sum"), ("grpo", "seq-mean-token-sum-norm"),
                                          ("tbpo", "seq-mean")])  # fmt: skip
def test_micro_batches_accumulate_the_full_batch_gradient_and_metrics(loss, agg):
    # every row its own parameter row: logp = old + theta, so ratios are exp(theta), some clipped; one row has no
    # token. Micro-batches of 3 in a shuffled order must give the one-batch gradient and metrics, for every loss
    gen = torch.Generator().manual_seed(0)
    n, t = 10, 6
    theta = torch.nn.Parameter(torch.randn(n, t, generator=gen) * 0.3)
    old = -torch.rand(n, t, generator=gen) * 2
    mask = torch.rand(n, t, generator=gen) > 0.3
    mask[4] = False
    adv, w = torch.randn(n, generator=gen), 0.5 + torch.rand(n, t, generator=gen)

    class Rows:
        def __init__(self, idx):
            self.idx, self.completion_ids = idx, torch.zeros(len(idx), t)

        def select(self, part):
            return Rows(self.idx[part])

    res = SimpleNamespace(mask=mask, weights=w)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    out = {}
    for micro in (n, 3):
        cfg = SimpleNamespace(loss=loss, agg=agg, dual_clip=None, micro_batch=micro, clip_low=0.2, clip_high=0.2,
                              kl_coef=0.0, rollout=SimpleNamespace(max_new_tokens=t))  # fmt: skip
        theta.grad = None
        m = up.accumulate_gradient(cfg, torch.nn.Linear(1, 1), None, Rows(torch.arange(n)), old, adv, res,
                                   lambda model, rows: old[rows.idx] + theta[rows.idx], order)  # fmt: skip
        out[micro] = theta.grad.clone(), {k: v for k, v in m.items() if not k.startswith("time")}
    (g_full, m_full), (g_micro, m_micro) = out[n], out[3]
    assert g_full.abs().max() > 0 and (g_full[4] == 0).all()  # something to learn, nothing from the empty row
    # and the one pass is the loss of aisrl.losses on the whole batch: its denominators count the rows and tokens that
    # hold a token (row 4 holds none), not every row
    from aisrl.losses import LOSSES

    theta.grad = None
    direct, _ = LOSSES[loss](old + theta, old, adv, mask, weights=w, clip=(0.2, 0.2), agg=agg if loss == "grpo" else
                             "seq-mean", dual_clip=3.0 if loss == "tbpo" else None, horizon=t)  # fmt: skip
    direct.backward()
    torch.testing.assert_close(g_full, theta.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g_micro, g_full, rtol=1e-5, atol=1e-7)
    assert m_micro.keys() == m_full.keys() and all(m_micro[k] == pytest.approx(m_full[k], abs=1e-6) for k in m_full)


def test_guard_history_from_a_checkpoint_keeps_its_last_finite_window():
    # a resumed run's baseline: the newest `window` finite k3s (a checkpoint of a longer window, or NaN steps)
    guard = up.MismatchGuard(4.0, window=4, history=[1.0, float("nan"), 1.0, 1.0, 1.0, 5.0, float("inf"), 6.0, 7.0])
    assert guard.history == [1.0, 5.0, 6.0, 7.0]
    assert up.MismatchGuard(0.0, window=4, history=[1.0, 2.0]).history == []  # off: nothing kept
