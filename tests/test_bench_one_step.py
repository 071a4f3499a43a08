"""One training step observed from outside (aisrl.bench.one_step), and the bias/noise split built on it
(benchmarks/gradient_bias.py)."""

import json

import pytest
import torch
from conftest import TINY_LAB, load_benchmark, varying_reward

from aisrl.bench.one_step import one_step
from aisrl.branch import recorded_base
from aisrl.train_config import load_config
from aisrl.trainer import train

FP8 = [*TINY_LAB, "rollout.quant=fp8_e4m3_w8a8", "lab.hidden=64"]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AISRL_CACHE", str(tmp_path / "cache"))
    # a reward that varies with the completion, so advantages are not all zero and gradients are not either
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)


def test_the_gradient_is_linear_in_the_weights_so_a_pinned_alpha_lies_on_the_segment():
    _, g_none = one_step("lab", [*FP8, "correction.name=none"])
    _, g_tis = one_step("lab", [*FP8, "correction.name=tis"])
    row, g_half = one_step("lab", [*FP8, "correction.name=ais", "correction.alpha=0.5"])
    assert row["step"] == 1 and row["k3_kl"] > 0  # a real mismatch, so the two ends differ
    assert (g_none - g_tis).norm() > 1e-3 * g_none.norm()
    torch.testing.assert_close(g_half, 0.5 * (g_none + g_tis), rtol=1e-4, atol=1e-6)


def test_the_correction_named_is_trained_whatever_the_base_calibrates_or_guards():
    # a base that calibrates would train its pick in place of correction.name (before: none and tis identical)
    extra = ["correction.calibrate_every=1", "correction.guard=4"]
    _, g_none = one_step("lab", [*FP8, *extra, "correction.name=none"])
    _, g_tis = one_step("lab", [*FP8, *extra, "correction.name=tis"])
    assert (g_none - g_tis).norm() > 1e-3 * g_none.norm()
    torch.testing.assert_close(g_tis, one_step("lab", [*FP8, "correction.name=tis"])[1])


def test_more_than_one_epoch_is_refused():
    """policy_update steps the optimizer each epoch: the gradient left at the end is not the step's first one."""
    with pytest.raises(ValueError, match="epochs=2: one_step reads the step's first gradient"):
        one_step("lab", [*FP8, "epochs=2"])


def test_a_hook_changes_what_is_trained_on_and_the_originals_come_back():
    import aisrl.trainer as trainer

    before = trainer.correct, trainer.policy_update, trainer.evaluate
    seen = []

    def zero(name, old_logp, rollout_logp, mask, res):
        seen.append(name)
        return res._replace(weights=torch.zeros_like(res.weights))

    _, g = one_step("lab", [*FP8, "correction.name=tis"], hook=zero)
    assert seen == ["tis"] and g.abs().max() == 0  # weights 0 on every token: nothing to learn from
    assert (trainer.correct, trainer.policy_update, trainer.evaluate) == before


def test_from_a_checkpoint_it_reproduces_the_runs_next_step(tmp_path):
    out = tmp_path / "run"
    train(load_config("lab", [*FP8, "max_steps=3", "checkpoint_every=2", "grad_clip=100", f"output_dir={out}"]),
          log=lambda _: None)  # fmt: skip
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][2]
    assert logged["step"] == 3
    row, g = one_step(recorded_base(out), [], start=(out, 2))  # salt 0: the run's own samples for step 3
    assert row["step"] == 3 and row["reward"] == logged["reward"]
    assert g.norm().item() == pytest.approx(logged["grad_norm"], rel=1e-4)  # the run's norm before clipping
    with pytest.raises(ValueError, match="no config.json"):
        recorded_base(tmp_path)


