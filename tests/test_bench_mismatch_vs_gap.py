"""benchmarks/mismatch_vs_gap.py: the two-way demeaning removes additive method and seed effects exactly (also on an
unbalanced table), and the correlation and its permutation p-value behave as a Pearson correlation should."""

import random

import pytest
import torch
from conftest import load_benchmark


def test_two_way_demeaning_leaves_only_what_is_not_a_method_or_seed_effect():
    mg = load_benchmark("mismatch_vs_gap")
    rng = random.Random(0)
    method = {m: rng.gauss(0, 1) for m in "abc"}
    seed = {s: rng.gauss(0, 1) for s in range(6)}
    keys = [(m, s) for m in "abc" for s in range(6) if (m, s) not in {("a", 0), ("c", 5), ("c", 4)}]  # unbalanced
    noise = {k: rng.gauss(0, 0.1) for k in keys}
    additive = mg.demean({k: method[k[0]] + seed[k[1]] for k in keys})
    assert max(abs(v) for v in additive.values()) < 1e-9  # a pure method + seed table leaves nothing
    both = mg.demean({k: method[k[0]] + seed[k[1]] + noise[k] for k in keys})
    alone = mg.demean(noise)
    assert max(abs(both[k] - alone[k]) for k in keys) < 1e-9  # the effects go, the rest stays as it was
    for axis in (0, 1):  # every method's and every seed's residuals sum to zero
        for g in {k[axis] for k in keys}:
            assert abs(sum(v for k, v in both.items() if k[axis] == g)) < 1e-9


def test_a_run_with_no_finite_k3_leaves_the_others_residuals_alone():
    mg = load_benchmark("mismatch_vs_gap")
    rng = random.Random(1)
    keys = [(m, s) for m in "ab" for s in range(6)]
    x = {k: rng.gauss(0, 1) for k in keys}
    y = {k: 0.7 * x[k] + rng.gauss(0, 0.3) for k in keys}
    clean = mg.correlation(*mg.residuals({k: v for k, v in x.items() if k != ("a", 0)}, y), permutations=500)
    x[("a", 0)] = float("nan")  # a fifth in which every step lost its tokens
    with_nan = mg.correlation(*mg.residuals(x, y), permutations=500)
    assert with_nan["n"] == clean["n"] == 10  # run a0 out, and b0 with it (its seed's mean would be all of it)
    assert with_nan["r"] == pytest.approx(clean["r"]) and with_nan["r"] > 0.5  # before: r None, n 0


def test_correlation_matches_pearson_and_its_permutation_p_value_separates_signal_from_noise():
    mg = load_benchmark("mismatch_vs_gap")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(60, generator=gen, dtype=torch.float64)
    y = 0.5 * x + torch.randn(60, generator=gen, dtype=torch.float64)
    c = mg.correlation(dict(enumerate(x.tolist())), dict(enumerate(y.tolist())), permutations=2000)
    assert c["r"] == pytest.approx(torch.corrcoef(torch.stack([x, y]))[0, 1].item(), abs=1e-12)
    assert c["p"] < 0.01 and c["n"] == 60
    xc, yc = x - x.mean(), y - y.mean()
    assert c["slope"] == pytest.approx(((xc * yc).sum() / xc.pow(2).sum()).item())
    unrelated = torch.randn(60, generator=gen, dtype=torch.float64)
    c0 = mg.correlation(dict(enumerate(x.tolist())), dict(enumerate(unrelated.tolist())), permutations=2000)
    # |r| of unrelated samples of 60 is about 0.13; the permutation p of such an r is far from small
    assert abs(c0["r"]) < 0.35 and c0["p"] > 0.01


def test_twins_must_share_a_start_and_an_undefined_correlation_has_no_p_value(tmp_path, monkeypatch):
    import json

    mg = load_benchmark("mismatch_vs_gap")
    monkeypatch.setattr(mg, "ROOT", tmp_path)
    assert mg.correlation({1: 0.0, 2: 0.0, 3: 0.0}, {1: 0.3, 2: 0.1, 3: 0.2}) == {"r": None, "p": None, "n": 3,
                                                                                 "slope": None}  # fmt: skip

    def run(kind, seed, acc, k3, start="aa"):
        p = tmp_path / "s" / kind / f"seed{seed}"
        p.mkdir(parents=True, exist_ok=True)
        rows = [{"step": i, "reward": 0.5, "k3_kl": k3 * i, "eval_accuracy": acc} for i in range(1, 11)]
        (p / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (p / "start.json").write_text(json.dumps({"weights": start}))

    rng = random.Random(0)
    for seed in range(5):
        run("reference", seed, 0.5, 0.0)
        for m in ("tis", "ais"):
            run(f"f/{m}", seed, 0.5 - rng.random() * 0.1, 0.01 + rng.random() * 0.01)
    run("f/ais", 7, 0.2, 0.5)  # a seed under one method only: nothing left once its mean is out, so left out
    run("reference", 7, 0.5, 0.0)
    out = mg.main([tmp_path / "s"], "f", ["tis", "ais"], steps=10)
    assert out["runs"] == 10 and out["last_fifth_k3"]["n"] == 10
    # a run whose last fifth measured no k3 leaves both correlations (and the count) alike: the first-fifth control
    # counted it while the last fifth did not, under one "runs" figure; a method under 4 runs is named, not dropped
    for seed in (5, 6):
        run("reference", seed, 0.5, 0.0)
        run("f/tis", seed, 0.45, 0.01)
        run("f/none", seed, 0.3, 0.02)
    p = tmp_path / "s" / "f" / "tis" / "seed0" / "metrics.jsonl"
    rows = [json.loads(x) for x in p.read_text().splitlines()]
    p.write_text("".join(json.dumps({**r, "k3_kl": float("nan") if r["step"] > 8 else r["k3_kl"]}) + "\n"
                         for r in rows))  # fmt: skip
    out = mg.main([tmp_path / "s"], "f", ["tis", "ais", "none"], steps=10)
    assert out["runs"] == out["last_fifth_k3"]["n"] == out["first_fifth_k3"]["n"] == 12  # of 14: seed 0 has only ais
    assert out["per_method_left_out"] == {"none": 2} and set(out["per_method"]) == {"tis", "ais"}
    assert "Left out of the table, with fewer than 4 runs: none (2)." in (tmp_path / "BENCHMARKS.md").read_text()
    run("f/tis", 3, 0.4, 0.01, start="bb")  # seed 3's tis run began from other weights than its twin
    with pytest.raises(ValueError, match=r"seed 3\) started from different weights"):
        mg.main([tmp_path / "s"], "f", ["tis", "ais"], steps=10)
