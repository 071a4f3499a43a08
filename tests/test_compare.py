"""The comparison study: a reduced real run (2 methods, 1 seed, 2 steps), resume/skip, aggregation math."""

import hashlib
import json
import math
import statistics
import sys
from pathlib import Path

import pytest
from conftest import TINY_LAB, load_benchmark

from aisrl.bench import seeds
from aisrl.cli import main
from aisrl.compare import (
    CompareConfig,
    Run,
    aggregate,
    mixed_starts,
    plan,
    reference_label,
    run_study,
)
from aisrl.compare_report import final_table, publish, table
from aisrl.final_eval import SCORER
from aisrl.runs import smooth, summarize_run


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AISRL_CACHE", str(tmp_path / "cache"))


def test_reduced_study_runs_end_to_end_and_resumes(tmp_path, capsys):
    out = tmp_path / "study"
    args = ["compare", "lab", "methods=[none,ais]", "seeds=[0]", "formats=[fp8_e4m3_w8a8]", f"out={out}",
            *TINY_LAB, "max_steps=2", "eval_every=2", "device=cpu"]  # fmt: skip (on a GPU the reference is BF16)
    assert main(args) == 0
    result = json.loads((out / "compare.json").read_text())
    assert sorted(result["groups"]) == ["fp8_e4m3_w8a8/ais", "fp8_e4m3_w8a8/none", "reference"]
    for name, g in result["groups"].items():
        run = g["runs"]["0"]
        assert g["missing"] == [] and run["steps"] == 2, name
        assert run["eval_start"] is not None and run["eval_final"] is not None
        assert len(run["reward"]) == 2 and abs(sum(run["time_share"].values()) - 1) < 1e-9
    ref, fp8_none, ais = (result["groups"][k]["runs"]["0"] for k in ("reference", "fp8_e4m3_w8a8/none",
                                                                       "fp8_e4m3_w8a8/ais"))  # fmt: skip
    assert all(a is None for a in fp8_none["alpha"]) and all(0 <= a <= 1 for a in ais["alpha"])
    assert result["groups"]["reference"]["reward_vs_reference"] == [0.0, None]  # paired with itself; one seed
    last = lambda run: statistics.fmean(run["reward"][-1:])  # noqa: E731 - 2 steps: the last fifth is step 2
    assert result["groups"]["fp8_e4m3_w8a8/ais"]["reward_vs_reference"][0] == pytest.approx(last(ais) - last(ref))
    # full-precision rollouts come from an exact copy of the trainer: no mismatch; FP8 rollouts have some
    assert max(ref["k3_kl"]) < 1e-10 < min(fp8_none["k3_kl"])
    assert (out / "compare.png").exists() and "| full precision | none | 1 |" in capsys.readouterr().out
    # each final model was scored (aisrl.final_eval): at full precision the sampler is the model itself
    assert ref["policy_reward"] == ref["sampler_reward"] and fp8_none["sampler_reward"] is not None
    assert result["groups"]["reference"]["policy_vs_reference"] == [0.0, None]
    assert result["groups"]["fp8_e4m3_w8a8/ais"]["policy_vs_reference"][0] == pytest.approx(
        ais["policy_reward"] - ref["policy_reward"])
    assert "| fp8_e4m3_w8a8 | ais | 1 |" in final_table(result)
    # the reference's own row shows no difference from itself (before: 0.000, as if measured)
    ref_rows = [line for text in (table(result), final_table(result)) for line in text.splitlines()
                if line.startswith("| full precision |")]  # fmt: skip
    assert [row.split(" | ")[11 if i == 0 else 4] for i, row in enumerate(ref_rows)] == ["-", "-"], ref_rows
    # a finished study is not re-run: the second call only aggregates (metrics files untouched)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("metrics.jsonl")}
    assert main(args) == 0
    assert before == {p: p.stat().st_mtime_ns for p in out.rglob("metrics.jsonl")} and len(before) == 3
    assert json.loads((out / "compare.json").read_text())["groups"] == result["groups"]


def _fake_rows(rewards, evals, start, kl):
    rows = []
    for i, r in enumerate(rewards, 1):
        row = {"step": i, "reward": r, "accuracy": r, "k3_kl": kl[i - 1], "ess": 1.0, "alpha": None,
               "time_rollout": 3.0, "time_logprob": 0.5, "time_correction": 0.0, "time_train": 1.0,
               "time_sync": 0.5}  # fmt: skip
        if i == 1:
            row["eval_accuracy_start"] = start
        if i in evals:
            row["eval_accuracy"] = evals[i]
        rows.append(row)
    return rows


def _cache(run_dir, checkpoint, scores, **settings):
    """A final_eval.json of `checkpoint`'s weights as they are now (an empty weights file where a fake run has none)."""
    weights = run_dir / "checkpoints" / checkpoint / "model.safetensors"
    if not weights.exists():
        weights.parent.mkdir(parents=True, exist_ok=True)
        weights.write_bytes(b"")
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    settings = {"checkpoint": checkpoint, "scorer": SCORER, "weights_sha256": digest, **settings}
    (run_dir / "final_eval.json").write_text(json.dumps({"settings": settings, **scores}))


def _write_run(d, rows):
    """A run folder as a finished trainer leaves it: its metrics, and its last step's checkpoint and summary."""
    (d / "checkpoints").mkdir(parents=True, exist_ok=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "checkpoints" / "latest").write_text(f"step_{rows[-1]['step']:06d}")
    (d / "summary.json").write_text(json.dumps({"steps": rows[-1]["step"]}))


def test_summaries_and_aggregation_match_hand_computed_values(tmp_path):
    cfg = CompareConfig(methods=["tis"], formats=["mxfp4"], seeds=[0, 1], reference=False, out=str(tmp_path))
    kl = [0.1 * i for i in range(1, 11)]  # early fifth = steps 1-2, late fifth = steps 9-10
    seeds = {
        0: _fake_rows([0.6] * 7 + [0.1] * 3, {5: 0.4, 10: 0.1}, 0.3, kl),  # a reward crash
        1: _fake_rows([0.5] * 10, {5: 0.3, 10: 0.35}, 0.2, kl),
    }
    for s, rows in seeds.items():
        _write_run(Run("mxfp4", "tis", s).path(tmp_path), rows)
    one = summarize_run(seeds[0], 0.5)
    assert (one["eval_start"], one["eval_final"], one["eval_best"]) == (0.3, 0.1, 0.4)
    assert one["collapsed"] and one["fell"]  # 0.4 at its best, 0.1 at the end
    assert not summarize_run(seeds[0], 0.5, fall=0.31)["fell"] and not summarize_run(seeds[1], 0.5)["fell"]
    assert one["k3_kl_early"] == pytest.approx(0.15) and one["k3_kl_late"] == pytest.approx(0.95)
    assert one["time_share"]["time_rollout"] == pytest.approx(0.6) and one["seconds_per_step"] == pytest.approx(5)
    assert one["alpha_kl_corr"] is None  # no alpha in a tis run
    alpha_rows = [dict(r, alpha=0.5 + r["k3_kl"]) for r in seeds[0]]
    assert summarize_run(alpha_rows, 0.5)["alpha_kl_corr"] == pytest.approx(1.0)
    g = aggregate(cfg, plan(cfg), max_steps=10)["groups"]["mxfp4/tis"]
    assert g["collapses"] == 1 and g["falls"] == 1 and g["missing"] == []  # seed 1's reward is flat
    assert g["eval_final"] == pytest.approx((0.225, statistics.stdev([0.1, 0.35])))
    assert g["reward_last_fifth"] == pytest.approx((0.3, statistics.stdev([0.1, 0.5])))
    assert not summarize_run(_fake_rows([0.6] * 7 + [0.35] * 3, {10: 0.1}, 0.3, kl), 0.5)["collapsed"]
    # collapse is judged on training accuracy: the format credit keeps the reward of a run that lost every
    # correct answer above half its best (1.5 -> 0.5 + 0.5 * accuracy), but its accuracy falls to 0
    lost = [dict(r, accuracy=a, reward=0.5 + 0.5 * a) for r, a in zip(seeds[1], [0.9] * 7 + [0.0] * 3, strict=True)]
    assert lost[-1]["reward"] > 0.5 * lost[0]["reward"] and summarize_run(lost, 0.5)["collapsed"]
    # a non-finite row (a NaN k3 from a step that lost every token, say) is left out, not a crash or a NaN summary
    nan = [dict(r, k3_kl=math.nan if r["step"] == 10 else r["k3_kl"], alpha=math.nan) for r in seeds[1]]
    nan[-1]["eval_accuracy"] = math.nan
    s = summarize_run(nan, 0.5)
    assert s["k3_kl_late"] == pytest.approx(0.9) and s["alpha_late"] is None and s["alpha_kl_corr"] is None
    assert (s["eval_final"], s["eval_best"], s["fell"]) == (0.3, 0.3, False)
    # a step with no token the trainer could score logs k3 0: no measurement, not a mismatch of 0 (before: averaged in)
    unscored = [dict(r, k3_kl=0.0, num_tokens=0) if r["step"] == 10 else r for r in seeds[1]]
    assert summarize_run(unscored, 0.5)["k3_kl_late"] == pytest.approx(0.9)
    # an unfinished run is reported missing, not averaged in
    g = aggregate(cfg, plan(cfg), max_steps=12)["groups"]["mxfp4/tis"]
    assert g["runs"] == {} and g["missing"] == [0, 1] and g["eval_final"] == (None, None)
    shown = table({"groups": {"mxfp4/tis": g}})
    assert "| mxfp4" not in shown and "not finished, left out of every cell: mxfp4 tis: [0, 1]" in shown  # no row


