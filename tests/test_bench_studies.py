"""The study scripts under benchmarks/ on runs with gaps and edge cases: a removed metrics line, a skipped update, a
NaN k3, a misspelt kind, a correlation without spread, an arm with nothing scored, and names a smoke run must not
take from a published section."""

import json
import math
from types import SimpleNamespace

import pytest
from conftest import load_benchmark, write_run

from aisrl.bench import seeds


def test_scores_are_read_at_their_step_when_a_metrics_line_was_removed(tmp_path):
    # read_jsonl advises removing a damaged line; a score read by position then came from the wrong step
    rows = [{"step": s, "reward": 0.1 * s, "eval_accuracy": 0.5 if s == 10 else 0.2} for s in range(1, 13)]
    write_run(tmp_path / "run", [r for r in rows if r["step"] != 3])
    assert seeds.score(tmp_path / "run", 10, "greedy_accuracy") == 0.5  # step 10's, not step 11's
    assert seeds.score(tmp_path / "run", 10, "reward") == pytest.approx((0.9 + 1.0) / 2)  # steps 9-10, not 10-11


def test_paired_seeds_leaves_out_a_seed_whose_score_is_nan(tmp_path, monkeypatch):
    # final_eval writes NaN where nothing was scorable, and a training reward can be NaN: such a seed is unscored (it
    # gave a bare statistics traceback with 2+ seeds, or a NaN mean counted as a negative with one)
    for seed, value in enumerate((0.4, math.nan, 0.6)):
        write_run(tmp_path / "s" / "reference" / f"seed{seed}", [{"step": 1, "reward": value}])
    monkeypatch.setattr(seeds, "score", lambda run, steps, metric, rows: {"seed0": 0.1, "seed1": math.nan}.get(
        run.name))  # fmt: skip
    assert seeds.collect([tmp_path / "s"], "reference", 1, "held_reward") == {0: 0.1}
    monkeypatch.undo()
    assert seeds.collect([tmp_path / "s"], "reference", 1) == {0: 0.4, 2: 0.6}
    rows = [{"step": s, "reward": math.nan if s == 5 else 0.5} for s in range(1, 11)]
    assert seeds.last_fifth_reward(rows, 10) == 0.5  # step 5's NaN is outside the fifth; and inside:
    assert seeds.last_fifth_reward([{**r, "reward": math.nan} if r["step"] == 10 else r for r in rows], 10) == 0.5


def test_the_guard_replay_forgets_its_undo_copy_after_a_step_that_updated_nothing():
    gr = load_benchmark("guard_replay")
    k3 = [0.01] * 10 + [0.1]
    assert gr.jump_trips(k3, 4.0, 10) == [11]
    skipped = [False] * 9 + [True, False]  # step 10 trained on nothing: the trainer forgets, the jump only rebases
    assert gr.jump_trips(k3, 4.0, 10, skipped) == []


def test_mismatch_vs_gap_leaves_out_a_non_finite_k3_and_keeps_a_tag_to_one_format(tmp_path, monkeypatch):
    mg = load_benchmark("mismatch_vs_gap")
    monkeypatch.setattr(mg, "ROOT", tmp_path)
    rows = [{"step": s, "reward": 0.5, "k3_kl": math.nan if s == 10 else 0.01 * s} for s in range(1, 11)]
    write_run(tmp_path / "r", rows)
    assert mg.k3_fifths(tmp_path / "r", 10) == pytest.approx((0.015, 0.09))  # step 10's NaN left out
    c = seeds.correlation({1: 0.1, 2: math.nan, 3: 0.3, 4: 0.2}, {1: 1.0, 2: 5.0, 3: 3.0, 4: 2.0})
    assert c["n"] == 3 and c["r"] == pytest.approx(1.0)  # not NaN with the smallest p
    for seed in range(4):
        for kind, acc in (("reference", 0.5), ("fa/tis", 0.4 + 0.01 * seed), ("fa/ais", 0.45 - 0.01 * seed)):
            write_run(tmp_path / "s" / kind / f"seed{seed}",
                      [{"step": s, "reward": 0.5, "k3_kl": 0.01 * (seed + 1), "eval_accuracy": acc} for s in (1, 2)])
    mg.main([tmp_path / "s"], "fa", ["tis", "ais"], steps=2, tag="study")
    (tmp_path / "s" / "fa").rename(tmp_path / "s" / "fb")
    with pytest.raises(SystemExit, match="tag='study' names a study of format 'fa' already"):
        mg.main([tmp_path / "s"], "fb", ["tis", "ais"], steps=2, tag="study")  # would have replaced fa's section


