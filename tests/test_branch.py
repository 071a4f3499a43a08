"""Branches continue a run from its checkpoint: salt 0 replays it exactly, another salt draws other samples."""

import json
import shutil

import pytest
import torch
from conftest import TINY_LAB, load_benchmark, untimed, varying_reward

from aisrl.branch import BranchConfig, branch_configs, run_branches, start_from_checkpoint, summarize_branch, table
from aisrl.checkpoint import run_start
from aisrl.cli import main
from aisrl.train_config import load_config
from aisrl.trainer import train

TINY = [*TINY_LAB, "eval_every=2", "checkpoint_every=2", "rollout.quant=fp8_e4m3_w8a8"]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AISRL_CACHE", str(tmp_path / "cache"))
    # a reward that varies with the completion, so the weights move and other samples give other updates
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def run(tmp_path):
    out = tmp_path / "run"
    train(load_config("lab", [*TINY, "max_steps=4", f"output_dir={out}"]), log=lambda _: None)
    return out


def test_salt_zero_replays_the_run_and_another_salt_draws_other_samples(run, tmp_path):
    res = run_branches(BranchConfig(run=str(run), step=2, salts=[0, 1], out=str(tmp_path / "b")), log=lambda _: None)
    a, b0, b1 = rows(run), rows(tmp_path / "b" / "salt0"), rows(tmp_path / "b" / "salt1")
    assert [r["step"] for r in b0] == [r["step"] for r in b1] == [1, 2, 3, 4]
    assert [untimed(r) for r in b0] == [untimed(r) for r in a]  # the run's own continuation, bit for bit
    assert [untimed(r) for r in b1[:2]] == [untimed(r) for r in a[:2]]  # the history before the branch is kept
    assert b1[2]["k3_kl"] != a[2]["k3_kl"] and b1[2]["loss"] != a[2]["loss"]  # other samples from step 3 on
    cfg = json.loads((tmp_path / "b" / "salt1" / "config.json").read_text())
    assert cfg["sample_salt"] == 1 and cfg["seed"] == 0 and cfg["rollout"]["quant"] == "fp8_e4m3_w8a8"
    assert run_start(tmp_path / "b" / "salt1") == run_start(run) is not None  # the run's initial weights
    saved = json.loads((tmp_path / "b" / "branches.json").read_text())
    assert saved == json.loads(json.dumps(res)) and set(res["branches"]) == {"0", "1"}
    s0 = res["branches"]["0"]
    assert s0["eval_start"] == a[1]["eval_accuracy"] and s0["eval_end"] == a[3]["eval_accuracy"]
    assert s0["steps"] == 2 and s0["k3_kl_max"] == max(a[2]["k3_kl"], a[3]["k3_kl"])
    s1 = res["branches"]["1"]  # each branch is summarised from its own rows, not the run's
    assert s1["k3_kl_max"] == max(b1[2]["k3_kl"], b1[3]["k3_kl"]) != s0["k3_kl_max"]
    assert s1["accuracy"] == pytest.approx((b1[2]["accuracy"] + b1[3]["accuracy"]) / 2)
    # a second call resumes the finished branches instead of training them again
    before = (tmp_path / "b" / "salt1" / "metrics.jsonl").read_text()
    logs = []
    again = run_branches(BranchConfig(run=str(run), step=2, salts=[1], out=str(tmp_path / "b")), logs.append)
    assert (tmp_path / "b" / "salt1" / "metrics.jsonl").read_text() == before
    assert any(x.startswith("branch salt 1: ") and "already at step 4 (max_steps=4)" in x for x in logs)  # was silent
    # branches.json keeps the branch of salt 0 that the earlier call made (it held this call's salts only)
    assert set(again["branches"]) == {"0", "1"} and again["config"]["salts"] == [0, 1]
    spelt = run_branches(BranchConfig(run=f"{run}/.", step=2, salts=[1], out=str(tmp_path / "b")), log=lambda _: None)
    assert set(spelt["branches"]) == {"0", "1"}  # the run named otherwise: its branches are still its own
    assert json.loads((tmp_path / "b" / "branches.json").read_text())["branches"]["0"] == saved["branches"]["0"]
    # the same folder asked to branch from another step is refused, not silently resumed from step 2
    other = BranchConfig(run=str(run), step=4, salts=[1], out=str(tmp_path / "b"), train=["max_steps=6"])
    with pytest.raises(ValueError, match=r"salt1 was branched from .*run at step 2, not .*run at step 4; use another"):
        branch_configs(other)