def test_aggregation_counts_only_runs_the_study_would_not_train_again(tmp_path):
    """The trainer logs a step's row before it saves the step's checkpoint and, at the end, the summary: a run
    killed in between has every row but is not finished (a re-run trains its last steps again)."""
    cfg = CompareConfig(methods=["tis"], formats=["int4"], seeds=[0, 1, 2], reference=False, out=str(tmp_path))
    for seed, reward in ((0, 0.5), (1, 0.9), (2, 0.9)):
        _write_run(Run("int4", "tis", seed).path(tmp_path), _fake_rows([reward] * 10, {10: 0.3}, 0.2, [0.1] * 10))
    (tmp_path / "int4/tis/seed1/checkpoints/latest").write_text("step_000008")  # killed saving step 10
    (tmp_path / "int4/tis/seed2/summary.json").unlink()  # killed before the summary
    g = aggregate(cfg, plan(cfg), max_steps=10)["groups"]["int4/tis"]
    assert list(g["runs"]) == ["0"] and g["missing"] == [1, 2] and g["reward_last_fifth"] == (0.5, None)


def test_the_figure_averages_evaluations_and_alpha_step_by_step(tmp_path, monkeypatch):
    from matplotlib.lines import Line2D

    from aisrl.compare_report import _alpha_curve, _eval_curve, plot

    five, ten = {"eval_curve": [[5, 0.3], [10, 0.4]]}, {"eval_curve": [[10, 0.6]]}  # eval_every 5 and 10
    assert _eval_curve([five, ten]) == _eval_curve([ten, five]) == ([10], [pytest.approx(0.5)])
    # a calibrated method logs alpha only on steps whose end point is ais
    alpha = _alpha_curve([{"alpha": [0.2] * 9 + [None]}, {"alpha": [0.6, None] * 5}], 10)
    assert alpha[:9] == pytest.approx([0.4, 0.2] * 4 + [0.4]) and math.isnan(alpha[9])
    cfg = CompareConfig(methods=["calibrated"], formats=["int4"], seeds=[0, 1], reference=False, out=str(tmp_path))
    for seed, evals in ((0, {5: 0.3, 10: 0.4}), (1, {10: 0.6})):
        rows = _fake_rows([0.5] * 10, evals, 0.2, [0.1] * 10)
        rows = [dict(r, alpha=0.5 if r["step"] % 2 or seed else None) for r in rows]  # seed 0: ais on odd steps
        _write_run(Run("int4", "calibrated", seed).path(tmp_path), rows)
    result = aggregate(cfg, plan(cfg), max_steps=10)
    runs = result["groups"]["int4/calibrated"]["runs"]
    runs["0"]["eval_start"], runs["1"]["eval_start"] = 0.2, None  # seed 1 not scored at the start
    runs["0"]["k3_kl"][2] = math.nan  # a non-finite row
    drawn = []
    monkeypatch.setattr("matplotlib.axes.Axes.plot", lambda ax, *a, **k: drawn.append(a) or [Line2D([], [])])
    plot(result, tmp_path / "compare.png")
    assert (tmp_path / "compare.png").stat().st_size > 0
    held_out = next(a for a in drawn if a[2:] == ("o-",))
    assert held_out[0] == [0, 10] and held_out[1] == [pytest.approx(0.2), pytest.approx(0.5)]  # not (0.2 + 0) / 2
    k3 = next(a for a in drawn if len(a) == 2 and len(a[1]) == 10 and a[1][0] == pytest.approx(0.1))
    assert all(math.isfinite(v) for v in k3[1])


def test_the_figure_starts_the_held_out_curve_at_the_mean_start_over_seeds(tmp_path, monkeypatch):
    # three seeds start at 0.1, 0.2 and 0.6: the point at step 0 is their mean 0.3 (not the median 0.2, the first
    # 0.1 or the best 0.6), beside the step-10 mean (0.4 + 0.5 + 0.9) / 3 = 0.6
    from matplotlib.lines import Line2D

    from aisrl.compare_report import plot

    cfg = CompareConfig(methods=["tis"], formats=["int4"], seeds=[0, 1, 2], reference=False, out=str(tmp_path))
    for seed, start in enumerate((0.1, 0.2, 0.6)):
        rows = _fake_rows([0.5] * 10, {10: start + 0.3}, start, [0.1] * 10)
        _write_run(Run("int4", "tis", seed).path(tmp_path), rows)
    drawn = []
    monkeypatch.setattr("matplotlib.axes.Axes.plot", lambda ax, *a, **k: drawn.append(a) or [Line2D([], [])])
    plot(aggregate(cfg, plan(cfg), max_steps=10), tmp_path / "compare.png")
    held_out = next(a for a in drawn if a[2:] == ("o-",))
    assert held_out[0] == [0, 10] and held_out[1] == [pytest.approx(0.3), pytest.approx(0.6)]

def test_a_removed_metrics_line_leaves_a_gap_not_a_shift_in_the_per_step_curves(tmp_path, monkeypatch):
    # read_jsonl tells a user to remove a damaged middle line; the steps after it must keep their places
    from matplotlib.lines import Line2D

    from aisrl.compare_report import plot

    cfg = CompareConfig(methods=["tis"], formats=["int4"], seeds=[0, 1], reference=False, out=str(tmp_path))
    for seed in (0, 1):
        rows = [dict(r, reward=float(r["step"]), k3_kl=0.01 * r["step"])
                for r in _fake_rows([0.0] * 20, {20: 0.3}, 0.2, [0.0] * 20)]  # fmt: skip
        _write_run(Run("int4", "tis", seed).path(tmp_path), [r for r in rows if r["step"] != 3 or seed])
    result = aggregate(cfg, plan(cfg), max_steps=20)
    gap = result["groups"]["int4/tis"]["runs"]["0"]
    assert gap["steps"] == 20 and gap["reward"][2] is None and gap["reward"][19] == 20.0
    assert gap["k3_kl"][:4] == [0.01, 0.02, None, 0.04] and gap["k3_kl_late"] == pytest.approx(0.185)
    assert smooth([1.0, None, 3.0, None], 2) == [1.0, 1.0, 3.0, 3.0] and math.isnan(smooth([None], 3)[0])
    drawn = []
    monkeypatch.setattr("matplotlib.axes.Axes.plot", lambda ax, *a, **k: drawn.append(a) or [Line2D([], [])])
    plot(result, tmp_path / "compare.png")
    reward = drawn[0]  # 10-step trailing means of steps 1..20, seed 0's step 3 left out of its windows
    assert list(reward[0]) == list(range(1, 21)) and reward[1][-1] == pytest.approx(15.5)
    assert reward[1][2] == pytest.approx((1.5 + 2) / 2)  # seed 0: mean(1, 2); seed 1: mean(1, 2, 3)


def test_falls_and_collapses_are_counted_apart_and_a_pair_needs_both_numbers(tmp_path):
    cfg = CompareConfig(methods=["tis"], formats=["mxfp4"], seeds=[0, 1], out=str(tmp_path))
    kl, nan = [0.1] * 10, float("nan")
    runs = {("tis", 0): _fake_rows([0.7] * 10, {5: 0.4, 10: 0.2}, 0.3, kl),  # held-out falls 20 points, reward flat
            ("tis", 1): _fake_rows([0.6] * 10, {5: 0.3, 10: 0.3}, 0.3, kl),  # neither
            ("ref", 0): _fake_rows([0.5] * 10, {5: 0.3, 10: 0.3}, 0.3, kl),
            ("ref", 1): _fake_rows([0.5] * 8 + [nan] * 2, {5: 0.3, 10: 0.3}, 0.3, kl)}  # last fifth: nothing scored
    for run in plan(cfg):
        _write_run(run.path(tmp_path), runs[("ref" if run.reference else "tis", run.seed)])
    g = aggregate(cfg, plan(cfg), max_steps=10)["groups"]["mxfp4/tis"]
    assert (g["falls"], g["collapses"]) == (1, 0)
    assert g["paired_seeds"] == [0] and g["reward_vs_reference"] == pytest.approx((0.7 - 0.5, None))


