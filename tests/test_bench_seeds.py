"""aisrl.bench.seeds: the two-way demeaning removes additive method and seed effects exactly (also on an unbalanced
table), and the correlation and its permutation p-value behave as a Pearson correlation should."""

import json
import math
import random

import pytest
import torch
from conftest import write_run

from aisrl.bench import seeds


def test_two_way_demeaning_leaves_only_what_is_not_a_method_or_seed_effect():
    rng = random.Random(0)
    method = {m: rng.gauss(0, 1) for m in "abc"}
    seed = {s: rng.gauss(0, 1) for s in range(6)}
    keys = [(m, s) for m in "abc" for s in range(6) if (m, s) not in {("a", 0), ("c", 5), ("c", 4)}]  # unbalanced
    noise = {k: rng.gauss(0, 0.1) for k in keys}
    additive = seeds.demean({k: method[k[0]] + seed[k[1]] for k in keys})
    assert max(abs(v) for v in additive.values()) < 1e-9  # a pure method + seed table leaves nothing
    both = seeds.demean({k: method[k[0]] + seed[k[1]] + noise[k] for k in keys})
    alone = seeds.demean(noise)
    assert max(abs(both[k] - alone[k]) for k in keys) < 1e-9  # the effects go, the rest stays as it was
    for axis in (0, 1):  # every method's and every seed's residuals sum to zero
        for g in {k[axis] for k in keys}:
            assert abs(sum(v for k, v in both.items() if k[axis] == g)) < 1e-9


def test_a_run_with_no_finite_k3_leaves_the_others_residuals_alone():
    rng = random.Random(1)
    keys = [(m, s) for m in "ab" for s in range(6)]
    x = {k: rng.gauss(0, 1) for k in keys}
    y = {k: 0.7 * x[k] + rng.gauss(0, 0.3) for k in keys}
    clean = seeds.correlation(*seeds.residuals({k: v for k, v in x.items() if k != ("a", 0)}, y), permutations=500)
    x[("a", 0)] = float("nan")  # a fifth in which every step lost its tokens
    with_nan = seeds.correlation(*seeds.residuals(x, y), permutations=500)
    assert with_nan["n"] == clean["n"] == 10  # run a0 out, and b0 with it (its seed's mean would be all of it)
    assert with_nan["r"] == pytest.approx(clean["r"]) and with_nan["r"] > 0.5  # before: r None, n 0


def test_correlation_matches_pearson_and_its_permutation_p_value_separates_signal_from_noise():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(60, generator=gen, dtype=torch.float64)
    y = 0.5 * x + torch.randn(60, generator=gen, dtype=torch.float64)
    c = seeds.correlation(dict(enumerate(x.tolist())), dict(enumerate(y.tolist())), permutations=2000)
    assert c["r"] == pytest.approx(torch.corrcoef(torch.stack([x, y]))[0, 1].item(), abs=1e-12)
    assert c["p"] < 0.01 and c["n"] == 60
    xc, yc = x - x.mean(), y - y.mean()
    assert c["slope"] == pytest.approx(((xc * yc).sum() / xc.pow(2).sum()).item())
    unrelated = torch.randn(60, generator=gen, dtype=torch.float64)
    c0 = seeds.correlation(dict(enumerate(x.tolist())), dict(enumerate(unrelated.tolist())), permutations=2000)
    # |r| of unrelated samples of 60 is about 0.13; the permutation p of such an r is far from small
    assert abs(c0["r"]) < 0.35 and c0["p"] > 0.01


def test_summary_counts_ties_and_gives_an_exact_sign_test():
    s = seeds.summary([0.1, 0.2, 0.0, -0.1, 0.3, 0.0])
    assert (s["positive"], s["ties"]) == (3, 2)
    assert s["sign_p"] == pytest.approx(2 * (1 + 4) / 16)  # 3 up, 1 down: P(X <= 1 | n=4) = 5/16, two-sided
    assert seeds.sign_test(6, 13) == pytest.approx(0.1671, abs=1e-4)  # 6 of 19 untied, as quoted in docs/ais.md
    assert seeds.sign_test(0, 0) is None and seeds.sign_test(5, 0) == pytest.approx(2 / 32)


# Found by mutation testing: each case below failed a plausible slip that the tests above let pass.

def test_last_fifth_window():
    rows = [{"step": s, "reward": float(s)} for s in range(1, 21)]
    assert seeds.last_fifth_reward(rows, 20) == 18.5  # steps 17-20 (20 // 5 = 4), not 16-20
    assert seeds.last_fifth_reward(rows[:3], 3) == 3.0  # under 5 steps: the last step alone, not all three


def test_final_score_read_at_its_step_only(tmp_path, monkeypatch):
    run = tmp_path / "run"
    write_run(run, [{"step": s, "reward": 0.5} for s in range(1, 11)])
    monkeypatch.setattr(seeds, "current", lambda s: True)
    monkeypatch.setattr(seeds, "scores_of", lambda s, ckpt: True)
    (run / "final_eval.json").write_text(json.dumps({"settings": {"checkpoint": "step_000010"}, "held_accuracy": 0.7}))
    assert seeds.score(run, 10, "held_accuracy") == 0.7
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "latest").write_text("step_000012\n")
    assert seeds.score(run, 10, "held_accuracy") is None  # the run went on after it was scored


def test_a_seed_is_never_refilled_from_a_later_folder(tmp_path):
    write_run(tmp_path / "a" / "reference" / "seed0", [{"step": 1, "reward": 0.4}])
    write_run(tmp_path / "b" / "reference" / "seed0", [{"step": 1, "reward": 0.9}])
    assert seeds.collect([tmp_path / "a", tmp_path / "b"], "reference", 1) == {0: 0.4}


def test_summary_statistics():
    assert seeds.sign_test(3, 3) == 1.0
    s = seeds.summary([1.0, 3.0])
    assert s["std"] == pytest.approx(2**0.5) and s["se"] == pytest.approx(1.0)
    assert seeds.summary([0.0, 0.0, 3.0])["mean"] == 1.0


def test_permutation_p():
    c = seeds.correlation({1: 0.0, 2: 1.0}, {1: 0.0, 2: 2.0}, permutations=9)
    assert c["p"] == 1.0  # every pairing of two points has |r| = 1: (9 + 1) / (9 + 1)
    neg = seeds.correlation({i: float(i) for i in range(6)}, {i: -float(i) for i in range(6)}, permutations=999)
    assert neg["r"] == pytest.approx(-1.0) and neg["p"] < 0.05  # two-sided: a perfect negative r is significant
    c = seeds.correlation({1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4}, {1: 1.0, 2: math.nan, 3: 3.0, 4: 2.0}, permutations=99)
    assert c["n"] == 3 and math.isfinite(c["r"])