def test_a_branch_can_change_settings_and_the_default_folder_names_them(run):
    assert main(["branch", f"run={run}", "step=2", "salts=[3]", "rollout.quant=none"]) == 0
    out = run / "branches" / "step2_rollout.quant=none" / "salt3"
    r = rows(out)
    assert json.loads((out / "config.json").read_text())["rollout"]["quant"] == "none"
    assert r[1]["k3_kl"] > 0 and r[3]["k3_kl"] == pytest.approx(0.0, abs=1e-9)  # FP8 before, none after


def test_a_branch_trains_at_its_own_learning_rate_from_its_first_step(run, monkeypatch):
    seen, real = [], torch.optim.AdamW.step  # the optimizer restored from the checkpoint holds the run's lr

    def step(self, *args, **kwargs):
        seen.append(self.param_groups[0]["lr"])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    assert main(["branch", f"run={run}", "step=2", "salts=[0]", "lr=0.01", "warmup_steps=4"]) == 0
    assert seen == pytest.approx([0.01 * 3 / 4, 0.01])  # steps 3 and 4 of a 4-step warm-up: lr (s + 1) / 4


def test_a_branch_trains_with_the_correction_it_names_not_its_runs(run):
    assert main(["branch", f"run={run}", "step=2", "salts=[1]", "correction.name=none"]) == 0
    r = rows(run / "branches" / "step2_correction.name=none" / "salt1")
    assert r[1]["weight_std"] > 0  # the run's AIS weights under FP8 rollouts
    assert r[2]["weight_std"] == r[3]["weight_std"] == 0 and r[3]["weight_mean"] == 1  # uncorrected after it


def test_bad_branches_are_refused_before_training(run, tmp_path, capsys):
    def err(**kw):
        with pytest.raises(ValueError) as e:
            branch_configs(BranchConfig(**{"run": str(run), "step": 2, **kw}))
        return str(e.value)

    assert "has no checkpoint at step 3; it holds complete ones at steps [2, 4]" in err(step=3)
    assert "is not a run folder" in err(run=str(tmp_path / "nowhere"))
    assert "nothing to train after step 4" in err(step=4)  # the final checkpoint needs a larger max_steps
    assert len(branch_configs(BranchConfig(run=str(run), step=4, train=["max_steps=6"]))) == 3
    assert "set per branch" in err(train=["sample_salt=2"])
    assert "sample_salt is set per branch" in err(train=[" sample_salt =2"])  # spaced: it slipped past, beside the own
    assert "distinct" in err(salts=[1, 1])
    assert "drop preset='lab'" in err(preset="lab")
    assert "unknown correction 'nope'" in err(train=["correction.name=nope"])
    recorded = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**recorded, "lab": {**recorded["lab"], "sft_max_steps": 3000}}))
    assert "does not load (" in err() and "sft_max_steps" in err()  # a key an older aisrl recorded
    assert "salts must each be in [0, 1000000), got [1, 1000000]" in err(salts=[1, 1_000_000])  # was: sample_salt
    assert branch_configs(BranchConfig(run=str(run), step=2, preset="lab", train=TINY))[0][2][0] == "lab"
    (run / "config.json").unlink()  # a run from before configs were recorded
    assert "pass preset=NAME" in err()
    cfgs = branch_configs(BranchConfig(run=str(run), step=2, preset="lab", train=TINY))
    assert [c.sample_salt for _, c, _ in cfgs] == [1, 2, 3] and cfgs[0][2][0] == "lab"
    assert "jobs must be >= 1" in err(jobs=0, preset="lab")
    assert "fall must be an accuracy drop in (0, 1] (0.08 = 8 points), got 8" in err(fall=8, preset="lab")
    assert "fall must be an accuracy drop in (0, 1] (0.08 = 8 points), got 0" in err(fall=0, preset="lab")
    assert main(["branch", f"run={run}", "step=5"]) == 2 and "complete ones at steps" in capsys.readouterr().err
    # a checkpoint without its state.pt (a partial copy): refused, not copied into a branch that cannot resume
    broken = tmp_path / "broken"
    shutil.copytree(run, broken)
    (broken / "checkpoints" / "step_000002" / "state.pt").unlink()
    what = "has an incomplete checkpoint (it needs model.safetensors and state.pt) at step 2; it holds complete ones"
    assert what + " at steps [4]" in err(run=str(broken))
    with pytest.raises(ValueError, match=r"incomplete checkpoint .* at step 2"):
        start_from_checkpoint(broken, 2, tmp_path / "branch")
    assert not (tmp_path / "branch").exists()