def test_paired_differences_leave_out_seeds_whose_runs_started_apart(tmp_path):
    cfg = CompareConfig(methods=["tis"], formats=["mxfp4"], seeds=[0, 1, 2], out=str(tmp_path))
    for run in plan(cfg):
        d = run.path(tmp_path)
        base = 0.5 if run.reference else {0: 0.4, 1: 0.9, 2: 0.8}[run.seed]  # tis - reference: -0.1, +0.4, +0.3
        _write_run(d, _fake_rows([base] * 10, {10: 0.3}, 0.2, [0.1] * 10))
        start = "bb" if (run.seed, run.reference) == (1, False) else "aa"  # seed 1's tis run began elsewhere
        (d / "start.json").write_text(json.dumps({"weights": start}))
        (d / "checkpoints" / "step_000010").mkdir(parents=True)
        (d / "checkpoints" / "step_000010" / "state.pt").write_bytes(b"")
        policy = 0.5 if run.reference else {0: 0.6, 1: 0.1, 2: 0.9}[run.seed]  # tis - reference: +0.1, -0.4, +0.4
        scores = {"policy_reward": policy, "sampler_reward": 0.4, "held_reward": 0.3, "held_accuracy": 0.2}
        _cache(d, "step_000010", scores, samples=4)
    result = aggregate(cfg, plan(cfg), max_steps=10)
    g = result["groups"]["mxfp4/tis"]
    assert result["mixed_starts"] == [1] and g["paired_seeds"] == [0, 2] and g["policy_paired_seeds"] == [0, 2]
    # the final model's difference, the same pairs: mean 0.25 of (+0.1, +0.4), SD (0.15^2 + 0.15^2) / (2 - 1)
    assert g["policy_vs_reference"] == pytest.approx((0.25, math.sqrt(0.045)))
    # seeds 0 and 2 only: mean 0.1 and SD of (-0.1, +0.3); seed 1 kept would make it 0.2, a reversed sign -0.1
    assert g["reward_vs_reference"] == pytest.approx((0.1, math.sqrt(0.08)))  # SD: (0.2^2 + 0.2^2) / (2 - 1)
    shown = table(result)
    assert "(2 pairs)" in shown and "Seeds [1] hold runs that started from different weights" in shown


def test_only_current_final_scores_are_aggregated(tmp_path):
    cfg = CompareConfig(methods=["tis"], formats=["mxfp4"], seeds=[0, 1, 2], reference=False, out=str(tmp_path))
    for seed, scored_step in ((0, 10), (1, 8), (2, None)):  # seed 1's scores are of an earlier checkpoint
        d = Run("mxfp4", "tis", seed).path(tmp_path)
        (d / "checkpoints" / "step_000010").mkdir(parents=True)
        (d / "checkpoints" / "step_000010" / "model.safetensors").write_bytes(b"")
        (d / "checkpoints" / "step_000010" / "state.pt").write_bytes(b"")
        _write_run(d, _fake_rows([0.5] * 10, {10: 0.3}, 0.2, [0.1] * 10))
        if scored_step is not None:
            scores = {"policy_reward": 0.7 + seed / 10, "sampler_reward": 0.6, "held_reward": 0.5, "held_accuracy": 0.1}
            _cache(d, f"step_{scored_step:06d}", scores, samples=4)
    g = aggregate(cfg, plan(cfg), max_steps=10)["groups"]["mxfp4/tis"]
    assert "policy_reward" in g["runs"]["0"] and "policy_reward" not in g["runs"]["1"]
    assert g["policy_reward"] == (0.7, None)  # seed 0 alone; seeds 1 (stale) and 2 (unscored) left out
    assert "| mxfp4 | tis | 1 |" in final_table(aggregate(cfg, plan(cfg), max_steps=10))
    other = CompareConfig(**{**cfg.__dict__, "final_samples": 8})  # scores of other settings do not count
    assert aggregate(other, plan(other), max_steps=10)["groups"]["mxfp4/tis"]["policy_reward"] == (None, None)
    mixed = CompareConfig(**{**cfg.__dict__, "train": ["rollout.keep=[model.layers.0.*]"]})  # mixed precision is named
    assert "| mxfp4 keeping model.layers.0.* | tis | 1 |" in final_table(aggregate(mixed, plan(mixed), max_steps=10))
    # a run retrained in place keeps its checkpoint's name, not its weights: the cache is not of this model
    (Run("mxfp4", "tis", 0).path(tmp_path) / "checkpoints" / "step_000010" / "model.safetensors").write_bytes(b"new")
    assert aggregate(cfg, plan(cfg), max_steps=10)["groups"]["mxfp4/tis"]["policy_reward"] == (None, None)


def test_a_run_whose_scoring_fails_is_left_out_not_shown_with_an_earlier_cache(tmp_path, monkeypatch):
    cfg = CompareConfig(methods=["tis"], formats=["mxfp4"], seeds=[0], reference=False, out=str(tmp_path), jobs=0,
                        final_samples=4, train=["max_steps=10"])  # fmt: skip
    d = Run("mxfp4", "tis", 0).path(tmp_path)
    _write_run(d, _fake_rows([0.5] * 10, {10: 0.3}, 0.2, [0.1] * 10))
    for name in ("model.safetensors", "state.pt"):
        (d / "checkpoints" / "step_000010" / name).parent.mkdir(exist_ok=True)
        (d / "checkpoints" / "step_000010" / name).write_bytes(b"")
    _cache(d, "step_000010", {"policy_reward": 0.7}, samples=4)  # an earlier scoring's cache
    assert aggregate(cfg, plan(cfg), max_steps=10)["groups"]["mxfp4/tis"]["policy_reward"] == (0.7, None)

    def fails(*a, **k):
        raise ValueError("dataset moved")

    monkeypatch.setattr("aisrl.final_eval.evaluate_final", fails)
    logs = []
    g = run_study(cfg, log=logs.append)["groups"]["mxfp4/tis"]
    assert any("could not score mxfp4/tis seed 0 (dataset moved); its final-model scores stay empty" in m for m in logs)
    assert g["policy_reward"] == (None, None) and "policy_reward" not in g["runs"]["0"]  # as the log says


def test_a_study_trained_elsewhere_aggregates_here_and_scores_only_the_studys_final_models(tmp_path, monkeypatch):
    # trained on a GPU (device=cuda), aggregated on this CPU with jobs=0: only runs to train must train here
    cfg = CompareConfig(methods=["tis"], formats=["mxfp4"], seeds=[0, 1], reference=False, out=str(tmp_path), jobs=0,
                        final_samples=4, train=["max_steps=10", "device=cuda:7"])  # fmt: skip
    _write_run(Run("mxfp4", "tis", 0).path(tmp_path), _fake_rows([0.5] * 10, {10: 0.3}, 0.2, [0.1] * 10))
    _write_run(Run("mxfp4", "tis", 1).path(tmp_path), _fake_rows([0.5] * 20, {20: 0.3}, 0.2, [0.1] * 20))
    scored, logs = [], []
    monkeypatch.setattr("aisrl.final_eval.evaluate_final", lambda run, *a, **k: scored.append(Path(run).name) or {})
    g = run_study(cfg, log=logs.append)["groups"]["mxfp4/tis"]  # before: "device 'cuda:7' asked for, but ..."
    assert sorted(g["runs"]) == ["0", "1"]
    # seed 1 went on to step 20: its final model is not the study's, and scoring it (for nothing) is skipped
    assert scored == ["seed0"] and any("seed 1 went on past step 10 (latest checkpoint: step 20)" in m for m in logs)
    cfg.jobs = 1  # a run left to train must be able to train here
    _write_run(Run("mxfp4", "tis", 0).path(tmp_path), _fake_rows([0.5] * 9, {}, 0.2, [0.1] * 9))
    with pytest.raises(ValueError, match="mxfp4/tis cannot train with these settings: device 'cuda:7'"):
        run_study(cfg, log=logs.append)


def test_the_published_machine_is_where_the_runs_trained_and_counts_rest_on_finite_values(tmp_path):
    """A study trained on a GPU and aggregated on a CPU named the CPU beside GPU timings; a NaN final score, or
    steps without timings or k3, were counted or drawn as numbers."""
    from aisrl.compare_report import _kl_curve

    cfg = CompareConfig(methods=["tis"], formats=["int4"], seeds=[0, 1, 2], out=str(tmp_path / "s"))
    gpu = {"cuda": "NVIDIA H100 80GB HBM3", "cpu": "Xeon 8480+", "processor": "x86_64", "cpus": 208, "torch": "2.5"}
    cpu = {"cuda": None, "cpu": "EPYC 9654", "processor": "x86_64", "cpus": 2, "torch": "2.13"}
    one_thread = {**gpu, "torch_threads": 1}  # a subprocess of jobs=N: the same machine, said once
    for run in plan(cfg):
        rows = _fake_rows([0.5] * 5, {5: 0.4}, 0.3, [0.05] * 5)
        if run.seed == 2:  # steps 2-4 scored no token (no k3), and nothing was timed
            rows = [{k: v for k, v in r.items() if not k.startswith("time_") and (k != "k3_kl" or r["step"] in (1, 5))}
                    for r in rows]  # fmt: skip
        _write_run(run.path(cfg.out), rows)
        (run.path(cfg.out) / "checkpoints/step_000005").mkdir()
        (run.path(cfg.out) / "checkpoints/step_000005/state.pt").write_bytes(b"")
        where = (one_thread if run.reference else gpu) if run.seed < 2 else cpu
        (run.path(cfg.out) / "start.json").write_text(json.dumps({"weights": "w", "machine": where}))
        _cache(run.path(cfg.out), "step_000005", {"policy_reward": math.nan if run.seed == 1 else 0.5,
                                                 "sampler_reward": 0.4, "held_reward": 0.3, "held_accuracy": 0.2},
               samples=4)  # fmt: skip
    result = aggregate(cfg, plan(cfg), max_steps=5)
    assert [m["cpus"] for m in result["trained_on"]] == [208, 2] and result["machine"]["cuda"] == gpu["cuda"]
    assert result["aggregated_on"]["cpus"]
    (tmp_path / "BENCHMARKS.md").write_text("# Benchmarks\n")
    publish(cfg, result, root=tmp_path)
    text = (tmp_path / "BENCHMARKS.md").read_text()
    said = "Machines the runs started on: NVIDIA H100 80GB HBM3, Xeon 8480+, 208 CPUs, torch 2.5; EPYC 9654, 2 CPUs"
    assert said in text
    g = result["groups"]["int4/tis"]
    assert g["runs"]["2"]["seconds_per_step"] is None and g["runs"]["2"]["time_share"]["time_rollout"] is None
    assert g["seconds_per_step"][0] == pytest.approx(5.0)  # the timed seeds' mean (before: seed 2 counted as 1 s)
    assert g["policy_paired_seeds"] == [0, 2] and g["paired_seeds"] == [0, 1, 2]  # seed 1's final score is NaN
    assert "| int4 | tis | 2 | 0.500 ± 0.000 |" in final_table(result)  # two scores, not three runs
    assert _kl_curve(list(g["runs"].values()), 5)[1:4] == pytest.approx([0.05] * 3)  # seed 2's gaps: not zeros
    only = {"2": g["runs"]["2"]}
    assert all(math.isnan(k) for k in _kl_curve(list(only.values()), 5)[1:4])  # no seed measured: a gap
    assert "| int4 | tis |" in table(result)
    # results written before the reference key: the tables as well as the figure
    for name in ("compare", "compare_lab_columns"):
        old = json.loads((Path(__file__).parent.parent / f"benchmarks/results/{name}.json").read_text())
        assert "reference" not in next(iter(old["groups"].values())) and table(old) and final_table(old) is not None


