"""benchmarks/mismatch_vs_gap.py: twins must share a start, an undefined correlation has no p-value, and the runs
counted are the same for both fifths (the statistics themselves: tests/test_bench_seeds.py)."""

import random

import pytest
from conftest import load_benchmark

from aisrl.bench import seeds


def test_twins_must_share_a_start_and_an_undefined_correlation_has_no_p_value(tmp_path, monkeypatch):
    import json

    mg = load_benchmark("mismatch_vs_gap")
    monkeypatch.setattr(mg, "ROOT", tmp_path)
    assert seeds.correlation({1: 0.0, 2: 0.0, 3: 0.0}, {1: 0.3, 2: 0.1, 3: 0.2}) == {"r": None, "p": None, "n": 3,
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