def test_summary_and_table_of_a_fall():
    rs = [{"step": 4, "eval_accuracy": 0.50, "accuracy": 0.3}, {"step": 5, "accuracy": 0.2, "k3_kl": 0.01},
          {"step": 6, "accuracy": 0.1, "k3_kl": 0.03, "eval_accuracy": 0.40}]  # fmt: skip
    s = summarize_branch(rs, 4, fall=0.08)
    assert s["eval_change"] == pytest.approx(-0.10) and s["fell"] is True and s["steps"] == 2
    assert s["accuracy"] == pytest.approx(0.15) and s["k3_kl_mean"] == pytest.approx(0.02) and s["k3_kl_max"] == 0.03
    assert summarize_branch(rs, 4, fall=0.12)["fell"] is False
    exact = [{"step": 4, "eval_accuracy": 0.41, "accuracy": 0.3}, {"step": 6, "accuracy": 0.1, "eval_accuracy": 0.33}]
    assert 0.33 - 0.41 > -0.08 and summarize_branch(exact, 4, fall=0.08)["fell"] is True  # 8 points is -0.0799.. here
    unscored = rs + [{"step": 7, "accuracy": 0.1, "k3_kl": 0.0, "num_tokens": 0}]  # a step that scored no token:
    assert summarize_branch(unscored, 4, fall=0.08)["k3_kl_mean"] == pytest.approx(0.02)  # no k3 of 0, as in studies
    assert summarize_branch(rs[1:], 4, fall=0.08)["eval_start"] is None  # no evaluation at the branch point
    res = {"config": {"fall": 0.08}, "branches": {"1": s}, "fell": 1, "scored": 1, "eval_change_mean": -0.1}
    assert "| 1 | 50.0 | 40.0 | -10.0 | 15.0 | 0.0200 / 0.0300 |" in table(res) and "1 of 1 branches fell" in table(res)
    assert "branches fell by 8 points or more; mean change -10.0 points" in table(res)  # fall in points
    # three k3s whose median is not their mean and whose last is not their max; no evaluation after the branch point
    later = [{"step": 4, "eval_accuracy": 0.5, "accuracy": 0.3}, {"step": 5, "accuracy": 0.2, "k3_kl": 0.01},
             {"step": 6, "accuracy": 0.2, "k3_kl": 0.09}, {"step": 7, "accuracy": 0.2, "k3_kl": 0.03}]  # fmt: skip
    s = summarize_branch(later, 4, 0.08)
    assert s["k3_kl_mean"] == pytest.approx(0.13 / 3) and s["k3_kl_max"] == 0.09
    assert (s["eval_end"], s["eval_change"], s["fell"]) == (None, None, None)