def test_the_published_command_is_the_whole_study(tmp_path, monkeypatch):
    cfg = CompareConfig(methods=["none"], formats=["int4"], seeds=[0], reference=False, out=str(tmp_path / "s"))
    _write_run(Run("int4", "none", 0).path(cfg.out), _fake_rows([0.2], {1: 0.3}, 0.25, [0.01]))
    (tmp_path / "BENCHMARKS.md").write_text("# Benchmarks\n")
    argv = ["aisrl", "compare", "lab", "methods=[none]", "only=[int4/none]", "jobs=2", "publish=true"]
    monkeypatch.setattr("sys.argv", argv)  # published from the last piece of a study run group by group
    publish(cfg, aggregate(cfg, plan(cfg), max_steps=1), root=tmp_path)
    assert "Command: `aisrl compare lab 'methods=[none]'`" in (tmp_path / "BENCHMARKS.md").read_text()


def test_publish_without_matplotlib_is_refused_before_any_run(tmp_path, monkeypatch):
    # publish drew the figure after the JSON was replaced: a traceback, and BENCHMARKS.md left behind its JSON
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.chdir(tmp_path)  # publish writes under the working directory: never into the repository
    monkeypatch.setattr("aisrl.compare._run_here", lambda *a: pytest.fail("trained before refusing"))
    cfg = CompareConfig(methods=["none"], formats=["int4"], seeds=[0], reference=False, out=str(tmp_path / "s"),
                        publish=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"publish=true draws the study's figure.*aisrl\[plot\]"):
        run_study(cfg, log=lambda *a: None)
    assert not (tmp_path / "s").exists()


def test_publish_writes_results_and_benchmarks_section(tmp_path):
    cfg = CompareConfig(methods=["none"], formats=["int4"], seeds=[0], reference=False, out=str(tmp_path / "s"))
    _write_run(Run("int4", "none", 0).path(cfg.out), _fake_rows([0.2], {1: 0.3}, 0.25, [0.01]))
    result = aggregate(cfg, plan(cfg), max_steps=1)
    (tmp_path / "BENCHMARKS.md").write_text("# Benchmarks\n\nkept\n")
    publish(cfg, result, root=tmp_path)
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "kept" in text and "<!-- BEGIN compare -->" in text
    assert "| int4 | none | 1 | 25.0 | 30.0 | 30.0 | 0/1 |" in text and "| - |" in text  # one seed: no ± spread
    m = result["machine"]  # the machine line names the CPU model where there is one, not just "x86_64", after the GPU
    gpu = f"{m['cuda']}, " if m["cuda"] else ""
    assert f"Machine: {gpu}{m.get('cpu') or m['processor']}, {m['cpus']} CPUs, torch {m['torch']}; 1 steps" in text
    two = [m, {**m, "cpus": 99}]
    for where, said in (([m], "Machine the runs started on: "), (two, "Machines the runs started on: ")):
        publish(cfg, {**result, "trained_on": where}, root=tmp_path)  # start.json's machines, one or several
        text = (tmp_path / "BENCHMARKS.md").read_text()
        assert said in text and ("99 CPUs" in text) == (len(where) == 2)
    assert (tmp_path / "benchmarks/results/compare.png").exists()
    cfg.preset = "diffusion_lab"  # another preset's study keeps its own section and files
    publish(cfg, result, root=tmp_path)
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "<!-- BEGIN compare -->" in text and "<!-- BEGIN compare_diffusion_lab -->" in text
    assert (tmp_path / "benchmarks/results/compare_diffusion_lab.json").exists()
    cfg.section = "compare_second"  # a second study of one preset, published beside the first
    publish(cfg, result, root=tmp_path)
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "<!-- BEGIN compare_diffusion_lab -->" in text and "<!-- BEGIN compare_second -->" in text
    assert (tmp_path / "benchmarks/results/compare_second.png").exists()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"methods": ["nope"]}, "unknown method 'nope'; choose from"),
        ({"formats": ["fp7"]}, "unknown quantisation preset 'fp7'"),
        ({"only": ["int4/ais"]}, "only='int4/ais' is not a group"),
        ({"seeds": []}, "nothing to compare"),
        ({"formats": [], "reference": False}, "nothing to compare"),  # before: an empty study, exit 0
        ({"seeds": [0, 1, 0]}, r"seeds lists \[0\] more than once"),
        ({"methods": ["tis", "tis"]}, r"methods lists \[.tis.\] more than once"),
        ({"jobs": -1}, "jobs must be >= 0"),
        ({"fall": 0.0}, "fall must be an accuracy drop in"),  # before: every run fell
        ({"fall": 8.0}, "fall must be an accuracy drop in .* got 8.0"),  # before: none ever would (800 points)
        ({"collapse_fraction": 1.5}, "collapse_fraction must be a fraction in"),
        ({"final_samples": -3}, "final_samples must be >= 0"),
        ({"section": "../BENCHMARKS"}, "section='../BENCHMARKS' names a file"),
        ({"train": ["seed=3"]}, "seed is set per run by the study; choose it with seeds="),
        ({"train": ["output_dir=runs/x"]}, "output_dir is set per run by the study; choose it with out="),
        ({"train": ["rollout.quant=int4"]}, "rollout.quant is set per run by the study; choose it with formats="),
        ({"train": ["correction.name=tis"]}, "correction.name is set per run by the study; choose it with methods="),
    ],
)
def test_bad_study_configs_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        plan(CompareConfig(**kwargs))