def synthetic(seed: int, K: int, P: int = 500):
    """(g, b, noise): a true gradient with |g|^2 = 1 (every figure is in these units), a bias with |b|^2 = 0.64,
    and noise(var) -> (K, P) rows with E|e|^2 = var, all drawn from one generator."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(P, generator=gen)
    g *= 1 / g.norm()
    b = torch.randn(P, generator=gen)
    b *= 0.8 / b.norm()
    return g, b, lambda var: torch.randn(K, P, generator=gen) * (var / P) ** 0.5


def test_bias_noise_split_and_best_alpha_match_their_closed_forms():
    gb = load_benchmark("gradient_bias")
    g, b, noise = synthetic(0, K=400)
    g_ref = g + noise(0.5)
    g_none = g + b + noise(0.2)  # biased, quieter
    g_tis = g + noise(1.0)  # unbiased, noisier; independent of g_none
    res = gb.measure(g_ref, {"none": g_none, "tis": g_tis}, [1, 10])
    assert res["true_grad_norm2"] == pytest.approx(1.0, abs=0.02)
    assert res["ref"]["var"] == pytest.approx(0.5, rel=0.05)
    assert res["none"]["bias2"] == pytest.approx(0.64, abs=0.03)
    assert 0 < res["none"]["bias2_se"] < 0.03 and abs(res["none"]["bias2"] - 0.64) < 4 * res["none"]["bias2_se"]
    assert res["none"]["var"] == pytest.approx(0.2, rel=0.05)
    assert res["tis"]["bias2"] == pytest.approx(0.0, abs=0.03)
    assert res["tis"]["err@10"] == pytest.approx(0.1, abs=0.03)
    m = g + b  # E[g_none]
    assert res["none"]["cos"] == pytest.approx((m @ g / m.norm()).item(), abs=0.01)
    assert res["none"]["norm_ratio"] == pytest.approx(m.norm().item(), abs=0.01)
    # best multiple of the h-step mean: 1 - <m, g>^2 / (|m|^2 + var / h), with |g| = 1
    assert res["none"]["scaled_err@10"] == pytest.approx(1 - (m @ g).item() ** 2 / (m @ m + 0.02).item(), abs=0.01)
    assert res["ref"]["scaled_err@1"] == pytest.approx(0.5 / 1.5, abs=0.02)
    # err@h(alpha) = (1 - alpha)^2 (|b|^2 + v_none / h) + alpha^2 v_tis / h, so alpha* = A / (A + v_tis / h)
    for h in (1, 10):
        a = 0.64 + 0.2 / h
        assert res["segment"][f"alpha*_err@{h}"] == pytest.approx(a / (a + 1.0 / h), abs=0.03)


def test_the_line_beyond_tis_finds_an_optimum_past_alpha_1_when_tis_keeps_part_of_the_bias():
    # g_tis keeps half of g_none's bias b, in the same direction: g(a) - g = (1 - a / 2) b + noise, so the least
    # err@h lies past TIS. With independent noises of variance v_none and v_tis,
    # err@h(a) = (1 - a/2)^2 |b|^2 + ((1 - a)^2 v_none + a^2 v_tis) / h, minimised at
    # a* = (|b|^2 / 2 + v_none / h) / (|b|^2 / 4 + (v_none + v_tis) / h)
    gb = load_benchmark("gradient_bias")
    K = 400
    g, b, noise = synthetic(1, K)
    g_ref, g_none, g_tis = g + noise(0.5), g + b + noise(0.2), g + 0.5 * b + noise(1.0)
    inside = gb.measure(g_ref, {"none": g_none, "tis": g_tis}, [1, 10, 100], choose=[])
    assert inside["segment"]["alpha*_err@100"] == 1.0 and inside["segment"]["alpha_max"] == 1.0  # the segment's end
    line = gb.measure(g_ref, {"none": g_none, "tis": g_tis}, [1, 10, 100], choose=[], alpha_max=3.0)
    for h in (10, 100):
        star = (0.32 + 0.2 / h) / (0.16 + 1.2 / h)
        assert line["segment"][f"alpha*_err@{h}"] == pytest.approx(star, abs=0.08)
        assert line["segment"][f"best_err@{h}"] < inside["segment"][f"best_err@{h}"]
    assert "[0, 3]" in gb.section({"results": line, "machine": {"cpu": "x", "cpus": 2, "torch": "t"}, "command": "c",
                                   "seconds": 1.0, "start": "s", "quant": "q", "salts": K, "seed": 0})  # fmt: skip
    for bad in (0.5, 11.0):  # refused before anything is built or trained
        with pytest.raises(ValueError, match=rf"alpha_max={bad}: .* give 1 to 10"):
            gb.main(None, "mxfp4_w4a4", None, 32, ["none", "tis"], "", [1, 10], alpha_max=bad)
    with pytest.raises(ValueError, match=r"names a method twice"):  # (its rows paired with other salts' references)
        gb.main(None, "mxfp4_w4a4", None, 32, ["none", "tis", "tis"], "", [1, 10])
    with pytest.raises(ValueError, match=r"start='runs/x': give RUN:STEP"):
        gb.main(None, "mxfp4_w4a4", None, 32, ["none", "tis"], "runs/x", [1, 10])
    with pytest.raises(ValueError, match=r"unknown quantisation preset 'fp9'"):  # (before: after the warm start)
        gb.main(None, "fp9", None, 32, ["none", "tis"], "", [1, 10])


def test_a_true_gradient_drowned_in_noise_gives_no_norm_rather_than_a_crash():
    # with few salts and noise far above |g|^2 (a heavy-tailed batch), the unbiased |E g_m|^2 of a jackknife
    # replicate can be negative: its square root is not a number, and the measurement must still come back
    gb = load_benchmark("gradient_bias")
    gen = torch.Generator().manual_seed(3)
    K, P = 16, 50
    g = torch.randn(P, generator=gen) / P**0.5
    nan = 0
    for _ in range(20):
        rows = lambda: g + torch.randn(K, P, generator=gen) * (80 / P) ** 0.5  # noqa: E731
        res = gb.measure(rows(), {"none": rows(), "tis": rows()}, [1, 10])
        nan += sum(res[m]["norm_ratio"] != res[m]["norm_ratio"] for m in ("none", "tis"))
    assert nan > 0  # some draws have no real norm, and say so with NaN (before: a TypeError on a complex number)


def test_calibration_picks_the_unbiased_end_point_once_enough_pooled_batches_average_its_noise():
    gb = load_benchmark("gradient_bias")
    g, b, noise = synthetic(1, K=64)  # b: the biased estimator's bias
    g_ref = g + noise(0.5)
    # paired with the reference: d_biased = b + small noise, d_noisy = unbiased with E|d|^2 = 2.0
    res = gb.measure(g_ref, {"biased": g_ref + b + noise(0.05), "noisy": g_ref + noise(2.0)}, [1, 10],
                     choose=["biased", "noisy"])  # fmt: skip
    cal = res["calibration"]
    assert set(cal) == {1, 2, 4, 8} and cal[1]["groups"] == 64 and cal[8]["groups"] == 8
    # one batch: |d_noisy|^2 ~ 2.0 > |d_biased|^2 ~ 0.69, so the biased one is picked; eight pooled: 2.0 / 8 = 0.25 <
    # 0.65; eight single batches averaged (window): still 2.0 > 0.69, since their noise does not average out of |d|^2
    assert cal[1]["pooled"]["picks"] == cal[1]["window"]["picks"] == {"biased": 1.0, "noisy": 0.0}
    assert cal[8]["pooled"]["picks"] == {"biased": 0.0, "noisy": 1.0}
    assert cal[8]["window"]["picks"] == {"biased": 1.0, "noisy": 0.0}
    assert cal[1]["pooled"]["bias2"] == pytest.approx(0.64, abs=0.05)
    assert cal[8]["pooled"]["bias2"] == pytest.approx(0.0, abs=0.05)
    assert cal[8]["fixed"]["biased"]["bias2"] == pytest.approx(0.64, abs=0.05)
    # mix: with eight pooled, <mean d_a, mean d_b> ~ diag(0.64 + 0.05 / 8, 2.0 / 8) (independent noises), whose
    # least mixture puts 0.25 / (0.646 + 0.25) = 0.279 on the biased end point: bias^2 0.279^2 * 0.64 = 0.050, and
    # noise 0.5 + 0.721^2 * 2.0 = 1.54 per batch, so err@10 ~ 0.20 beats the unbiased pick's 0.25
    mix = cal[8]["mix"]
    assert mix["picks"]["biased"] == pytest.approx(0.279, abs=0.05)
    assert mix["bias2"] == pytest.approx(0.050, abs=0.03)
    assert mix["err@10"] == pytest.approx(0.20, abs=0.03) and mix["err@10"] < cal[8]["pooled"]["err@10"]
    assert "calibration" not in gb.measure(g_ref, {"tis": g_ref}, [1])  # one end point: nothing to choose


def test_adam_space_is_the_update_adamw_makes_of_each_batch_gradient(tmp_path):
    gb = load_benchmark("gradient_bias")
    gen = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(3, 4, generator=gen)), torch.nn.Parameter(torch.randn(5, generator=gen))]
    # beta1 = 0: the update is then lr * g / (sqrt(v_hat) + eps) exactly, the quantity adam_space returns
    opt = torch.optim.AdamW(params, lr=0.1, betas=(0.0, 0.999), weight_decay=0.0)
    for _ in range(5):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * torch.rand(p.shape, generator=gen)
        opt.step()
    ckpt = tmp_path / "run" / "checkpoints" / "step_000005"
    ckpt.mkdir(parents=True)
    torch.save({"optimizer": opt.state_dict(), "step": 5}, ckpt / "state.pt")
    g = torch.randn(2, 17, generator=gen)  # (K, P): two batch gradients of the 12 + 5 values
    u = gb.adam_space(g, (str(tmp_path / "run"), 5))
    for k in range(2):
        o = torch.optim.AdamW([q.detach().clone().requires_grad_() for q in params], lr=0.1, betas=(0.0, 0.999),
                              weight_decay=0.0)  # fmt: skip
        o.load_state_dict(torch.load(ckpt / "state.pt", weights_only=True)["optimizer"])  # a copy: step() changes it
        before = torch.cat([q.detach().reshape(-1).clone() for q in o.param_groups[0]["params"]])
        for q, part in zip(o.param_groups[0]["params"], g[k].split([12, 5]), strict=True):
            q.grad = part.reshape(q.shape).clone()
        o.step()
        after = torch.cat([q.detach().reshape(-1) for q in o.param_groups[0]["params"]])
        torch.testing.assert_close(u[k], (before - after) / 0.1, rtol=1e-4, atol=1e-6)
    # a fresh optimizer (the warm start): Adam's first step is the sign of the gradient
    torch.testing.assert_close(gb.adam_space(g, None), g.sign(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="optimizer state for 17 values, the gradient has 16"):
        gb.adam_space(g[:, :16], (str(tmp_path / "run"), 5))


def test_a_seed_other_than_the_runs_own_gets_its_own_results_at_a_checkpoint(tmp_path, monkeypatch):
    # from RUN:STEP the prompt batch is the run's seed's unless seed= says otherwise: another batch, another name
    # (before: seed=5 dropped from the name, so its figures replaced those of the run's own batch)
    gb = load_benchmark("gradient_bias")
    monkeypatch.setattr(gb, "ROOT", tmp_path)
    run = tmp_path / "study" / "fmt" / "tis" / "seed3"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"seed": 3}))  # what recorded_base reads: the run's seed is 3
    gen = torch.Generator().manual_seed(0)
    used = []

    def step(base, overrides, start=None):  # the step's gradient, random: only the names are looked at
        used.append(overrides[0])
        return {"k3_kl": 0.1}, torch.randn(20, generator=gen) + 1

    monkeypatch.setattr(gb, "one_step", step)
    for seed in (None, 3, 5):
        gb.main(None, "mxfp4_w4a4", seed, 3, ["none", "tis"], f"{run}:80", [1, 10])
    assert set(used) == {"seed=3", "seed=5"}
    names = sorted(p.stem for p in (tmp_path / "benchmarks" / "results").iterdir())
    assert names == ["gradient_bias_lab_columns_mxfp4_w4a4_fmt_tis_seed3_80",
                     "gradient_bias_lab_columns_mxfp4_w4a4_fmt_tis_seed3_80_seed5"]  # fmt: skip
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert text.count("<!-- BEGIN gradient_bias_lab_columns_mxfp4_w4a4_fmt_tis_seed3_80") == 2
    # the same last three folders in another study: refused before measuring, not written over the first
    other = tmp_path / "other" / "fmt" / "tis" / "seed3"
    other.mkdir(parents=True)
    (other / "config.json").write_text(json.dumps({"seed": 3}))
    used.clear()
    with pytest.raises(ValueError, match="holds the measurement of another state .*; pass tag=NAME"):
        gb.main(None, "mxfp4_w4a4", None, 3, ["none", "tis"], f"{other}:80", [1, 10])
    assert not used
    # a smoke run of other salts or methods: refused, not written over the measurement (before: replaced it)
    for salts, methods in ((4, ["none", "tis"]), (3, ["none", "tis", "ais"])):
        with pytest.raises(ValueError, match=r"holds a measurement with other settings \(salts=3 methods=none,tis\)"):
            gb.main(None, "mxfp4_w4a4", None, salts, methods, f"{run}:80", [1, 10])
    assert not used
    gb.main(None, "mxfp4_w4a4", None, 3, ["tis", "none"], f"{run}:80", [1, 10])  # the same settings: measured again
    assert used
    gb.main(None, "mxfp4_w4a4", None, 3, ["none", "tis"], f"{run}:80", [1, 10])  # the same state: measured again


def test_first_step_gradients_of_other_seeds_or_thresholds_write_beside_the_cited_file(tmp_path, monkeypatch):
    """BENCHMARKS.md and docs/ais.md quote the means of seeds 0-5 at below=0.5; a one-seed run replaced them."""
    fs = load_benchmark("first_step_gradients")
    monkeypatch.setattr(fs, "ROOT", tmp_path)
    monkeypatch.setattr(fs, "first_step_norm", lambda *a: {"grad_norm": 1.0, "low_frac": 0.1})
    fs.main("lab_columns", "mxfp4_w4a4", list(fs.DEFAULTS["seeds"]), fs.DEFAULTS["below"])
    fs.main("lab_columns", "mxfp4_w4a4", [0], 0.5)
    fs.main("lab_columns", "mxfp4_w4a4", list(fs.DEFAULTS["seeds"]), 0.3)
    names = sorted(p.stem for p in (tmp_path / "benchmarks" / "results").iterdir())
    assert len(names) == 3 and names[0] == "first_step_gradients_lab_columns_mxfp4_w4a4"