def test_branch_table_pools_arms_over_seeds(tmp_path, monkeypatch):
    mod = load_benchmark("branch_table")
    monkeypatch.setattr(mod, "ROOT", tmp_path)

    def arm(seed, name, changes):
        branches = {str(i): {"eval_change": c, "fell": None if c is None else c <= -0.08, "k3_kl_max": 0.01 * (i + 1)}
                    for i, c in enumerate(changes)}  # fmt: skip
        p = tmp_path / "br" / f"seed{seed}" / name
        p.mkdir(parents=True)
        (p / "branches.json").write_text(json.dumps({"branches": branches}))

    arm(1, "a", [0.02, -0.10, None])  # the unscored branch (no evaluation) is left out
    arm(2, "a", [0.04])
    arm(1, "b", [-0.2, -0.3])
    (tmp_path / "br" / "seedx" / "a").mkdir(parents=True)  # not a seed folder: skipped
    res = mod.main([str(tmp_path / "br"), "tag=t"])
    a, b = res["a"], res["b"]
    assert a["seeds"][1]["mean"] == pytest.approx(-0.04) and a["seeds"][1]["fell"] == 1
    assert a["mean_change"] == pytest.approx(0.0) and a["se"] == pytest.approx(0.04)  # over seed means -0.04, 0.04
    assert (a["fell"], a["branches"]) == (1, 3) and a["seeds"][1]["k3_kl_max"] == 0.03
    assert b["se"] is None and b["mean_change"] == pytest.approx(-0.25) and b["fell"] == 2
    saved = json.loads((tmp_path / "benchmarks" / "results" / "branches_t.json").read_text())
    assert saved["arms"]["b"]["fell"] == 2 and "branch_table.py" in saved["command"]
    assert "| a | +2 -10 | +4 | +0.0 (4.0) | 1/3 |" in mod.table(res)
    with pytest.raises(SystemExit, match="no ROOT"):
        mod.main([str(tmp_path / "empty")])