def test_cli_reports_a_bad_method_without_running(tmp_path, capsys):
    assert main(["compare", "methods=[nope]", f"out={tmp_path}"]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_cli_prints_the_final_models_table_where_they_were_scored(tmp_path, capsys, monkeypatch):
    g = {"format": "fp8", "method": "ais", "reference": False, "runs": {"0": {"policy_reward": 0.5}}, "missing": [],
         "policy_reward": (0.5, None), "policy_vs_reference": (None, None), "sampler_reward": (0.4, None),
         "held_accuracy": (0.3, None)}  # fmt: skip
    monkeypatch.setattr("aisrl.compare.run_study", lambda cfg: {"groups": {"fp8/ais": g}})
    monkeypatch.setattr("aisrl.compare_report.table", lambda result: "main table")
    assert main(["compare", f"out={tmp_path}"]) == 0
    shown = capsys.readouterr().out
    assert "main table" in shown and "| fp8 | ais | 1 | 0.500 |" in shown


def test_settings_one_method_cannot_train_with_are_refused_before_any_run(tmp_path, capsys):
    """qarl refuses LoRA: the study says so before the warm start is built or the other methods train."""
    args = ["compare", "methods=[tis,qarl]", "formats=[int4]", "seeds=[0]", f"out={tmp_path}", "lora.r=4"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "int4/qarl cannot train with these settings: rollout.align (QaRL) needs" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())
    assert main(["compare", "methods=[tis]", "formats=[int4]", "seeds=[0]", f"out={tmp_path}",
                 "correction.cap=-1"]) == 2  # fmt: skip
    assert "reference cannot train" not in (err := capsys.readouterr().err) and "int4/tis cannot train" in err


def test_failed_runs_are_one_line_naming_them(monkeypatch, capsys):
    import aisrl.compare as compare
    from aisrl.jobs import RunsFailed

    def fail(cfg, log=print):
        raise RunsFailed("1 runs failed (int4/tis seed 0); each one's train.log says why")

    monkeypatch.setattr(compare, "run_study", fail)
    assert main(["compare", "methods=[tis]"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("aisrl: error: 1 runs failed (int4/tis seed 0)") and "Traceback" not in err


def test_aggregate_only_with_jobs_zero_runs_nothing(tmp_path, monkeypatch):
    cfg = CompareConfig(methods=["none"], formats=["int4"], seeds=[0], out=str(tmp_path), jobs=0)
    _write_run(Run("int4", "none", 0).path(cfg.out), _fake_rows([0.5] * 3, {3: 0.3}, 0.2, [0.1] * 3))
    cfg.train = ["max_steps=3"]
    result = run_study(cfg, log=lambda _: None)
    assert result["groups"]["reference"]["missing"] == [0] and not list(tmp_path.glob("reference/seed0"))
    # a mistyped out= finds no finished run: refused, so publish=true cannot replace the table with an empty one
    # (before: exit 0, an empty compare.json, and with publish the published section emptied)
    (tmp_path / "BENCHMARKS.md").write_text("kept")
    monkeypatch.chdir(tmp_path)
    typo = CompareConfig(methods=["none"], formats=["int4"], seeds=[0], out=str(tmp_path / "typo"), jobs=0,
                         publish=True, train=["max_steps=3"])  # fmt: skip
    with pytest.raises(ValueError, match=r"no run of this study has finished under out=.*typo'"):
        run_study(typo, log=lambda _: None)
    assert not (tmp_path / "typo").exists() and (tmp_path / "BENCHMARKS.md").read_text() == "kept"
    with pytest.raises(ValueError, match="out is empty"):
        plan(CompareConfig(out=" "))
    # a training key a method's recipe sets in its runs was overridden there silently (a `tis` row, next to a
    # `calibrated` one, trained with the user's calibrate_every while the calibrated one took the recipe's 1)
    clash = CompareConfig(methods=["tis", "calibrated", "solrl"],
                          train=["rollout.pool=32", "correction.calibrate_every=4"])  # fmt: skip
    with pytest.raises(ValueError, match=r"method 'calibrated' sets \['correction.calibrate_every=1'\] in each of "
                                         r"its runs, which \['correction.calibrate_every=4'\] would not change"):
        plan(clash)
    clash.methods = ["tis", "solrl"]
    with pytest.raises(ValueError, match=r"method 'solrl' sets \['rollout.pool=16'\]"):
        plan(clash)
    clash.train = ["correction.calibrate_every=4"]
    assert {r.method for r in plan(clash)} == {"tis", "solrl", "none"}  # a key no recipe chosen sets
    same = CompareConfig(methods=["ais", "qarl"], train=["correction.mask_errors=True"])  # the recipe's own value
    assert {r.method for r in plan(same)} == {"ais", "qarl", "none"}
    # ... given once to each run: `aisrl train` (a study's subprocesses, jobs > 1) refuses a key given twice
    from aisrl.config import check_once

    qarl = next(r for r in plan(same) if r.method == "qarl").overrides(same)
    check_once(qarl)
    assert "correction.mask_errors=True" in qarl and "loss=tbpo" in qarl
    with pytest.raises(ValueError, match="method 'qarl' sets"):
        plan(CompareConfig(methods=["ais", "qarl"], train=["correction.mask_errors=false"]))


def test_a_study_re_run_with_other_overrides_is_refused(tmp_path):
    """A finished run is skipped by the step count alone; its recorded config keeps a changed study from
    aggregating it as if it had been trained with the new overrides."""
    from dataclasses import asdict

    from aisrl.train_config import load_config

    cfg = CompareConfig(methods=["tis"], formats=["int4"], seeds=[0], out=str(tmp_path), jobs=0, train=["lr=1e-3"])
    for run in plan(cfg):
        run.path(cfg.out).mkdir(parents=True)
        recorded = asdict(load_config("lab", [*run.overrides(cfg)[1:], "max_steps=7"]))  # trained without lr=1e-3
        (run.path(cfg.out) / "config.json").write_text(json.dumps(recorded))
        (run.path(cfg.out) / "checkpoints").mkdir()
        (run.path(cfg.out) / "checkpoints" / "latest").write_text("step_000007")  # a record with weights behind it
    with pytest.raises(ValueError, match=r"reference/seed0 was trained with other settings \(lr: 0.0005 -> 0.001\)"):
        run_study(cfg, log=lambda _: None)
    cfg.train = ["lr=5e-4", "max_steps=9"]  # the recorded settings (the length may differ): past the check, to find
    with pytest.raises(ValueError, match="no run of this study has finished"):  # that nothing has finished
        run_study(cfg, log=lambda _: None)
    for run in plan(cfg):  # no weights behind the records: a re-run trains them afresh under the new settings
        (run.path(cfg.out) / "checkpoints" / "latest").unlink()
        rows = _fake_rows([0.5] * 7, {7: 0.3}, 0.2, [0.1] * 7)  # every row logged, killed saving step 7
        (run.path(cfg.out) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg.train = ["lr=1e-3", "max_steps=7"]  # not refused, and not aggregated as if trained with lr=1e-3
    with pytest.raises(ValueError, match="no run of this study has finished"):
        run_study(cfg, log=lambda _: None)


@pytest.mark.parametrize("train", [["model.kind=diffusion"]])
def test_final_scores_are_skipped_where_unsupported(tmp_path, monkeypatch, train):
    import aisrl.compare as compare
    import aisrl.final_eval as fe

    def must_not_run(*a, **k):
        raise AssertionError("scored a run final_eval cannot load")

    monkeypatch.setattr(fe, "evaluate_final", must_not_run)
    cfg = CompareConfig(methods=["none"], formats=["int4"], seeds=[0], out=str(tmp_path), jobs=0, train=train)
    logs = []
    compare._evaluate_finals(cfg, plan(cfg), logs.append, 10)  # every run given as finished
    assert logs == ["compare: final-model scores need causal runs (not diffusion); skipped"]


def test_the_reference_rolls_out_at_full_precision_on_a_cpu_and_in_bf16_on_a_gpu(monkeypatch, tmp_path):
    import torch

    import aisrl.train_config as tc
    from aisrl.compare_report import _rollout

    cfg = CompareConfig(methods=["tis"], formats=["int4"], seeds=[0], out=str(tmp_path), train=["device=cpu"])
    ref = plan(cfg)[0]
    assert (ref.group, ref.fmt, ref.path(cfg.out)) == ("reference", "none", tmp_path / "reference" / "seed0")
    assert "rollout.quant=none" in ref.overrides(cfg) and "correction.name=none" in ref.overrides(cfg)
    monkeypatch.setattr(tc, "resolve_device", lambda name: torch.device("cuda"))  # what 'auto' finds on a GPU
    cfg.train = []
    ref = plan(cfg)[0]
    assert ref.group == "reference" and "rollout.quant=bf16_w16a16" in ref.overrides(cfg)
    cfg.train = ["rollout.engine=static"]  # whose full precision is BF16 on a GPU already
    assert "rollout.quant=none" in plan(cfg)[0].overrides(cfg)
    assert reference_label(cfg, "none") == "BF16 (static engine)"
    cfg.train = []
    assert reference_label(cfg, "none") == "full precision" and reference_label(cfg, "fp8") == "fp8 (reference)"
    (tmp_path / "reference" / "seed3").mkdir(parents=True)  # a study begun on a CPU keeps its reference on a GPU
    (tmp_path / "reference" / "seed3" / "config.json").write_text(json.dumps({"rollout": {"quant": "none"}}))
    assert "rollout.quant=none" in plan(cfg)[0].overrides(cfg)
    (tmp_path / "reference" / "seed3" / "config.json").unlink()
    cfg.reference_format = "none"  # chosen, not resolved
    assert "rollout.quant=none" in plan(cfg)[0].overrides(cfg)
    cfg.reference_format = "fp16"
    with pytest.raises(ValueError, match="unknown quantisation preset 'fp16'; choose from .*'bf16_w16a16'"):
        plan(cfg)
    assert _rollout({"format": "bf16_w16a16", "reference": True}) == "bf16_w16a16 (reference)"
    assert _rollout({"format": "none", "reference": True}) == _rollout({"format": "none"}) == "full precision"
    assert _rollout({"format": "bf16_w16a16", "reference": False}) == "bf16_w16a16"  # compared as a format


def test_the_reference_label_follows_where_its_runs_trained(monkeypatch, tmp_path):
    import torch

    import aisrl.train_config as tc

    static = ["rollout.engine=static"]
    cfg = CompareConfig(methods=["tis"], formats=["int4"], seeds=[0], out=str(tmp_path), train=static)
    monkeypatch.setattr(tc, "resolve_device", lambda name: torch.device("cpu"))  # aggregated on a CPU
    assert reference_label(cfg, "none") == "full precision"  # nothing trained yet: by where it would train
    run = tmp_path / "reference" / "seed0"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"device": "auto", "rollout": {"quant": "none", "engine": "static"}}))
    (run / "start.json").write_text(json.dumps({"weights": "0", "machine": {"cuda": "NVIDIA H100"}}))
    assert reference_label(cfg, "none") == "BF16 (static engine)"  # its runs trained on a GPU's static engine
    (run / "start.json").write_text(json.dumps({"weights": "0", "machine": {"cuda": None}}))
    assert reference_label(cfg, "none") == "full precision"  # trained on a CPU
    monkeypatch.setattr(tc, "resolve_device", lambda name: torch.device("cuda"))  # and aggregated on a GPU
    assert reference_label(cfg, "none") == "full precision"
    (run / "config.json").write_text(json.dumps({"device": "cuda:0", "rollout": {"quant": "none", "engine": "hf"}}))
    assert reference_label(cfg, "none") == "full precision"  # the HF sampler's 'none' on a GPU is FP32
    # on this CPU, a run from before start.json that named its GPU, and a study whose reference has not trained yet
    monkeypatch.undo()
    (run / "start.json").unlink()
    (run / "config.json").write_text(json.dumps({"device": "cuda", "rollout": {"quant": "none", "engine": "static"}}))
    assert reference_label(cfg, "none") == "BF16 (static engine)"  # before: "device 'cuda' asked for, but ..."
    gpu = CompareConfig(methods=["tis"], formats=["int4"], seeds=[0], out=str(tmp_path / "new"), jobs=0,
                        train=["device=cuda:7", "rollout.engine=static"])  # fmt: skip
    assert plan(gpu)[0].fmt == "none" and reference_label(gpu, "none") == "BF16 (static engine)"


def test_recipes_become_training_overrides():
    cfg = CompareConfig(methods=["qarl", "solrl", "ais"], formats=["mxfp4_w4a4"], seeds=[1], reference=False)
    qarl, solrl, ais = plan(cfg)
    assert "rollout.align=true" in qarl.overrides(cfg) and "loss=tbpo" in qarl.overrides(cfg)
    assert "rollout.pool=16" in solrl.overrides(cfg) and "correction.name=ais" in ais.overrides(cfg)
    from aisrl.train_config import load_config

    for run in (qarl, solrl, ais):  # every recipe is a valid training config
        c = load_config("lab", run.overrides(cfg))
        assert c.rollout.quant == "mxfp4_w4a4" and c.seed == 1


def test_paired_seeds_pools_directories_and_pairs_by_seed(tmp_path, monkeypatch):
    mod = load_benchmark("paired_seeds")
    monkeypatch.setattr(mod, "ROOT", tmp_path)

    def run(d, kind, seed, rewards):
        p = tmp_path / d / kind / f"seed{seed}"
        p.mkdir(parents=True)
        rows = [json.dumps({"step": i + 1, "reward": r}) + "\n" for i, r in enumerate(rewards)]
        (p / "metrics.jsonl").write_text("".join(rows))

    # 10 steps: the last fifth is the last 2; seed 1 lives in a second directory; seed 2's tis run is unfinished
    for seed, base in ((0, 0.5), (1, 0.6), (2, 0.7)):
        run("a" if seed == 0 else "b", "reference", seed, [0.0] * 8 + [base, base])
        run("a" if seed == 0 else "b", "fmt/none", seed, [0.0] * 8 + [base - 0.1, base - 0.1])
    run("a", "fmt/tis", 0, [0.0] * 8 + [0.45, 0.47])
    run("b", "fmt/tis", 1, [0.0] * 8 + [0.6, 0.6])
    run("b", "fmt/tis", 2, [0.0] * 5)
    out = mod.main([tmp_path / "a", tmp_path / "b"], "fmt", ["none", "tis"], steps=10, overwrite=True)
    none, tis = out["vs_full_precision"]["none"], out["vs_full_precision"]["tis"]
    assert none["seeds"] == [0, 1, 2] and abs(none["mean"] + 0.1) < 1e-12 and none["std"] < 1e-12
    assert tis["seeds"] == [0, 1] and abs(tis["mean"] - (-0.04 + 0.0) / 2) < 1e-12
    pair = out["pairs"]["tis-none"]
    assert pair["seeds"] == [0, 1] and abs(pair["mean"] - 0.08) < 1e-12 and pair["positive"] == 2
    assert (tmp_path / "benchmarks/results/paired_fmt.json").exists()
    # two methods are compared on every seed both finished, also where no full-precision run exists yet
    run("b", "fmt/none", 3, [0.0] * 8 + [0.3, 0.3])
    run("b", "fmt/tis", 3, [0.0] * 8 + [0.2, 0.2])
    out = mod.main([tmp_path / "a", tmp_path / "b"], "fmt", ["none", "tis"], steps=10, overwrite=True)
    assert out["vs_full_precision"]["tis"]["seeds"] == [0, 1] and out["pairs"]["tis-none"]["seeds"] == [0, 1, 3]
    assert abs(out["pairs"]["tis-none"]["mean"] - (0.06 + 0.1 - 0.1) / 3) < 1e-12
    for kind in ("fmt/none", "fmt/tis"):
        (tmp_path / "b" / kind / "seed3" / "metrics.jsonl").unlink()
    run("c", "fmt/tis", 1, [0.0] * 8 + [0.9, 0.8])  # METHOD@DIR: tis under other settings, in its own directory
    out = mod.main([tmp_path / "a", tmp_path / "b"], "fmt", ["tis", f"tis@{tmp_path / 'c'}"], steps=10, overwrite=True)
    other = out["vs_full_precision"][f"tis@{tmp_path / 'c'}"]
    assert other["seeds"] == [1] and abs(other["mean"] - 0.25) < 1e-12  # paired with b's reference of seed 1
    assert out["pairs"][f"tis@{tmp_path / 'c'}-tis"]["seeds"] == [1]
    run("c", "fmt2/tis", 1, [0.0] * 8 + [0.7, 0.7])  # FORMAT/METHOD: the same method under another format
    abc = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    out = mod.main(abc, "fmt", ["tis", "fmt2/tis"], steps=10, overwrite=True)
    assert out["vs_full_precision"]["fmt2/tis"]["seeds"] == [1]
    assert abs(out["pairs"]["fmt2/tis-tis"]["mean"] - 0.1) < 1e-12
    # a final-model score instead: only runs that have a final_eval.json (of the model at `steps`) count
    for d, kind, seed, score in (("a", "reference", 0, 0.8), ("b", "reference", 1, 0.7), ("a", "fmt/tis", 0, 0.75),
                                 ("b", "fmt/tis", 1, 0.72), ("b", "fmt/tis", 2, 0.1)):  # fmt: skip
        _cache(tmp_path / d / kind / f"seed{seed}", "step_000010", {"policy_reward": score})
    out = mod.main([tmp_path / "a", tmp_path / "b"], "fmt", ["none", "tis"], 10, "policy_reward", overwrite=True)
    tis = out["vs_full_precision"]["tis"]  # seed 2's tis run is unfinished, so its score does not count
    assert tis["seeds"] == [0, 1] and abs(tis["mean"] - (-0.05 + 0.02) / 2) < 1e-12
    assert out["vs_full_precision"]["none"]["n"] == 0 and out["metric"] == "policy_reward"
    assert (tmp_path / "benchmarks/results/paired_fmt_policy_reward.json").exists()
    stale = tmp_path / "b" / "fmt/tis" / "seed1"  # trained on after it was scored: its score no longer counts
    (stale / "checkpoints" / "latest").write_text("step_000010")
    _cache(stale, "step_000010", {})
    old_scores = json.loads((stale / "final_eval.json").read_text())
    old_scores["settings"]["checkpoint"], old_scores["policy_reward"] = "step_000008", 0.72
    (stale / "final_eval.json").write_text(json.dumps(old_scores))
    out = mod.main([tmp_path / "a", tmp_path / "b"], "fmt", ["tis"], steps=10, metric="policy_reward", overwrite=True)
    assert out["vs_full_precision"]["tis"]["seeds"] == [0] and out["vs_full_precision"]["tis"]["std"] is None
    old_scores["settings"]["checkpoint"] = "step_000010"  # the final model's, but by a scorer of before a sampling fix
    for scorer, expected in ((None, None), (SCORER - 1, None), (SCORER, 0.72)):
        old_scores["settings"]["scorer"] = scorer
        (stale / "final_eval.json").write_text(json.dumps(old_scores))
        assert seeds.score(stale, 10, "policy_reward") == expected
    (stale / "checkpoints" / "step_000010" / "model.safetensors").write_bytes(b"retrained in place")
    assert seeds.score(stale, 10, "policy_reward") is None  # the weights scored are not there any more
    # the held-out greedy accuracy of the last step; a run that did not evaluate there does not count
    for d, kind, seed, acc in (("a", "reference", 0, 0.5), ("b", "reference", 1, 0.4), ("a", "fmt/none", 0, 0.45),
                               ("b", "fmt/none", 1, None)):  # fmt: skip
        m = tmp_path / d / kind / f"seed{seed}" / "metrics.jsonl"
        rows = [json.loads(line) for line in m.read_text().splitlines()]
        rows[4]["eval_accuracy"] = 0.9  # an earlier evaluation is not the final one
        if acc is not None:
            rows[-1]["eval_accuracy"] = acc
        m.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = mod.main([tmp_path / "a", tmp_path / "b"], "fmt", ["none"], steps=10, metric="greedy_accuracy", tag="x")
    none = out["vs_full_precision"]["none"]
    assert none["seeds"] == [0] and abs(none["mean"] + 0.05) < 1e-12
    assert (tmp_path / "benchmarks/results/paired_x_fmt_greedy_accuracy.json").exists()
    with pytest.raises(ValueError, match="unknown metric 'acc'; choose from"):
        mod.main([tmp_path / "a"], "fmt", ["tis"], steps=10, metric="acc")


def test_paired_seeds_reads_every_score_of_a_seed_from_one_run_and_protects_published_files(tmp_path, monkeypatch):
    mod = load_benchmark("paired_seeds")
    monkeypatch.setattr(mod, "ROOT", tmp_path)

    def run(d, kind, seed, reward, scored=None, held=None):
        p = tmp_path / d / kind / f"seed{seed}"
        p.mkdir(parents=True)
        (p / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward": reward}) + "\n" for i in (1, 2)))
        if scored:
            _cache(p, scored, {"held_accuracy": held})

    run("ref", "reference", 0, 0.5, "step_000002", 0.5)
    run("guarded", "fmt/tis", 0, 0.4)  # finished, never scored: its seed has no held accuracy...
    run("plain", "fmt/tis", 0, 0.3, "step_000002", 0.9)  # ...rather than the score of its unguarded twin
    dirs = [tmp_path / "ref", tmp_path / "guarded", tmp_path / "plain"]
    assert mod.main(dirs, "fmt", ["tis"], steps=2)["vs_full_precision"]["tis"]["mean"] == pytest.approx(-0.1)
    with pytest.raises(ValueError, match="nothing paired"):
        mod.main(dirs, "fmt", ["tis"], steps=2, metric="held_accuracy")
    assert not (tmp_path / "benchmarks/results/paired_fmt_held_accuracy.json").exists()
    # a final model scored at another step than the one asked for is not that step's model
    run("late", "fmt/none", 0, 0.5, "step_000002", 0.7)
    assert seeds.collect([tmp_path / "late"], "fmt/none", 2, "held_accuracy") == {0: 0.7}
    assert seeds.collect([tmp_path / "late"], "fmt/none", 1, "held_accuracy") == {}
    # every seed tied: printed, not a crash
    run("tied", "fmt/none", 0, 0.4)
    out = mod.main([*dirs[:2], tmp_path / "tied"], "fmt", ["tis", "none"], steps=2, tag="t")
    assert out["pairs"]["none-tis"]["ties"] == 1 and out["pairs"]["none-tis"]["sign_p"] is None
    # a file the docs may cite is not replaced by a comparison of other folders or methods
    with pytest.raises(ValueError, match="holds a comparison of other folders, methods or steps"):
        mod.main([tmp_path / "ref", tmp_path / "tied"], "fmt", ["none"], steps=2, tag="t")
    with pytest.raises(ValueError, match=r"steps 2\)"):  # before: a shorter comparison replaced it silently
        mod.main([*dirs[:2], tmp_path / "tied"], "fmt", ["tis", "none"], steps=1, tag="t")
    assert mod.main([tmp_path / "ref", tmp_path / "tied"], "fmt", ["none"], steps=2, tag="t", overwrite=True)
    with pytest.raises(ValueError, match="no such study folder"):
        mod.main([tmp_path / "nowhere"], "fmt", ["tis"], steps=2)


def test_mixed_starts_names_the_seeds_whose_runs_began_from_other_weights():
    groups = {"reference": {"runs": {"0": {"start": "aa"}, "1": {"start": "aa"}, "2": {"start": None}}},
              "f/ais": {"runs": {"0": {"start": "aa"}, "1": {"start": "bb"}, "2": {"start": "cc"}}},
              "f/tis": {"runs": {"3": {}}}}  # fmt: skip
    assert mixed_starts(groups) == [1]  # seed 2: the reference predates start.json, nothing to compare


def test_paired_seeds_refuses_runs_of_one_seed_from_different_warm_starts(tmp_path, monkeypatch):
    mod = load_benchmark("paired_seeds")
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    for kind, start in (("reference", "aa"), ("fmt/tis", "bb")):
        p = tmp_path / "a" / kind / "seed0"
        p.mkdir(parents=True)
        (p / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward": 0.5}) + "\n" for i in (1, 2)))
        (p / "start.json").write_text(json.dumps({"weights": start}))
    with pytest.raises(ValueError, match=r"seed 0\) started from different weights"):
        mod.main([tmp_path / "a"], "fmt", ["tis"], steps=2)
    (tmp_path / "a/fmt/tis/seed0/start.json").write_text(json.dumps({"weights": "aa"}))
    assert mod.main([tmp_path / "a"], "fmt", ["tis"], steps=2)["vs_full_precision"]["tis"]["mean"] == 0.0
    with pytest.raises(ValueError, match="methods=tis,tis names a method twice"):  # before: "holds a comparison of
        mod.main([tmp_path / "a"], "fmt", ["tis", "tis"], steps=2)  # other folders", with no file there


def test_guard_study_pairs_guarded_runs_with_their_unguarded_twins(tmp_path, monkeypatch):
    mod = load_benchmark("guard_study")
    monkeypatch.setattr(mod, "ROOT", tmp_path)

    def run(d, seed, rewards, evals, trips=()):
        p = tmp_path / d / "f/ais" / f"seed{seed}"
        p.mkdir(parents=True)
        rows = [{"step": i + 1, "reward": r, "accuracy": r} for i, r in enumerate(rewards)]
        rows[0]["eval_accuracy_start"] = 0.4
        for step, acc in evals.items():
            rows[step - 1]["eval_accuracy"] = acc
        for row in rows:
            if d == "g":
                row["guard_rollback"] = float(row["step"] in trips)
        (p / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    base = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    run("g", 0, base, {3: 0.5, 6: 0.48})  # never tripped: its own twin
    run("g", 1, base[:4] + [0.9, 0.9], {3: 0.5, 6: 0.55}, trips=(4,))  # tripped at 4: differs from step 5
    run("u", 1, base, {3: 0.5, 6: 0.35})  # the unguarded run fell (0.5 -> 0.35)
    run("g", 2, base, {6: 0.5}, trips=(2,))  # tripped, and no unguarded run of seed 2
    run("g", 3, base, {6: 0.5}, trips=(5,))
    run("u", 3, [0.1, 0.7, 0.3, 0.4, 0.5, 0.6], {6: 0.5})  # differs at step 2, before the trip: not a twin
    for d, weights in (("g", b"same"), ("u", b"same")):  # no trip, and the same final weights: twins
        run(d, 4, base, {6: 0.5})
        (tmp_path / d / "f/ais/seed4/checkpoints/step_000006").mkdir(parents=True)
        (tmp_path / d / "f/ais/seed4/checkpoints/step_000006/model.safetensors").write_bytes(weights)
    (tmp_path / "g/f/ais/seed4/final_eval.json").write_text('{"settings": {"weights_sha256": "x"}}')  # one scored
    out = mod.main([str(tmp_path / "g"), str(tmp_path / "u"), "group=f/ais", "steps=6", "tag=t"])
    by = {s["seed"]: s for s in out["seeds"]}
    assert by[4]["twin"] == "ok"  # before: "no trip, yet the runs differ", from the one run's final_eval.json
    (tmp_path / "u/f/ais/seed4/checkpoints/step_000006/model.safetensors").write_bytes(b"other")
    assert "no trip, yet the runs differ" in mod.twin_check(tmp_path / "g/f/ais/seed4", tmp_path / "u/f/ais/seed4",
                                                            [], 6)  # fmt: skip
    assert by[0]["twin"] == "itself (no trip)" and by[0]["greedy_accuracy_none"] == 0.48
    assert by[1]["twin"] == "ok" and by[1]["trips"] == [4] and (by[1]["fell_guard"], by[1]["fell_none"]) == (0, 1)
    assert by[2]["twin"].startswith("missing") and "before the first trip (5)" in by[3]["twin"]
    assert out["unpaired"] == [2, 3] and out["falls"] == {"guard": 0, "none": 1}
    assert (out["tripped"], out["trips"]) == (1, 1)
    greedy = out["guard_minus_none"]["all"]["greedy_accuracy"]
    assert greedy["n"] == 3 and greedy["mean"] == pytest.approx((0.0 + 0.20 + 0.0) / 3) and greedy["ties"] == 2
    assert out["guard_minus_none"]["tripped"]["greedy_accuracy"]["n"] == 1
    assert json.loads((tmp_path / "benchmarks/results/guard_t.json").read_text())["falls"]["none"] == 1
    assert out["unfinished"] == []
    run("g", 5, base[:3], {})  # a guarded run stopped at step 3 of 6: named, not dropped without a word
    assert mod.main([str(tmp_path / "g"), str(tmp_path / "u"), "group=f/ais", "steps=6", "tag=t"])["unfinished"] == [
        str(tmp_path / "g/f/ais/seed5")]  # fmt: skip
    with pytest.raises(SystemExit, match="unknown keys"):
        mod.main([str(tmp_path / "g"), str(tmp_path / "u"), "grup=f/ais"])


def test_guard_replay_finds_the_guards_trips_and_slow_drifts(tmp_path, monkeypatch):
    mod = load_benchmark("guard_replay")
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    # the trainer's rule: step 11 trips; step 12's jump has no update to undo (restored), so it only rebases
    assert mod.jump_trips([0.01] * 10 + [0.1, 0.1] + [0.01] * 3, 4.0, 10) == [11]
    assert mod.jump_trips([0.01] * 4 + [1.0], 4.0, 10) == []  # fewer than half the window seen: no baseline yet

    def run(group, seed, k3, evals, logged=()):  # logged=None: trained with the guard off
        p = tmp_path / "study" / group / f"seed{seed}"
        p.mkdir(parents=True)
        rows = [{"step": i + 1, "reward": 0.5, "accuracy": 0.5, "k3_kl": v} for i, v in enumerate(k3)]
        rows[0]["eval_accuracy_start"] = 0.45
        for step, acc in evals.items():
            rows[step - 1]["eval_accuracy"] = acc
        for row in rows if logged is not None else []:
            row["guard_rollback"] = float(row["step"] in logged)
        (p / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    run("f/tis", 0, [0.01] * 20 + [0.1] + [0.01] * 9, {10: 0.5, 30: 0.5}, logged=(21,))  # one jump, guarded
    run("f/tis", 1, [0.01] * 20 + [0.01 + 0.003 * i for i in range(1, 11)], {10: 0.5, 30: 0.4}, None)  # drifts, falls
    run("f/tis", 2, [0.01] * 12, {10: 0.5})  # unfinished
    run("f/ais", 0, [0.02] * 30, {10: 0.5, 30: 0.55})
    # seed 1, anchor 10 (median 0.01), 5-step windows: the median of steps t-4..t is step t-2's k3,
    # 0.01 + 0.003 (t - 22), first above 0.02 at t = 26
    out = mod.main([str(tmp_path / "study"), "steps=30", "anchor=10", "drift_window=5", "tag=t"])
    by = {r["run"]: r for r in out["runs"]}
    assert sorted(by) == ["study/f/ais/seed0", "study/f/tis/seed0", "study/f/tis/seed1"]
    a, b = by["study/f/tis/seed0"], by["study/f/tis/seed1"]
    assert (a["trips"], a["logged_trips"], a["drift"], a["fell"]) == ([21], [21], None, False)
    assert by["study/f/ais/seed0"]["logged_trips"] == []  # trained with the guard on, never tripped
    assert (b["trips"], b["drift"], b["fell"], b["best_step"], b["last_eval"]) == ([], 26, True, 10, 0.4)
    assert b["logged_trips"] is None
    assert by["study/f/ais/seed0"]["trips"] == [] and by["study/f/ais/seed0"]["drift"] is None
    assert out["falls"] == 1 and out["unfinished"] == [str(tmp_path / "study/f/tis/seed2")]
    assert out["flagged"] == {"jump": {"fell": 0, "healthy": 1}, "drift": {"fell": 1, "healthy": 0}}
    assert json.loads((tmp_path / "benchmarks/results/guard_replay_t.json").read_text())["falls"] == 1
    only = mod.main([str(tmp_path / "study"), "group=f/ais", "steps=30", "tag=t"])
    assert [r["run"] for r in only["runs"]] == ["study/f/ais/seed0"]
    with pytest.raises(SystemExit, match="unknown keys"):
        mod.main([str(tmp_path / "study"), "factr=4"])
    with pytest.raises(SystemExit, match="no run finished"):
        mod.main([str(tmp_path / "study"), "group=f/none", "steps=30"])
    with pytest.raises(SystemExit, match="no such folder"):
        mod.main([str(tmp_path / "stuyd")])
    with pytest.raises(SystemExit, match="drift_window='0': give a value of at least 1"):
        mod.main([str(tmp_path / "study"), "drift_window=0"])
    with pytest.raises(SystemExit, match="factor='x': give a number"):
        mod.main([str(tmp_path / "study"), "factor=x"])
    with pytest.raises(SystemExit, match=r"anchor=25 \+ drift_window=10 is longer than steps=30"):  # could never fire
        mod.main([str(tmp_path / "study"), "steps=30", "anchor=25"])
    run("f/ais", 7, [0.02] * 30, {30: 0.5})
    (tmp_path / "study/f/ais/seed7").rename(tmp_path / "study/f/ais/seed07")  # not a run of the study: not counted
    assert [r["run"] for r in mod.main([str(tmp_path / "study"), "group=f/ais", "steps=30", "tag=t"])["runs"]] == [
        "study/f/ais/seed0"]  # fmt: skip


def test_aggregation_reads_a_run_up_to_the_studys_step_not_its_row_count(tmp_path):
    # a run trained past the study's length, with a removed line: by position, step 11 leaked into the summary
    cfg = CompareConfig(methods=["tis"], formats=["int4"], seeds=[0], reference=False, out=str(tmp_path))
    rows = [dict(r, reward=float(r["step"])) for r in _fake_rows([0.0] * 20, {10: 0.3, 20: 0.4}, 0.2, [0.1] * 20)]
    _write_run(Run("int4", "tis", 0).path(tmp_path), [r for r in rows if r["step"] != 3])
    run = aggregate(cfg, plan(cfg), max_steps=10)["groups"]["int4/tis"]["runs"]["0"]
    assert run["steps"] == 10 and run["reward"][-1] == 10.0 and run["eval_final"] == 0.3


def test_the_final_table_says_how_many_pairs_a_paired_difference_rests_on():
    """A reference whose final scoring failed leaves its seed out of the final model's Δ but not out of the row's
    seed count: the row says on how many pairs its Δ rests, as the training table does."""
    runs = {"0": {"policy_reward": 0.7}, "1": {"policy_reward": 0.8}, "2": {"policy_reward": 0.7}}
    group = {"reference": False, "format": "mxfp4", "method": "tis", "runs": runs, "policy_reward": (0.733, 0.06),
             "policy_vs_reference": (-0.04, 0.01), "policy_paired_seeds": [0, 2], "sampler_reward": (0.6, 0.0),
             "held_accuracy": (0.1, 0.0)}  # fmt: skip
    assert "| -0.040 ± 0.010 (2 pairs) |" in final_table({"groups": {"mxfp4/tis": group}})
    group["policy_paired_seeds"] = [0, 1, 2]
    assert "| -0.040 ± 0.010 |" in final_table({"groups": {"mxfp4/tis": group}})
    del group["policy_paired_seeds"]  # a result aggregated before pairs were recorded: not "(0 pairs)"
    assert "| -0.040 ± 0.010 |" in final_table({"groups": {"mxfp4/tis": group}})


def test_every_column_of_a_table_row_by_hand():
    # each cell formatted as the header says, early before late, the falls count its own column (a reviewer's
    # mutants of aisrl.compare_report swapped, dropped or re-rounded these, and no test saw it)
    g = {"reference": False, "format": "mxfp4", "method": "tis", "runs": {"0": {}, "1": {}}, "missing": [],
         "eval_start": (0.3, None), "eval_final": (0.2, 0.05), "eval_best": (0.4, 0.0), "collapses": 0, "falls": 2,
         "fit_start": (0.5, None), "fit_final": (0.6, None), "reward_last_fifth": (0.4567, 0.0123),
         "reward_vs_reference": (-0.1, 0.02), "paired_seeds": [0, 1], "alpha_early": (0.9, None),
         "alpha_late": (0.5, None), "k3_kl_early": (0.0123, None), "k3_kl_late": (0.0456, None),
         "ess_early": (0.8, None), "ess_late": (0.7, None), "time_share": {"time_rollout": 0.634},
         "seconds_per_step": (2.345, None)}  # fmt: skip
    lines = table({"groups": {"mxfp4/tis": g}}).splitlines()
    assert lines[1] == "|" + "---|" * 17 and lines[0].count("|") == 18
    assert lines[2] == ("| mxfp4 | tis | 2 | 30.0 | 20.0 ± 5.0 | 40.0 ± 0.0 | 0/2 | 2/2 | 50.0 | 60.0 | 0.457 ± 0.012 "
                        "| -0.100 ± 0.020 | 0.9 → 0.5 | 0.012 → 0.046 | 0.8 → 0.7 | 63% | 2.35 |")  # fmt: skip
    empty = {"reference": False, "format": "mxfp4", "method": "tis", "runs": {"0": {}}, "policy_reward": (None, None)}
    assert final_table({"groups": {"mxfp4/tis": empty}}) == ""  # nothing scored: no table, not a header alone


def test_a_study_re_run_on_an_edited_dataset_is_refused_before_anything_trains(tmp_path, monkeypatch):
    from dataclasses import asdict

    import torch
    from conftest import local_model_and_rows

    from aisrl.checkpoint import record_start
    from aisrl.train_config import load_config

    data = local_model_and_rows(tmp_path)
    train = [f"model.name={tmp_path / 'm'}", "task=jsonl", f"dataset={data}", "max_steps=7", "eval_problems=2",
             "train_problems=8", "prompts_per_step=2", "group_size=2", "rollout.max_new_tokens=4"]  # fmt: skip
    cfg = CompareConfig(methods=["tis"], formats=["int4"], seeds=[0], out=str(tmp_path / "s"), jobs=1, train=train)
    for run in plan(cfg):  # interrupted at step 3, after starting on the file as it was
        run.path(cfg.out).mkdir(parents=True)
        (run.path(cfg.out) / "config.json").write_text(json.dumps(asdict(load_config("lab", run.overrides(cfg)))))
        record_start(run.path(cfg.out), torch.nn.Linear(2, 2), str(data))
        (run.path(cfg.out) / "checkpoints").mkdir()
        (run.path(cfg.out) / "checkpoints" / "latest").write_text("step_000003")
    data.write_text(data.read_text().replace('"answer": "3"', '"answer": "4"'))
    trained = []
    monkeypatch.setattr("aisrl.compare._run_here", lambda todo, *a: trained.extend(todo))
    with pytest.raises(ValueError, match=r"holds other rows .*reference/seed0 was started on"):
        run_study(cfg, log=lambda _: None)
    assert trained == []
