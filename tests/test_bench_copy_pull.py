"""benchmarks/copy_pull.py: its penalties are what its docstring says (the straight-through copy's log-probs are the
real copy's), and a bad variant is an error naming the valid ones."""


import pytest
import torch
from conftest import TINY_LAB, load_benchmark


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AISRL_CACHE", str(tmp_path / "cache"))


def test_the_pull_penalties_measure_the_gap_to_the_real_copy():
    cp = load_benchmark("copy_pull")
    probe = cp.setup("lab", "mxfp4_w4a4", "", tuple(TINY_LAB))
    model, policy = probe.model, probe.policy
    torch.manual_seed(0)
    for p in model.parameters():  # weights of a realistic scale, so that MXFP4 W4A4 leaves a real gap
        p.data.normal_(0, 0.2)
    probe.sync(model.state_dict())
    r, _ = probe.batch(0)
    with torch.no_grad():
        gap = (policy.score(model, r, 0) - r.rollout_logp)[r.completion_mask]  # against the copy that sampled
    expected = 0.5 * gap.pow(2).mean().item()
    grads = {}
    for variant in ("ste", "to_copy"):
        model.zero_grad()
        value = cp.penalty(variant, model, policy, r)
        value.backward()
        grads[variant] = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        assert value.item() == pytest.approx(expected, rel=1e-3) and expected > 1e-5
    # through the straight-through copy the gradient differs from the one with the copy held fixed
    assert (grads["ste"] - grads["to_copy"]).norm() > 1e-3 * grads["to_copy"].norm()
    # grid: half the mean squared distance of the quantised layers' weights to their rounded values, > 0 here
    grid = cp.penalty("grid", model, policy, r)
    assert 0 < grid.item() < 0.5 * 0.2**2


def test_an_unknown_variant_is_an_error_naming_the_valid_ones():
    cp = load_benchmark("copy_pull")
    with pytest.raises(ValueError, match=r"unknown variant\(s\) \['magic'\]; choose from \['ste', 'to_copy', 'grid'\]"):
        cp.main("lab", "mxfp4_w4a4", "", ["magic"], [1e-3], 1, 1, 1)


def test_runs_with_other_settings_write_beside_the_published_figures(tmp_path, monkeypatch):
    """A run from a checkpoint or a smoke run replaced the published copy_pull table; now only the published
    settings (steps=30 from the warm start, every variant at both rates) write under its name."""
    cp = load_benchmark("copy_pull")
    monkeypatch.setattr(cp, "ROOT", tmp_path)
    (tmp_path / "BENCHMARKS.md").write_text("# B\n")
    curve = [{"step": 1, "k3": 0.1, "reward": 0.5, "nll": 1.0}]
    monkeypatch.setattr(cp, "pull", lambda preset, quant, start, v, lr, *a: {"variant": v, "lr": lr, "curve": curve})
    d = cp.DEFAULTS
    cp.main("lab_columns", "mxfp4_w4a4", "", list(d["variants"]), list(d["lrs"]), 30, 5, 4)
    cp.main("lab_columns", "mxfp4_w4a4", "runs/x/seed0:40", ["grid"], [1e-3], 30, 5, 4)
    cp.main("lab_columns", "mxfp4_w4a4", "", ["grid"], [1e-3], 2, 1, 1)
    names = sorted(p.stem for p in (tmp_path / "benchmarks" / "results").iterdir())
    assert len(names) == 3 and names[0] == "copy_pull_lab_columns_mxfp4_w4a4"
    assert all(n.startswith("copy_pull_lab_columns_mxfp4_w4a4_") for n in names[1:])


def test_each_point_of_the_curve_averages_the_penalties_since_the_last_one(monkeypatch):
    """steps=7 every=5: the last point (step 7) averaged steps 3-7, reaching back into the first window."""
    from types import SimpleNamespace

    cp = load_benchmark("copy_pull")
    model = torch.nn.Linear(1, 1)
    step = {"n": 0}

    def batch(s):
        step["n"] = s
        return None, None

    probe = SimpleNamespace(model=model, policy=None, batch=batch, measure=lambda held: {"k3": 0.0, "reward": 0.0,
                            "nll": 0.0}, sync=lambda state: None, cfg=SimpleNamespace(grad_clip=1.0))  # fmt: skip
    monkeypatch.setattr(cp, "setup", lambda *a: probe)
    monkeypatch.setattr(cp, "penalty", lambda v, m, p, r: (m.weight * 0).sum() + float(step["n"]))  # step s: s
    curve = cp.pull("lab", "mxfp4_w4a4", "", "grid", 1e-3, 7, 5, 1)["curve"]
    assert [(c["step"], c.get("penalty")) for c in curve] == [(0, None), (5, 3.0), (7, 6.5)]  # mean(1..5), mean(6, 7)