def test_branches_in_subprocesses_match_branches_in_process(tmp_path, monkeypatch):
    monkeypatch.undo()  # subprocesses see neither the patched reward nor the environment of the fixture
    monkeypatch.setenv("AISRL_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    train(load_config("lab", [*TINY, "max_steps=3", f"output_dir={run}"]), log=lambda _: None)
    run_branches(BranchConfig(run=str(run), step=2, salts=[1], out=str(tmp_path / "a")), log=lambda _: None)
    logs = []
    res = run_branches(BranchConfig(run=str(run), step=2, salts=[1, 2], out=str(tmp_path / "b"), jobs=2), logs.append)
    a, b = rows(tmp_path / "a" / "salt1"), rows(tmp_path / "b" / "salt1")
    assert [(r["reward"], r["completion_len"]) for r in b] == [(r["reward"], r["completion_len"]) for r in a]
    # the same samples; the subprocess runs on one thread, which moves FP32 sums in the last digits only
    assert [untimed(r) for r in b] == [pytest.approx(untimed(r), rel=1e-4, abs=1e-9) for r in a]
    assert rows(tmp_path / "b" / "salt2")[-1]["step"] == 3 and set(res["branches"]) == {"1", "2"}
    assert "branch: started salt 2" in logs


def test_a_branch_point_without_an_evaluation_is_reported(run, tmp_path):
    rs = rows(run)
    del rs[1]["eval_accuracy"]  # as if the run had not evaluated at step 2
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
    logs = []
    res = run_branches(BranchConfig(run=str(run), step=2, salts=[0], out=str(tmp_path / "b")), logs.append)
    assert any("did not evaluate at step 2" in line for line in logs)
    assert res["branches"]["0"]["eval_start"] is None and res["scored"] == 0 and res["eval_change_mean"] is None


def test_a_branch_the_trainer_refuses_leaves_no_copy_behind(run, tmp_path):
    """The checkpoint is copied into every branch folder before training; a setting only the trainer can judge
    (here a LoRA rank the run's weights do not have) left those copies (tens of GB on the GPU presets) in place."""
    out = tmp_path / "b"
    with pytest.raises(ValueError, match=r"the branches build another model than .*run's checkpoint holds "
                       r"\(lora.r: 0 -> 4\).*holds weights of another model"):  # the key named, not a tensor only
        run_branches(BranchConfig(run=str(run), step=2, salts=[1, 2], out=str(out), train=["lora.r=4"]), print)
    assert not out.exists()
    # a branch that trained past its copy keeps its work; only the copies this call made are taken back
    run_branches(BranchConfig(run=str(run), step=2, salts=[1], out=str(out)), log=lambda _: None)
    finished = rows(out / "salt1")
    with pytest.raises(ValueError, match=r"salt1 holds a run started with another config \(lora.r: 0 -> 4\)"):
        run_branches(BranchConfig(run=str(run), step=2, salts=[1, 2], out=str(out), train=["lora.r=4"]), print)
    assert rows(out / "salt1") == finished and not (out / "salt2").exists()


def test_a_branch_on_another_held_out_set_reports_no_change(run, tmp_path):
    """seed= or eval_problems= give the branch other held-out problems: its end accuracy set against the run's at the
    branch point called a branch fallen (or not) by comparing two different sets."""
    logs = []
    res = run_branches(BranchConfig(run=str(run), step=2, salts=[1], out=str(tmp_path / "b"),
                                    train=["eval_problems=5"]), logs.append)  # fmt: skip
    b = res["branches"]["1"]
    assert b["eval_start"] is not None and b["eval_end"] is not None  # both measured, on different sets
    assert b["eval_change"] is None and b["fell"] is None and res["scored"] == 0
    assert any("another held-out set than the run's (eval_problems: " in line for line in logs)
    logs.clear()
    same = run_branches(BranchConfig(run=str(run), step=2, salts=[1], out=str(tmp_path / "c"),
                                     train=["rollout.quant=none"]), logs.append)  # fmt: skip
    assert same["branches"]["1"]["eval_change"] is not None and not any("held-out set" in x for x in logs)


def test_a_run_whose_dataset_has_moved_can_still_be_branched(tmp_path):
    """The held-out comparison rebuilds the run's problems from its record; a dataset that is no longer where the
    record says (the branch names where it is now) made that an error that stopped the branch."""
    import dataclasses

    from aisrl.branch import held_out_changes

    new = tmp_path / "new.jsonl"
    rows = [{"question": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(80)]
    new.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    run.mkdir()
    recorded = load_config("lab", ["model.name=smollm2", "task=jsonl", f"dataset={tmp_path / 'moved_away.jsonl'}"])
    (run / "config.json").write_text(json.dumps(dataclasses.asdict(recorded)))
    branch = load_config(str(run / "config.json"), [f"dataset={new}"])
    (why,) = held_out_changes(run, str(run / "config.json"), branch)
    assert why.startswith("the run's held-out set cannot be rebuilt here (") and "moved_away.jsonl" in why
    assert held_out_changes(run, "lab", branch) == []  # a run without a record: taken at its preset's word


def test_a_branch_folder_named_past_a_file_systems_limit_ends_in_a_hash(tmp_path):
    """The folder name holds every override: a 16-pattern rollout.keep ran past 255 bytes, an OSError traceback."""
    from aisrl.branch import _out

    keep = "rollout.keep=[" + ",".join(f"model.layers.{i}.self_attn.q_proj" for i in range(16)) + "]"
    long = _out(BranchConfig(run=str(tmp_path), step=100, train=["max_steps=120", keep]))
    other = _out(BranchConfig(run=str(tmp_path), step=100, train=["max_steps=120", keep.replace("q_proj]", "k_proj]")]))
    assert len(long.name.encode()) <= 255 and long.name.startswith("step100_max_steps=120_rollout.keep=[")
    assert long != other and not long.exists()  # a name the file system takes, one per set of overrides
    short = _out(BranchConfig(run=str(tmp_path), step=2, train=["rollout.quant=none"]))
    assert short == tmp_path / "branches" / "step2_rollout.quant=none"  # names that fit stay as they were


def test_a_branch_of_a_branch_replays_it_at_salt_zero(run, tmp_path):
    """A branch's salt adds to the run's own sample_salt: salt 0 set it to 0, which drew new samples from a branch
    (sample_salt 1) instead of replaying it."""
    run_branches(BranchConfig(run=str(run), step=2, salts=[1], out=str(tmp_path / "b"), train=["max_steps=6"]),
                 log=lambda _: None)  # fmt: skip
    child = tmp_path / "b" / "salt1"
    res = run_branches(BranchConfig(run=str(child), step=4, salts=[0, 1], out=str(tmp_path / "c")), log=lambda _: None)
    assert [untimed(r) for r in rows(tmp_path / "c" / "salt0")] == [untimed(r) for r in rows(child)]
    assert json.loads((tmp_path / "c" / "salt1" / "config.json").read_text())["sample_salt"] == 2
    assert rows(tmp_path / "c" / "salt1")[4]["loss"] != rows(child)[4]["loss"] and res["config"]["salts"] == [0, 1]
    # a branch started when salts replaced the run's sample_salt (it recorded 1, the salt alone) resumes as it began
    recorded = tmp_path / "c" / "salt1" / "config.json"
    recorded.write_text(json.dumps({**json.loads(recorded.read_text()), "sample_salt": 1}))
    cfgs = branch_configs(BranchConfig(run=str(child), step=4, salts=[0, 1], out=str(tmp_path / "c")))
    assert [c.sample_salt for _, c, _ in cfgs] == [1, 1]  # salt 0: the child's own 1; salt 1: as recorded


def test_a_started_branch_resumes_after_its_run_dropped_the_checkpoint_and_moved(run, tmp_path):
    """A run still training drops the branch point's checkpoint after keep_checkpoints newer ones: a branch that had
    copied it could not resume. And branch.json named the run by its absolute path, so a runs tree moved as a whole
    left its branches unresumable."""
    import aisrl.branch as branch

    cfg = BranchConfig(run=str(run), step=2, salts=[1])  # out: run/branches/step2
    (salt1,) = [branch._out(cfg) / "salt1"]
    assert start_from_checkpoint(run, 2, salt1)  # copied, then interrupted before its first step
    shutil.rmtree(run / "checkpoints" / "step_000002")
    moved = tmp_path / "moved"
    run.rename(moved)
    res = run_branches(BranchConfig(run=str(moved), step=2, salts=[1]), log=lambda _: None)
    assert res["branches"]["1"]["steps"] == 2 and [r["step"] for r in rows(moved / "branches" / "step2" / "salt1")] == [
        1, 2, 3, 4]  # fmt: skip
    with pytest.raises(ValueError, match="has no checkpoint at step 2"):  # a new branch still needs it
        branch_configs(BranchConfig(run=str(moved), step=2, salts=[2]))


def test_a_failed_copy_takes_back_every_copy_and_a_refused_branch_keeps_its_log(run, tmp_path, monkeypatch):
    from aisrl.branch import _take_back

    copies, real = [], shutil.copytree

    def full_disk(src, dst, **kw):
        copies.append(dst)
        if len(copies) == 2:
            raise OSError(28, "No space left on device")
        return real(src, dst, **kw)

    monkeypatch.setattr(shutil, "copytree", full_disk)
    with pytest.raises(OSError, match="No space left"):
        run_branches(BranchConfig(run=str(run), step=2, salts=[1, 2], out=str(tmp_path / "b")), log=lambda _: None)
    assert len(copies) == 2 and not (tmp_path / "b").exists()  # the first copy, which had succeeded, is gone too
    # a branch a subprocess refused: its copy goes, the train.log the error points to stays
    dst = tmp_path / "c" / "salt1"
    start_from_checkpoint(run, 2, dst)
    (dst / "train.log").write_text("ValueError: why\n")
    _take_back(dst)
    assert [p.name for p in dst.iterdir()] == ["train.log"]


def test_a_branch_folder_of_another_run_or_step_is_refused_and_earlier_branches_need_the_same_fall(run, tmp_path):
    from dataclasses import asdict

    from aisrl.branch import _check_branch_point, _earlier_branches

    dst = tmp_path / "b" / "salt1"
    start_from_checkpoint(run, 2, dst)
    _check_branch_point(run, 2, dst)  # its own run and step: resumed
    (tmp_path / "other").mkdir()
    with pytest.raises(ValueError, match="was branched from .* at step 2, not"):
        _check_branch_point(tmp_path / "other", 2, dst)  # the same step of another run
    with pytest.raises(ValueError, match="was branched from .* at step 2, not"):
        _check_branch_point(run, 4, dst)  # another step of the same run
    # branches recorded under another `fall` were judged fallen by another bar: not kept beside this call's
    path = tmp_path / "b" / "branches.json"
    earlier = {"config": asdict(BranchConfig(run=str(run), step=2, fall=0.08)), "branches": {"1": {"fell": True}}}
    path.write_text(json.dumps(earlier))
    assert _earlier_branches(path, BranchConfig(run=str(run), step=2, fall=0.08)) == {"1": {"fell": True}}
    assert _earlier_branches(path, BranchConfig(run=str(run), step=2, fall=0.12)) == {}