def test_checkpoint_mismatch_refuses_a_kind_without_runs_before_measuring_and_names_a_smoke_run_apart(
    tmp_path, monkeypatch
):
    cm = load_benchmark("checkpoint_mismatch")
    monkeypatch.setattr(cm, "ROOT", tmp_path)
    measured = []
    probe = SimpleNamespace(measure=lambda held: {"k3": 0.1, "nll": 1.0, "reward": 0.5})
    probe.load = lambda at: measured.append(at) or probe
    monkeypatch.setattr(cm, "setup", lambda *a: probe)
    for seed in range(4):  # four full-precision runs ending at one accuracy: no spread to correlate
        write_run(tmp_path / "s" / "reference" / f"seed{seed}",
                  [{"step": s, "reward": 0.5, "eval_accuracy": 0.5} for s in (1, 2)])  # fmt: skip
        (tmp_path / "s" / "reference" / f"seed{seed}" / "checkpoints" / "step_000002").mkdir(parents=True)
        if seed:  # seed 0 kept none at step 2: found before measuring, not when its turn comes
            (tmp_path / "s" / "reference" / f"seed{seed}" / "checkpoints" / "step_000002" / "model.safetensors").touch()
    with pytest.raises(SystemExit, match=r"no checkpoint kept at 1 of the steps asked \(.*seed0: step 2\)"):
        cm.main([tmp_path / "s"], ["reference"], [2], "q", "lab", 1)
    (tmp_path / "s" / "reference" / "seed0" / "checkpoints" / "step_000002" / "model.safetensors").touch()
    with pytest.raises(SystemExit, match=r"no run of \['q/tsi'\] finished to step 2"):
        cm.main([tmp_path / "s"], ["reference", "q/tsi"], [2], "q", "lab", 1)
    assert measured == []  # refused before any checkpoint was measured
    with pytest.raises(SystemExit, match="no such folder"):
        cm.main([tmp_path / "nowhere"], ["reference"], [2], "q", "lab", 1)
    out = cm.main([tmp_path / "s"], ["reference"], [2], "q", "lab", 1)
    assert out["reference_k3_vs_accuracy"]["r"] is None and len(measured) == 4
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "across seeds: undefined (no spread)" in text
    assert "<!-- BEGIN checkpoint_mismatch_q -->" not in text  # other settings than the published ones: own name
    assert cm.name_of("q", "", cm.DEFAULTS["steps"], "lab_columns", 4) == "checkpoint_mismatch_q"
    assert cm.name_of("q", "t", [2], "lab", 1).startswith("checkpoint_mismatch_q_t_")
    # a run of other kinds under the same settings would replace the published file: refused before measuring
    write_run(tmp_path / "s" / "q" / "ais" / "seed0", [{"step": s, "reward": 0.5} for s in (1, 2)])
    (tmp_path / "s" / "q" / "ais" / "seed0" / "checkpoints" / "step_000002").mkdir(parents=True)
    (tmp_path / "s" / "q" / "ais" / "seed0" / "checkpoints" / "step_000002" / "model.safetensors").touch()
    measured.clear()
    with pytest.raises(SystemExit, match=r"holds a measurement of other kinds \(\['reference'\]\).*overwrite=true"):
        cm.main([tmp_path / "s"], ["reference", "q/ais"], [2], "q", "lab", 1)
    assert measured == []
    assert set(cm.main([tmp_path / "s"], ["reference", "q/ais"], [2], "q", "lab", 1, overwrite=True)["kinds"]) == {
        "reference", "q/ais"}  # fmt: skip
    import shutil

    shutil.rmtree(tmp_path / "s" / "q" / "ais")
    # a pair of one seed from different warm starts is refused before measuring (before: paired all the same)

    write_run(tmp_path / "s" / "q" / "tis" / "seed0", [{"step": s, "reward": 0.5} for s in (1, 2)])
    (tmp_path / "s" / "reference" / "seed0" / "start.json").write_text(json.dumps({"weights": "aa"}))
    (tmp_path / "s" / "q" / "tis" / "seed0" / "start.json").write_text(json.dumps({"weights": "bb"}))
    measured.clear()
    with pytest.raises(ValueError, match=r"seed 0\) started from different weights"):
        cm.main([tmp_path / "s"], ["reference", "q/tis"], [2], "q", "lab", 1)
    assert measured == []


def test_branch_table_shows_an_arm_with_no_scored_branch():
    bt = load_benchmark("branch_table")
    arm = bt.arm_summary({0: [{"eval_change": None, "fell": None}]})
    assert arm["mean_change"] is None
    scored = bt.arm_summary({0: [{"eval_change": 0.1, "fell": False}]})
    assert "| b | - | - | 0/0 |" in bt.table({"a": scored, "b": arm})  # before: a TypeError, nothing written
