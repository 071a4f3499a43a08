"""The trainer end to end on a tiny lab model: smoke run, exact resume, crash-safe checkpoints, config errors."""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_LAB, local_model_and_rows, overriding, untimed, varying_reward
from safetensors.torch import load_file

from aisrl.build import build
from aisrl.checkpoint import latest_checkpoint, load_checkpoint, run_start, same_start, save_checkpoint, weights_digest
from aisrl.cli import main
from aisrl.tasks import Problem
from aisrl.train_checks import validate
from aisrl.train_config import PRESET_DIR, load_config
from aisrl.trainer import train

TINY = [*TINY_LAB, "eval_every=2", "warmup_steps=5"]  # warm-up spans the resume point: lr must match


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AISRL_CACHE", str(tmp_path / "cache"))


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_step_smoke_run(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "lab", *TINY, "max_steps=2", f"output_dir={out}"]) == 0
    r = rows(out)
    start, final = r[0]["eval_accuracy_start"], r[-1]["eval_accuracy"]  # eval_every=2: at the start and step 2
    assert f"held-out greedy accuracy {start:.1%} at the start, {final:.1%} at step 2" in capsys.readouterr().out
    assert [x["step"] for x in r] == [1, 2]
    for key in ("reward", "accuracy", "alpha", "k3_kl", "ess", "weight_reliability", "time_rollout", "time_sync"):
        assert key in r[-1], key
    assert "eval_accuracy" in r[-1] and (out / "report.png").exists() and (out / "summary.json").exists()
    assert latest_checkpoint(out) is not None
    if importlib.util.find_spec("tensorboard"):
        assert list((out / "tensorboard").glob("events.out.tfevents.*"))


def test_resume_is_exact(tmp_path, monkeypatch):
    # a reward that varies with the completion, so the policy really changes between steps (an untrained
    # policy never hits the format: all rewards 0, no gradient, and a wrong resume would go unnoticed)
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    a, b = tmp_path / "a", tmp_path / "b"
    train(load_config("lab", [*TINY, "max_steps=6", f"output_dir={a}", "checkpoint_every=3"]), log=lambda _: None)
    train(load_config("lab", [*TINY, "max_steps=3", f"output_dir={b}", "checkpoint_every=3"]), log=lambda _: None)
    with (b / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "rew')  # a row whose append was cut short when the run was killed
    train(load_config("lab", [*TINY, "max_steps=6", f"output_dir={b}", "checkpoint_every=3"]), log=lambda _: None)
    ra, rb = rows(a), rows(b)
    assert [x["step"] for x in rb] == [1, 2, 3, 4, 5, 6]
    assert all(x["grad_norm"] > 0 for x in ra) and len({x["k3_kl"] for x in ra}) > 1  # it did learn
    parts = [(x["time_forward"], x["time_backward"], x["time_optimizer"], x["time_train"]) for x in ra]
    assert all(f > 0 and b > 0 and o > 0 and f + b + o <= t for f, b, o, t in parts)  # time_train, split
    for x, y in zip(ra[3:], rb[3:], strict=True):  # everything but the seconds
        assert untimed(x) == untimed(y)
    # both record the weights they started from (the resume does not overwrite it): the cached warm start's
    start = weights_digest(build(load_config("lab", TINY))[0].state_dict())
    assert run_start(a) == run_start(b) == start and same_start(a, b)
    assert start != weights_digest(load_file(latest_checkpoint(b) / "model.safetensors"))  # not the trained ones


def test_resume_with_other_settings_is_refused_naming_them(tmp_path):
    out, quiet = tmp_path / "run", (lambda _: None)
    train(load_config("lab", [*TINY, "max_steps=1", f"output_dir={out}"]), log=quiet)
    assert json.loads((out / "config.json").read_text())["correction"]["name"] == "ais"
    with pytest.raises(ValueError, match=r"another config \(correction.name: 'ais' -> 'tis'; lr: 0.0005 -> 0.001\)"):
        train(load_config("lab", [*TINY, "max_steps=2", f"output_dir={out}", "correction.name=tis", "lr=1e-3"]))
    assert [x["step"] for x in rows(out)] == [1]  # nothing was appended
    # how long, how often and how the batch is split may change: the run continues
    logs = []
    train(load_config("lab", [*TINY, "max_steps=2", f"output_dir={out}", "eval_every=1", "micro_batch=3"]),
          log=logs.append)  # fmt: skip
    assert [x["step"] for x in rows(out)] == [1, 2] and any("resumed" in line for line in logs)
    recorded = json.loads((out / "config.json").read_text())  # the record says how the run goes on now
    assert (recorded["max_steps"], recorded["eval_every"], recorded["micro_batch"]) == (2, 1, 3)
    logs.clear()
    train(load_config("lab", [*TINY, "max_steps=1", f"output_dir={out}"]), log=logs.append)
    assert any("already at step 2 (max_steps=1); nothing to train" in line for line in logs)
    # a start with nothing left to train records nothing
    assert json.loads((out / "config.json").read_text())["max_steps"] == 2


def test_a_batch_with_every_token_rejected_leaves_the_weights_alone(tmp_path, monkeypatch):
    """Adam's momentum would move the weights on a zero gradient; a fully rejected batch must not step."""
    from safetensors.torch import load_file

    import aisrl.trainer as trainer

    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    batches, correct = [], trainer.correct

    def reject_second_batch(name, old, roll, mask, **kw):
        res = correct(name, old, roll, mask, **kw)
        if mask.shape[0] > 1:  # a training batch (validate checks the options on a 1x1 one)
            batches.append(mask.shape)
            if len(batches) == 2:
                return res._replace(mask=torch.zeros_like(res.mask), weights=torch.zeros_like(res.weights))
        return res

    monkeypatch.setattr(trainer, "correct", reject_second_batch)
    out = tmp_path / "run"
    train(load_config("lab", [*TINY, "max_steps=2", f"output_dir={out}", "checkpoint_every=1"]), log=lambda _: None)
    r = rows(out)
    assert [x["update_skipped"] for x in r] == [0.0, 1.0] and r[0]["grad_norm"] > 0
    w1, w2 = (load_file(out / "checkpoints" / f"step_00000{k}" / "model.safetensors") for k in (1, 2))
    assert all(torch.equal(w1[k], w2[k]) for k in w1)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_in_length_order_accumulate_the_full_batch_gradient(tmp_path, monkeypatch, agg):
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    got = {}
    for mb in (16, 3):  # one micro-batch of all 16 rows, and uneven ones of rows regrouped by length
        out = tmp_path / f"mb{mb}"
        # two epochs, so that the second one's PPO ratio moves off 1 and its clip / ratio / KL metrics are not zero
        cfg = load_config("lab", [*TINY, "max_steps=1", f"micro_batch={mb}", f"output_dir={out}", "epochs=2",
                                  f"agg={agg}", "lr=3e-3"])  # fmt: skip
        train(cfg, log=lambda _: None)
        got[mb] = rows(out)[0]
    assert got[16]["grad_norm"] > 0 and got[16]["approx_kl"] > 0 and got[16]["ratio_mean"] != 1.0
    for key in ("grad_norm", "reward", "k3_kl", "completion_len", "loss", "ratio_mean", "approx_kl", "pg_clip_frac"):
        assert got[3][key] == pytest.approx(got[16][key], rel=1e-3, abs=1e-7), key


def test_static_engine_rollouts_train_and_resume_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    base = [*TINY, "rollout.engine=static", "rollout.quant=fp8_e4m3_w8a8_kv", "checkpoint_every=2"]
    a, b = tmp_path / "a", tmp_path / "b"
    train(load_config("lab", [*base, "max_steps=4", f"output_dir={a}"]), log=lambda _: None)
    train(load_config("lab", [*base, "max_steps=2", f"output_dir={b}"]), log=lambda _: None)
    train(load_config("lab", [*base, "max_steps=4", f"output_dir={b}"]), log=lambda _: None)  # resumes, re-syncs
    ra, rb = rows(a), rows(b)
    assert all(x["grad_norm"] > 0 for x in ra) and all(0 < x["k3_kl"] < 0.1 for x in ra)  # real FP8 mismatch
    for x, y in zip(ra[2:], rb[2:], strict=True):
        assert untimed(x) == untimed(y)
    with pytest.raises(ValueError, match=r"rollout.quant='int4'; use .*fp8_e4m3_w8a8.*rollout.engine=hf"):
        train(load_config("lab", [*TINY, "rollout.engine=static", "rollout.quant=int4", f"output_dir={a}x"]))
    with pytest.raises(ValueError, match="unknown rollout.engine 'vllm'"):
        train(load_config("lab", [*TINY, "rollout.engine=vllm", f"output_dir={a}y"]))


def test_crash_during_checkpoint_write_leaves_previous_loadable(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    save_checkpoint(tmp_path, 1, model, opt, {"prev_alpha": 0.5})
    script = f"""
import os, torch, safetensors.torch as st
from aisrl.checkpoint import save_checkpoint
real = st.save_file
def dying(*a, **k):
    real(*a, **k)
    os._exit(9)  # killed between writing the weights and finishing the checkpoint
st.save_file = dying
import aisrl.checkpoint as c
c.save_file = dying
m = torch.nn.Linear(3, 2)
save_checkpoint({str(tmp_path)!r}, 2, m, torch.optim.AdamW(m.parameters()), {{}})
"""
    assert subprocess.run([sys.executable, "-c", script]).returncode == 9
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt.name == "step_000001"
    fresh = torch.nn.Linear(3, 2)
    state = load_checkpoint(ckpt, fresh, torch.optim.AdamW(fresh.parameters()))
    assert state["step"] == 1 and state["extra"]["prev_alpha"] == 0.5
    torch.testing.assert_close(fresh.weight, model.weight)


@pytest.mark.parametrize(
    "args,message",
    [
        (["max_stepz=3"], "unknown config key 'max_stepz'"),
        (["max_steps=three"], "config key 'max_steps' expects int"),
        (["correction.name=magic"], "unknown correction 'magic'; choose from"),
        (["task=chess", "model.name=smollm2"], "unknown task 'chess'; choose from"),
        (["task=jsonl", "dataset=missing.jsonl", "model.name=smollm2"], "dataset='missing.jsonl' does not exist"),
        (["task=dataset", "model.name=smollm2"], "dataset='' is not set: give its path with dataset=PATH"),
        (["task_options=max_operand"], "config key 'task_options' expects a mapping with text keys"),
        (["task_options={'bogus': 1}", "model.name=smollm2"], "task 'arithmetic' got options ['bogus']; it accepts"),
        (["task_options={'max_operand': 9}"], "task_options={'max_operand': 9} is set, but model.name=lab trains on"),
        (["task=countdown"], "task='countdown' is set, but model.name=lab trains on its own task (lab.task="),
        (["task=dataset", "dataset=d.jsonl"], "or clear task and dataset"),
        (["model.name=smollm2", "dataset=d.jsonl"], "dataset='d.jsonl' is set, but task='arithmetic' does not read it"),
        (["correction.ema=-1"], "ema must be in [0, 1)"),
        (["lora.r=4", "lora.alpha=0"], "lora.alpha must be > 0 with lora.r > 0"),  # before: trained nothing
        (["lora.r=4", "lora.targets=[]"], "lora.targets is empty: name the layers"),  # before: peft's own error
        (["correction.name=tis", "correction.ema=0.5"], "correction.ema smooths AIS's alpha across steps: it needs"),
        (["correction.ema=0.5", "correction.calibrate_every=1"], "set correction.ema=0 while calibrating"),  # before:
        # "correction 'tis' got unknown option(s) ['ema', 'prev_alpha']", an internal name
        (["lab.lr=-1"], "lab.lr is the warm start's SFT learning rate, > 0; got -1.0"),  # before: torch's, no key
        (["loss=tbpo", "agg=seq-mean-token-sum"], "tbpo always averages over sequences"),
        (["correction.bypass=true", "correction.guard=4"], "the k3 KL the guard watches is 0 at every step"),
        (["rollout.engine=static", "correction.calibrate_every=1"], "calibrate with rollout.engine=hf, or set"),
        (["correction.name=icepop", "correction.options={'floor': 0.5}"], "it accepts ['low', 'high']"),
        (["correction.options={'cap': 3}"], "correction.options sets ['cap']: set them with their own keys"),
        (["output_dir="], "output_dir is empty; name the directory the run writes to"),
        (["output_dir=pyproject.toml/run"], "output_dir=pyproject.toml/run: pyproject.toml is a file, not a directory"),
        ([f"output_dir=runs/{'x' * 300}"], "a name in it is 300 bytes, past the 255 a file system takes"),
        (["correction.name=tis", "correction.options={'floor': '0.5'}"], "option 'floor' expects float (default 0.0)"),
        (["model.name=smollm2", "task=dataset", "dataset=d.jsonl", "task_options={'path': 'x'}"],
         "task_options sets ['path']: name the file or generator with dataset= instead"),
        (["rollout.quant=fp9"], "unknown quantisation preset 'fp9'"),
        (["rollout.keep=['']"], "rollout.quant / rollout.keep: keep must be a list of non-empty module-name patterns"),
        (["device=tpu0"], "device 'tpu0' is not a device name"),
        (["device=cuda:7"], "device 'cuda:7' asked for, but this machine has"),
        (["precision=fp16"], "unknown precision 'fp16'; choose from ['bf16', 'fp32']"),
        (["sample_salt=-1"], "sample_salt must be in [0, 1000000), got -1"),
        (["correction.veto=1.5"], "correction.veto is a weight below which a sequence is dropped"),
        (["correction.guard=0.5"], "correction.guard is a factor over the recent k3 KL"),
        (["rollout.temperature=0"], "rollout settings: temperature must be > 0"),
        (["rollout.top_p=2"], "rollout settings: top_p must be in (0, 1]"),
        (["lr=-1"], "config key 'lr' must be > 0, got -1"),
        (["lab.task=reasoning_gym"], "lab.task='reasoning_gym': the lab trains on a procedural task; choose from"),
        (["lab.max_operand=-1"], "lab.max_operand must be >= 1, got -1"),
        (["lab.hidden=100"], "lab.hidden must be a multiple of 8 (4 attention heads of even width), got 100"),
        (["lab.task=sudoku4", "lab.sudoku_holes=99"], "lab.sudoku_holes is the number of blanks of a 4x4 grid"),
        (["lab.target=[0.9,0.4]"], "lab.target is an accuracy band [low, high]"),
        (["lab.max_operand=5", "lab.sft_examples=10"], "too few distinct test problems under these lab.* options"),
        (["lab.max_operand=5", "lab.sft_examples=500"], "ask for fewer (lab.sft_examples) or widen the task"),
        (["lab.trace=columns", "lab.ops=+-"], "lab.task='arithmetic' refuses these lab.* options: trace='columns'"),
        (["lora.r=-1"], "lora.r must be >= 0"),
        (["lora.r=4", "lora.dropout=1.5"], "lora.dropout in [0, 1)"),
        (["clip_low=1.5"], "config key 'clip_low' must be in [0, 1)"),
        (["kl_coef=-0.1"], "config key 'kl_coef' must be >= 0"),
        (["correction.name=none", "correction.options={'low': 0.5}"],
         "it accepts [], plus normalize, metrics_only and veto (any correction)"),
        (["model.name=tiny-llama"], "model.name='tiny-llama' is a tokenizer-less test model and cannot be trained"),
    ],
)
def test_bad_config_fails_with_a_clear_message(args, message, capsys, monkeypatch):
    monkeypatch.setattr("aisrl.models.load_model", lambda name: (None, object()))  # never load real weights
    assert main(["train", "lab", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_run_that_fails_to_start_leaves_no_directory(tmp_path, capsys, monkeypatch):
    def broken(cfg):
        raise ValueError("no such model")

    monkeypatch.setattr("aisrl.trainer.build", broken)
    out = tmp_path / "new" / "run"
    assert main(["train", "lab", *TINY, f"output_dir={out}"]) == 2
    assert "no such model" in capsys.readouterr().err and not (tmp_path / "new").exists()
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access  # a directory this user cannot write to (root writes anywhere, so the check is faked)
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != locked and real_access(p, mode))
    assert main(["train", "lab", *TINY, f"output_dir={locked / 'a' / 'run'}"]) == 2
    assert f"{locked} is not writable; choose another output_dir" in capsys.readouterr().err
    # scoring writes nothing, so a read-only run is scored; a study command names its own option, out=
    cfg = load_config("lab", [*TINY, f"output_dir={locked}"])
    validate(cfg, output=None)
    with pytest.raises(ValueError, match="is not writable; choose another out$"):
        validate(cfg, output="out")


def test_too_few_problems_are_said_before_the_model_is_built(tmp_path, monkeypatch):
    """The problem sets depend on the task alone: a pool the task cannot fill was found only after the model (a lab's
    warm start, minutes without a cache) had been built."""

    def build(cfg):
        raise AssertionError("the model was built first")

    monkeypatch.setattr("aisrl.trainer.build", build)
    with pytest.raises(ValueError, match="could not produce 5000 distinct train problems"):
        train(load_config("lab", [*TINY, "train_problems=5000", f"output_dir={tmp_path / 'run'}"]), log=print)
    assert not (tmp_path / "run").exists()


def test_unknown_preset_lists_the_presets(capsys, tmp_path):
    assert main(["train", "nonexistent-preset"]) == 2
    assert "unknown preset 'nonexistent-preset'" in capsys.readouterr().err
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text("{}")  # `aisrl eval RUN` is natural to try: say what works
    assert main(["eval", str(tmp_path / "run")]) == 2
    assert f"is a run's folder: pass output_dir={tmp_path / 'run'}" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("lr: : 3\n")
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml is not valid YAML" in err and "Traceback" not in err


def test_small_pool_and_non_positive_settings_fail_clearly(capsys, monkeypatch):
    import aisrl.trainer

    # refused by validation, before the model (a lab's warm start: minutes) is built
    monkeypatch.setattr(aisrl.trainer, "build", lambda cfg: pytest.fail("built a model for a config it refuses"))
    assert main(["train", "lab", *overriding(TINY, "train_problems=2")]) == 2
    assert "train_problems=2 is fewer than prompts_per_step=4" in capsys.readouterr().err
    monkeypatch.undo()
    # a dataset holds what it holds: fewer training problems than a step's prompts is found when they are read
    from aisrl.build import problem_sets

    class Small:
        def problems(self, split, n, seed=0):
            return [Problem(f"{split} {i}", "1") for i in range(min(n, 2 if split == "train" else 1))]

    cfg = load_config("lab", [*TINY, "eval_problems=1"])
    fewer = pytest.warns(UserWarning, match="the task gives 2 training problems")
    with fewer, pytest.raises(ValueError, match="gives 2 training and 1 held-out problems; need at least prompts_per"):
        problem_sets(cfg, Small())
    cfg.prompts_per_step, cfg.train_problems, cfg.eval_problems = 2, 2, 1
    assert [len(s) for s in problem_sets(cfg, Small())] == [2, 1]
    assert main(["train", "lab", *overriding(TINY, "eval_every=0")]) == 2
    assert "config key 'eval_every' must be >= 1" in capsys.readouterr().err


def test_broken_latest_pointer_is_an_error_not_a_restart(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    path = save_checkpoint(tmp_path, 1, model, opt, {})
    (path / "state.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"incomplete or missing; restore it, or delete .*no complete"):
        latest_checkpoint(tmp_path)
    # with earlier complete checkpoints, the advice names the newest: deleting `latest` (the advice before) started
    # over, and the new start's first save deleted them all as an abandoned start's
    for step in (2, 3, 4):
        path = save_checkpoint(tmp_path, step, model, opt, {}, keep=3)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"step_000004, which is incomplete .* by writing step_000003 into"):
        latest_checkpoint(tmp_path)
    (tmp_path / "checkpoints/latest").write_text("step_000003")
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints/step_000003"


def test_evaluation_splits_the_problems_over_ranks(monkeypatch):
    # under torchrun each rank decodes every world-th problem; the shares' counts add up to one process's
    from aisrl.build import make_policy, problem_sets
    from aisrl.trainer import evaluate

    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward",  # correct by the completion and the problem both
                        lambda self, text, p: (0.0, (len(text) + len(p.question)) % 2 == 0))  # fmt: skip
    cfg = load_config("lab", TINY)
    model, tok, task, encode = build(cfg)
    policy = make_policy(cfg, tok, model)
    _, held = problem_sets(cfg, task)
    decoded, greedy = [], policy.greedy
    monkeypatch.setattr(policy, "greedy", lambda m, prompts: decoded.append(len(prompts)) or greedy(m, prompts))
    one = evaluate(model, tok, task, encode, held, policy)
    shares = [evaluate(model, tok, task, encode, held, policy, rank=k, world=3) for k in range(3)]
    assert 0 < one < 1 and sum(shares) == pytest.approx(one)  # (a share is its count over all the problems)
    assert decoded == [8, 3, 3, 2]


def test_eval_cli_accepts_overrides_and_lora_checkpoints(tmp_path, capsys, monkeypatch):
    pytest.importorskip("peft")
    out = tmp_path / "lora"
    assert main(["train", "lab", *TINY, "max_steps=1", "lora.r=4", f"output_dir={out}"]) == 0
    assert main(["eval", *TINY, "lora.r=4", f"output_dir={out}"]) == 0
    assert "held-out greedy accuracy" in capsys.readouterr().out
    assert main(["eval", f"output_dir={out}"]) == 0  # the run's recorded settings: lora.r=4, the tiny lab model
    assert "held-out greedy accuracy" in capsys.readouterr().out
    assert main(["eval", f"output_dir={out}", "lora.r=0"]) == 2  # overridden, the checkpoint does not fit
    assert "holds weights of another model than this config builds" in capsys.readouterr().err


def test_bf16_trainer_precision_is_a_measured_mismatch(tmp_path):
    # full-precision rollouts scored by a BF16-autocast trainer: the ratio sees BF16 rounding, nothing else
    out32, out16 = tmp_path / "fp32", tmp_path / "bf16"
    base = [*TINY, "max_steps=1", "rollout.quant=none", "correction.name=tis", "device=cpu"]
    train(load_config("lab", [*base, f"output_dir={out32}"]), log=lambda _: None)
    train(load_config("lab", [*base, "precision=bf16", f"output_dir={out16}"]), log=lambda _: None)
    (a,), (b,) = rows(out32), rows(out16)
    assert a["k3_kl"] < 1e-12 and abs(a["is_weight_max"] - 1) < 1e-5  # engine vs recompute: rounding only
    assert b["logprob_abs_diff_mean"] > 1e-5 and b["logprob_abs_diff_mean"] > 1000 * a["logprob_abs_diff_mean"]
    assert 0 < b["k3_kl"] < 1e-3 and b["is_weight_max"] > 1.0001


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_run_matches_cpu_run(tmp_path, monkeypatch):
    # a reward that varies, so each step moves the weights; both runs train in FP32 on the same prompts and sampling
    # seeds, so they sample (nearly) the same tokens and take (nearly) the same two updates. Measured on this CPU:
    # a run of another seed updates the weights in a direction at cosine 0.02 from this seed's
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    base = [*TINY, "max_steps=2", "rollout.quant=fp8_e4m3_w8a8", "correction.name=ais", "lr=0.01"]
    updates, runs = [], []
    for device in ("cpu", "cuda"):
        cfg = load_config("lab", [*base, f"device={device}", f"output_dir={tmp_path / device}"])
        train(cfg, log=lambda _: None)
        start = build(cfg)[0].state_dict()
        final = load_file(latest_checkpoint(cfg.output_dir) / "model.safetensors")
        updates.append(torch.cat([(final[k].float() - start[k].float()).flatten() for k in final]))
        runs.append(rows(tmp_path / device))
    ra, rb = runs
    assert [x["step"] for x in rb] == [1, 2]
    # GPU kernels round differently, so the first step agrees closely, not exactly
    assert 0.5 < (rb[0]["k3_kl"] + 1e-9) / (ra[0]["k3_kl"] + 1e-9) < 2
    assert rb[0]["num_tokens"] == pytest.approx(ra[0]["num_tokens"], rel=0.1)
    assert rb[0]["training_ppl"] == pytest.approx(ra[0]["training_ppl"], rel=0.05)
    assert ra[0]["grad_norm"] > 0 and 0.5 < rb[0]["grad_norm"] / ra[0]["grad_norm"] < 2
    cos = torch.nn.functional.cosine_similarity(*updates, dim=0).item()
    assert cos > 0.5, (cos, [r["reward"] for r in ra], [r["reward"] for r in rb])
    assert rb[-1]["alpha"] is not None and 0 <= rb[-1]["alpha"] <= 1


@pytest.mark.parametrize("preset", sorted(p.stem for p in PRESET_DIR.glob("*.yaml")))
def test_every_preset_is_a_valid_config(preset, tmp_path):
    cfg = load_config(preset, ["device=cpu"])  # GPU presets are checked here without a GPU
    if cfg.task in ("dataset", "jsonl"):  # a preset for the user's own file: the file must exist to validate
        with pytest.raises(ValueError, match=f"dataset={cfg.dataset!r} does not exist"):
            validate(cfg)
        (tmp_path / "data.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
        cfg = load_config(preset, ["device=cpu", f"dataset={tmp_path / 'data.jsonl'}"])
    validate(cfg)
    assert cfg.max_steps >= 1 and cfg.output_dir.startswith("runs/")


def test_veto_drops_the_sequences_that_hold_a_catastrophic_token(tmp_path, monkeypatch):
    # a reward that varies, so an update would move the weights; FP8 rollouts put w != 1 on nearly every token
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    base = [*TINY, "max_steps=1", "rollout.quant=fp8_e4m3_w8a8", "correction.name=tis"]
    train(load_config("lab", [*base, f"output_dir={tmp_path / 'a'}"]), log=lambda _: None)
    train(load_config("lab", [*base, "correction.veto=0.999999", f"output_dir={tmp_path / 'b'}"]), log=lambda _: None)
    train(load_config("lab", [*base, "correction.veto=1e-30", f"output_dir={tmp_path / 'c'}"]), log=lambda _: None)
    (a,), (b,), (c,) = rows(tmp_path / "a"), rows(tmp_path / "b"), rows(tmp_path / "c")
    assert "veto_frac_seq" not in a and a["update_skipped"] == 0.0 and a["grad_norm"] > 0
    assert b["veto_frac_seq"] == 1.0 and b["update_skipped"] == 1.0  # every sequence has a token with w < 1 - 1e-6
    assert c["veto_frac_seq"] == 0.0 and c["grad_norm"] == a["grad_norm"]  # nothing that unlikely: the same update
    # the logged mask fractions and applied weights describe what was trained on, after the veto
    assert a["mask_frac_seq"] == 0.0 and b["mask_frac_seq"] == 1.0 and b["mask_frac_token"] == 1.0
    assert b["weight_mean"] == 0.0 and c["weight_mean"] == a["weight_mean"] > 0


def test_mismatch_guard_trips_on_a_jump_of_the_k3_kl_and_restores_the_saved_weights():
    from aisrl.update import MismatchGuard

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    g = MismatchGuard(4.0, window=4)
    assert not g.restore(model, opt)  # nothing saved yet
    g.save(model, opt)  # an update to undo
    assert [g.tripped(k) for k in (1.0, 1.2, 100.0)] == [False, False, True]  # a full half-window first
    assert g.history == [1.0, 1.2]  # the tripped batch stays out of the baseline
    assert not g.tripped(4.0) and g.history == [1.0, 1.2, 4.0]  # below 4 x the median 1.1: kept
    assert g.tripped(4.9) and not g.tripped(4.7)  # the median is now 1.2: the bar is 4.8
    before = model.weight.detach().clone()
    model.weight.grad = torch.ones_like(model.weight)
    opt.step()
    assert g.restore(model, opt) and torch.equal(model.weight, before) and opt.state_dict()["state"] == {}
    assert g.saved is None and not g.rebased
    # the batch after a rollback jumps as well: nothing left to undo, so it trains and the baseline restarts from it
    assert not g.tripped(50.0) and g.rebased and g.history == [50.0]
    assert not g.tripped(60.0) and not g.rebased and g.history == [50.0, 60.0]  # re-armed after a half-window
    g.save(model, opt)
    assert g.tripped(1000.0) and g.state()["model"]["weight"].shape == (2, 2)  # 4 x the median 55 is the bar
    # the baseline is the last `window` k3s, and a jump exceeds factor x their median: at it is no jump
    last = MismatchGuard(4.0, window=4, saved={"model": {}, "optimizer": {}})
    assert not any(last.tripped(k) for k in (1.0, 1.0, 3.0, 3.0)) and last.history == [1.0, 1.0, 3.0, 3.0]
    assert last.tripped(8.01) and not last.tripped(8.0)  # median 2: the bar is 8
    assert last.history == [1.0, 3.0, 3.0, 8.0]  # the oldest leaves
    exact = MismatchGuard(4.0, window=4, history=[0.0, 0.0], saved={"model": {}, "optimizer": {}})
    assert not exact.tripped(1e-7) and exact.tripped(2 * MismatchGuard.MIN_K3)  # bit-identical rollouts: median 0
    # a NaN k3 (an unmeasured batch) neither trips nor enters the baseline, where its median would disarm the guard
    nan = MismatchGuard(4.0, history=[0.01, math.nan], saved={"model": {}, "optimizer": {}})
    assert nan.history == [0.01]
    assert [nan.tripped(k) for k in (math.nan, 0.01, 0.01, 0.01, 0.01, 1.0)] == [False] * 5 + [True]
    off = MismatchGuard(0.0)
    assert not off.tripped(1e9) and off.history == [] and (off.save(model, opt), off.saved) == (None, None)
    # a guarded run resumed with the guard off drops its copy: nothing stale for a later resume with it on
    off = MismatchGuard(0.0, history=[1.0] * 5, saved=g.state())
    assert off.history == [] and off.saved is None and off.state() is None
    # a LoRA-style model: the frozen weights are not copied, and a restore leaves them as they are
    lora = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    lora[0].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad])
    g = MismatchGuard(4.0)
    g.save(lora, opt)
    assert sorted(g.state()["model"]) == ["1.bias", "1.weight"]
    before = [p.detach().clone() for p in lora.parameters()]
    with torch.no_grad():
        for p in lora.parameters():
            p.add_(1.0)
    assert g.restore(lora, opt)
    after = list(lora.parameters())
    assert all(torch.equal(a, b + 1) for a, b in zip(after[:2], before[:2], strict=True))  # frozen: not restored
    assert all(torch.equal(a, b) for a, b in zip(after[2:], before[2:], strict=True))


def test_guard_undoes_the_update_before_a_k3_spike(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from aisrl import trainer

    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    real = trainer.correct

    def spike_at_step_7(name, old, roll, mask, **kw):
        res = real(name, old, roll, mask, **kw)
        if mask.shape[0] > 1 and name != "veto":
            calls.append(1)
            if len(calls) == 7 or len(calls) >= spike_from:  # as if update 6 had moved the trainer far from its copy
                res.metrics["k3_kl"] = res.metrics["k3_kl"] * 1000 + 1.0
        return res

    monkeypatch.setattr(trainer, "correct", spike_at_step_7)
    base = [*TINY, "rollout.quant=fp8_e4m3_w8a8", "correction.guard=4", "checkpoint_every=1"]
    calls, spike_from = [], 99
    train(load_config("lab", [*base, "max_steps=7", f"output_dir={tmp_path / 'a'}"]), log=lambda _: None)
    calls = []
    train(load_config("lab", [*base, "max_steps=5", f"output_dir={tmp_path / 'b'}"]), log=lambda _: None)
    r = rows(tmp_path / "a")
    assert [x["guard_rollback"] for x in r] == [0.0] * 6 + [1.0] and r[-1]["update_skipped"] == 1.0
    a7, b5 = load_file(tmp_path / "a/checkpoints/step_000007/model.safetensors"), load_file(
        tmp_path / "b/checkpoints/step_000005/model.safetensors")  # fmt: skip
    assert all(torch.equal(a7[k], b5[k]) for k in a7)  # step 7 is back at the weights before update 6
    # a resume right before the jump undoes the same update: checkpoints keep the guard's copy
    calls = []
    train(load_config("lab", [*base, "max_steps=6", f"output_dir={tmp_path / 'c'}"]), log=lambda _: None)
    train(load_config("lab", [*base, "max_steps=7", f"output_dir={tmp_path / 'c'}"]), log=lambda _: None)
    c7 = load_file(tmp_path / "c/checkpoints/step_000007/model.safetensors")
    assert rows(tmp_path / "c")[-1]["guard_rollback"] == 1.0 and all(torch.equal(a7[k], c7[k]) for k in a7)
    # the mismatch stays high from step 7 on (a new level, not one update): one rollback, then it trains again
    calls, spike_from = [], 7
    train(load_config("lab", [*base, "max_steps=9", f"output_dir={tmp_path / 'd'}"]), log=lambda _: None)
    r = rows(tmp_path / "d")
    assert [x["guard_rollback"] for x in r] == [0.0] * 6 + [1.0, 0.0, 0.0]
    assert [x["guard_rebase"] for x in r] == [0.0] * 7 + [1.0, 0.0]
    assert [x["update_skipped"] for x in r] == [0.0] * 6 + [1.0, 0.0, 0.0]


def test_a_jump_after_a_step_that_updated_nothing_rebases_instead_of_undoing(tmp_path, monkeypatch):
    # step 6 trains on nothing (as when every token is rejected): its saved copy equals the weights, so the jump at
    # step 7 has no update to undo; before, the guard "restored" the same weights and threw batch 7 away
    from aisrl import trainer
    from aisrl.correction import restrict

    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    real_correct, real_update, steps = trainer.correct, trainer.policy_update, []

    def spike_at_step_7(name, old, roll, mask, **kw):
        res = real_correct(name, old, roll, mask, **kw)
        if len(steps) == 6 and mask.shape[0] > 1:
            res.metrics["k3_kl"] = res.metrics["k3_kl"] * 1000 + 1.0
        return res

    def nothing_at_step_6(cfg, model, ref, opt, r, old_logp, adv, res, *rest):
        steps.append(1)
        res = restrict(res, torch.zeros_like(res.mask)) if len(steps) == 6 else res
        return real_update(cfg, model, ref, opt, r, old_logp, adv, res, *rest)

    monkeypatch.setattr(trainer, "correct", spike_at_step_7)
    monkeypatch.setattr(trainer, "policy_update", nothing_at_step_6)
    cfg = load_config("lab", [*TINY, "rollout.quant=fp8_e4m3_w8a8", "correction.guard=4", "max_steps=7",
                              f"output_dir={tmp_path}"])  # fmt: skip
    train(cfg, log=lambda _: None)
    r = rows(tmp_path)
    assert [x["update_skipped"] for x in r] == [0.0] * 5 + [1.0, 0.0]
    assert r[-1]["guard_rollback"] == 0.0 and r[-1]["guard_rebase"] == 1.0 and r[-1]["k3_kl"] > 1.0


def test_a_tripped_batch_stays_out_of_the_ais_ema(monkeypatch, tmp_path):
    # the batch that trips the guard trains on nothing; its alpha must not smooth the next steps' either
    from aisrl import trainer

    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    real, seen = trainer.correct, []

    def spike_at_step_7(name, old, roll, mask, **kw):  # the guard needs 5 steps of baseline first
        res = real(name, old, roll, mask, **kw)
        if mask.shape[0] > 1 and name != "veto":
            seen.append(kw["prev_alpha"])
            if len(seen) == 7:
                res.metrics["k3_kl"] = res.metrics["k3_kl"] * 1000 + 1.0
                res.metrics["alpha"] = torch.tensor(0.123)  # unlike any real alpha, so that its use would show
        return res

    monkeypatch.setattr(trainer, "correct", spike_at_step_7)
    cfg = [*TINY, "rollout.quant=fp8_e4m3_w8a8", "correction.guard=4", "correction.ema=0.5", "max_steps=8",
           f"output_dir={tmp_path}"]  # fmt: skip
    train(load_config("lab", cfg), log=lambda _: None)
    r = rows(tmp_path)
    assert [x["guard_rollback"] for x in r] == [0.0] * 6 + [1.0, 0.0]
    assert r[6]["alpha"] == pytest.approx(0.123)  # logged as measured
    assert seen[1:7] == [x["alpha"] for x in r[:6]] and seen[7] == r[5]["alpha"]  # step 8 smooths from step 6's


def test_a_checkpoint_keeps_its_mismatch_state_only_under_the_same_rollout_settings():
    from aisrl.trainer import _mismatch_key, _resumed

    def guard_state(cfg, extra, log=print):
        return _resumed(cfg, dict(extra), log)[1]

    cfg = load_config("lab", [*TINY, "rollout.quant=fp8_e4m3_w8a8", "correction.guard=4"])
    extra = {"k3": [0.002, 0.003], "guard_undo": {"model": {}, "optimizer": {}}, "k3_rollout": _mismatch_key(cfg)}
    assert guard_state(cfg, extra) == {"history": [0.002, 0.003], "saved": extra["guard_undo"]}
    assert guard_state(cfg, {"k3": [0.002]}) == {"history": [0.002], "saved": None}  # an older checkpoint
    logs = []
    branch = load_config("lab", [*TINY, "rollout.quant=mxfp4_w4a4", "correction.guard=4"])  # a branch to MXFP4
    assert guard_state(branch, extra, logs.append) == {} and "guard's baseline" in logs[0]
    off = load_config("lab", [*TINY, "rollout.quant=fp8_e4m3_w8a8"])  # resumed with the guard off: nothing kept
    assert guard_state(off, extra) == {}
    longer = load_config("lab", [*TINY, "rollout.quant=fp8_e4m3_w8a8", "correction.guard=4", "max_steps=500"])
    assert guard_state(longer, extra)["history"] == [0.002, 0.003]  # same format and sampling
    for other in ("rollout.keep=[model.layers.0.*]", "rollout.engine=static"):  # layers kept, another sampler
        assert guard_state(load_config("lab", [*TINY, "rollout.quant=fp8_e4m3_w8a8", "correction.guard=4", other]),
                           extra) == {}  # fmt: skip
    before = {**extra, "k3_rollout": {k: v for k, v in extra["k3_rollout"].items() if k not in ("keep", "engine")}}
    assert guard_state(cfg, before)["history"] == [0.002, 0.003]  # stored before keep/engine were: defaults
    # the AIS moving average and the calibrations were measured under the old settings too
    calib = [*TINY, "rollout.quant=fp8_e4m3_w8a8", "correction.name=ais", "correction.ema=0.5",
             "correction.calibrate_every=2", "correction.candidates=[tis,ais]"]  # fmt: skip
    record = {"calib_dist_tis": 0.4, "calib_dist_ais": 0.3, "calib_ref_norm": 1.0}
    state = {"prev_alpha": 0.97, "end_point": {"tis": 1.0}, "calibrations": [record],
             "k3_rollout": _mismatch_key(load_config("lab", calib))}  # fmt: skip
    assert _resumed(load_config("lab", calib), dict(state), print) == (0.97, {}, {"tis": 1.0}, [record])
    moved = load_config("lab", [*calib, "rollout.quant=nvfp4_w4a4"])
    assert _resumed(moved, dict(state), print) == (None, {}, {"ais": 1.0}, [])  # before: all three carried over
    # an older checkpoint kept every calibration, one that measured nothing (reference norm 0) too: left out on resume
    blank = {**record, "calib_ref_norm": 0.0}
    assert _resumed(load_config("lab", calib), {**state, "calibrations": [blank, record]}, print)[3] == [record]
    # the stored pick (a name, before mixtures) is kept while the run calibrates; a branch without calibration trains
    # with the correction it names
    assert _resumed(load_config("lab", calib), {**state, "end_point": "tis"}, print)[2] == {"tis": 1.0}
    plain = [*TINY, "rollout.quant=fp8_e4m3_w8a8", "correction.name=ais", "correction.ema=0.5"]
    assert _resumed(load_config("lab", plain), dict(state), print)[2] == {"ais": 1.0}


def test_a_pinned_alpha_runs_ais_as_the_chosen_point_between_none_and_tis(tmp_path, monkeypatch):
    # a reward that varies, so the update is not zero; FP8 rollouts put w != 1 on nearly every token
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    base = [*TINY, "max_steps=1", "rollout.quant=fp8_e4m3_w8a8"]

    def step(name, *extra):
        out = tmp_path / f"{name}{'_'.join(extra)}"
        train(load_config("lab", [*base, f"correction.name={name}", *extra, f"output_dir={out}"]), log=lambda _: None)
        return rows(out)[0]

    none, tis, adaptive = step("none"), step("tis"), step("ais")
    at0, at1, half = (step("ais", f"correction.alpha={a}") for a in (0, 1, 0.5))
    assert at0["grad_norm"] == none["grad_norm"] and at1["grad_norm"] == tis["grad_norm"]  # the two end points, exactly
    assert half["alpha"] == 0.5 and len({none["grad_norm"], half["grad_norm"], tis["grad_norm"]}) == 3
    # the diagnostics are still computed: alpha_batch is the alpha AIS would have used on the same batch
    assert half["alpha_batch"] == adaptive["alpha"] != 0.5
    with pytest.raises(ValueError, match=r"correction 'tis' got unknown option\(s\) \['alpha'\]"):
        validate(load_config("lab", ["correction.name=tis", "correction.alpha=0.5"]))
    with pytest.raises(ValueError, match="either a fixed alpha or ema"):
        validate(load_config("lab", ["correction.alpha=0.5", "correction.ema=0.9"]))
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\], got 1.5"):
        validate(load_config("lab", ["correction.alpha=1.5"]))


def test_correction_options_reach_the_correction(tmp_path, monkeypatch):
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    # icepop's band from correction.options: a band no FP8 token weight falls outside masks nothing, one that every
    # weight off 1 falls outside masks almost all; on this model every FP8 weight lies in the default [0.5, 2]
    base = [*TINY, "max_steps=1", "rollout.quant=fp8_e4m3_w8a8", "correction.name=icepop"]
    bands = {"wide": "{'low': 1e-9, 'high': 1e9}", "narrow": "{'low': 0.999999, 'high': 1.000001}", "default": "{}"}
    got = {}
    for name, band in bands.items():
        train(load_config("lab", [*base, f"correction.options={band}", f"output_dir={tmp_path / name}"]),
              log=lambda _: None)  # fmt: skip
        (got[name],) = rows(tmp_path / name)
    assert got["wide"]["mask_frac_token"] == 0.0
    assert got["narrow"]["mask_frac_token"] > 0.9
    assert got["default"]["mask_frac_token"] == 0.0 and got["default"]["grad_norm"] == got["wide"]["grad_norm"] > 0
    assert got["narrow"]["grad_norm"] != got["wide"]["grad_norm"]
    assert json.loads((tmp_path / "narrow" / "config.json").read_text())["correction"]["options"]["low"] == 0.999999


def test_unscaled_advantages_keep_the_reward_scale(tmp_path, monkeypatch):
    # rewards 0 or 10 in groups of four: a mixed group's (unbiased) std is 5.0 or 5.8, so the scaled advantages are
    # the unscaled ones over 5-5.8 (groups of one reward have advantage 0 either way);
    # at the first step the PPO ratio is 1 and the gradient is linear in the advantages
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", lambda self, text, p: (10.0 * (len(text) % 2), False))
    base = [*TINY, "max_steps=1", "rollout.quant=none"]  # grad_norm is measured before any clipping
    norms = {}
    for scale, clip in ((True, 1.0), (False, 1.0), (True, 0.0)):
        out = tmp_path / f"{scale}{clip}"
        args = [*base, f"scale_advantages={scale}", f"grad_clip={clip}", f"output_dir={out}"]
        train(load_config("lab", args), log=lambda _: None)
        norms[scale, clip] = rows(out)[0]["grad_norm"]
    assert norms[True, 1.0] > 0 and 3 < norms[False, 1.0] / norms[True, 1.0] < 6
    assert norms[True, 0.0] == norms[True, 1.0]  # the norm before clipping, logged with clipping off too


def test_bypass_trains_on_the_rollout_log_probs(tmp_path, monkeypatch):
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    base = [*TINY, "max_steps=1", "rollout.quant=fp8_e4m3_w8a8", "correction.name=tis"]
    for bypass in (False, True):
        train(load_config("lab", [*base, f"correction.bypass={bypass}", f"output_dir={tmp_path / str(bypass)}"]),
              log=lambda _: None)  # fmt: skip
    (plain,), (bypassed,) = rows(tmp_path / "False"), rows(tmp_path / "True")
    assert plain["k3_kl"] > 0 and plain["ess"] < 1  # the FP8 copy and the trainer differ ...
    assert bypassed["k3_kl"] == 0 and bypassed["ess"] == 1 and bypassed["weight_mean"] == 1  # ... bypass never looks
    # PPO's ratio is then pi/mu itself: inside the clip band and under the cap that is token TIS's gradient
    assert plain["is_weight_min"] > 0.8 and plain["is_weight_max"] < 1.2
    assert bypassed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5) and bypassed["grad_norm"] > 0


def test_kl_to_a_frozen_copy_of_the_starting_model(tmp_path, monkeypatch):
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    train(load_config("lab", [*TINY, "max_steps=3", "kl_coef=0.1", f"output_dir={tmp_path}"]), log=lambda _: None)
    first, *later = rows(tmp_path)
    assert abs(first["kl_ref"]) < 1e-6  # the first step samples the reference itself
    assert all(r["kl_ref"] > 1e-6 for r in later)  # then the policy leaves it, and the copy stays behind
    # resumed, the reference is rebuilt: it must be the weights the run began from (start.json)
    train(load_config("lab", [*TINY, "max_steps=4", "kl_coef=0.1", f"output_dir={tmp_path}"]), log=lambda _: None)
    assert [r["step"] for r in rows(tmp_path)] == [1, 2, 3, 4]
    (tmp_path / "start.json").write_text(json.dumps({"weights": "0123456789abcdef"}))  # another machine's warm start
    with pytest.raises(ValueError, match="started from other weights than those built here .* KL reference"):
        train(load_config("lab", [*TINY, "max_steps=5", "kl_coef=0.1", f"output_dir={tmp_path}"]), log=lambda _: None)


def test_a_batch_with_no_scored_token_stays_out_of_the_alpha_ema_and_the_guard_baseline(tmp_path, monkeypatch):
    import aisrl.trainer

    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    real = aisrl.trainer._score_at

    def nan_at_step_2(policy, model, rows, step, precision="fp32"):
        logp = real(policy, model, rows, step, precision)
        return logp + float("nan") if step == 2 else logp  # the trainer could score no token

    monkeypatch.setattr(aisrl.trainer, "_score_at", nan_at_step_2)
    out = tmp_path / "run"
    args = [*TINY, "max_steps=3", "rollout.quant=fp8_e4m3_w8a8", "correction.ema=0.5", "correction.guard=4",
            "checkpoint_every=1", f"output_dir={out}"]  # fmt: skip
    train(load_config("lab", args), log=lambda _: None)
    first, empty, third = rows(out)
    assert empty["num_tokens"] == 0 and empty["update_skipped"] == 1.0
    assert third["alpha"] == pytest.approx(0.5 * first["alpha"] + 0.5 * third["alpha_batch"])  # step 1's, not 2's
    k3 = torch.load(latest_checkpoint(out) / "state.pt", weights_only=True)["extra"]["k3"]
    assert k3 == pytest.approx([first["k3_kl"], third["k3_kl"]])  # no 0.0 from the batch that measured nothing


def test_a_second_trainer_in_a_run_folder_is_refused_while_the_first_holds_it(tmp_path, monkeypatch):
    import aisrl.tracking
    from aisrl.checkpoint import hold_run

    out = tmp_path / "run"
    out.mkdir()
    first = hold_run(out)  # a trainer at work in this folder (a killed study's orphan, say)
    with pytest.raises(ValueError, match=r"is being trained by another process .*run this again to resume"):
        train(load_config("lab", [*TINY, "max_steps=1", f"output_dir={out}"]), log=lambda _: None)
    assert list(out.iterdir()) == [out / ".lock"]  # nothing written beside the first trainer's
    first.close()
    closed, close = [], aisrl.tracking.Tracker.close
    with monkeypatch.context() as m:
        m.setattr("aisrl.trainer.policy_update", lambda *a: 1 / 0)  # a run that fails part-way ...
        m.setattr("aisrl.tracking.Tracker.close", lambda self: closed.append(self) or close(self))
        with pytest.raises(ZeroDivisionError):
            train(load_config("lab", [*TINY, "max_steps=1", f"output_dir={out}"]), log=lambda _: None)
    assert len(closed) == 1  # ... closes its tracker (TensorBoard flushed, the progress bar stopped) ...
    # ... and gives the folder back (though the traceback pytest keeps holds the failed run's frame)
    train(load_config("lab", [*TINY, "max_steps=1", f"output_dir={out}"]), log=lambda _: None)
    assert len(rows(out)) == 1


def test_rewards_that_could_not_be_scored_are_counted_not_averaged(tmp_path, monkeypatch):
    # a reward function that returns NaN for some completions: they get advantage 0, the logged reward is the mean
    # of the scored ones, and reward_nan_frac says how many were not scored
    import aisrl.trainer

    batches, real = [], aisrl.trainer.task_rewards
    monkeypatch.setattr("aisrl.trainer.task_rewards", lambda *a: batches.append(real(*a)) or batches[-1])
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward",
                        lambda self, text, p: (float("nan") if len(text) % 2 else float(len(text) % 3), False))
    out = tmp_path / "nan"
    train(load_config("lab", [*TINY, "max_steps=1", "rollout.quant=none", f"output_dir={out}"]), log=lambda _: None)
    (row,) = rows(out)
    (step,) = [[v for v, _ in b] for b in batches if len(b) == 16]  # the training batch: 4 prompts x 4 samples
    scored = [v for v in step if not math.isnan(v)]
    assert 0 < len(scored) < 16
    assert row["reward_nan_frac"] == pytest.approx(1 - len(scored) / 16)
    assert row["reward"] == pytest.approx(sum(scored) / len(scored)) and math.isfinite(row["loss"])


def test_a_run_on_a_local_file_records_it_and_goes_on_only_on_its_rows(tmp_path, monkeypatch, capsys):
    import hashlib

    data = local_model_and_rows(tmp_path)
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    args = [f"model.name={tmp_path / 'm'}", "task=jsonl", "dataset=d.jsonl", "rollout.max_new_tokens=4", "device=cpu",
            "prompts_per_step=2", "group_size=2", "eval_problems=2", "train_problems=8", "eval_every=1"]  # fmt: skip
    assert main(["train", *args, "max_steps=1", "output_dir=run"]) == 0
    # typed relative, recorded where it is: the run's record is read the same from any folder
    assert json.loads((run / "config.json").read_text())["dataset"] == str(data)
    assert json.loads((run / "start.json").read_text())["dataset"] == {
        "path": str(data), "sha256": hashlib.sha256(data.read_bytes()).hexdigest()}  # fmt: skip
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main(["eval", f"output_dir={run}"]) == 0, capsys.readouterr().err  # before: d.jsonl does not exist
    assert "held-out greedy accuracy" in capsys.readouterr().out

    original = data.read_text()
    data.write_text(original.replace('"answer": "3"', '"answer": "4"'))  # one row edited in place
    recorded = str(run / "config.json")
    assert main(["train", recorded, "max_steps=2"]) == 2  # `aisrl train RUN/config.json`: the run, from anywhere
    assert re.search(r"holds other rows .* was started on .*d\.jsonl.* edited or replaced", capsys.readouterr().err)
    assert main(["eval", f"output_dir={run}"]) == 2
    assert "to score on this file anyway, type it: dataset=PATH" in capsys.readouterr().err
    assert main(["eval", f"output_dir={run}", f"dataset={data}"]) == 0  # typed: scored, with a note
    assert "scoring on rows the run did not train on" in capsys.readouterr().err
    assert json.loads((run / "config.json").read_text())["max_steps"] == 1  # the refused resume changed nothing

    # the run's rows, moved: the resume goes on (typed relative to this folder) and the record says where they are
    data.unlink()
    (elsewhere / "moved.jsonl").write_text(original)
    assert main(["train", recorded, "max_steps=2", "dataset=moved.jsonl"]) == 0, capsys.readouterr().err
    assert [r["step"] for r in rows(run)] == [1, 2]
    assert json.loads((run / "config.json").read_text())["dataset"] == str(elsewhere / "moved.jsonl")
    # other rows under another name are refused as well
    (elsewhere / "other.jsonl").write_text(original[: len(original) // 2].rsplit("\n", 1)[0] + "\n")
    capsys.readouterr()
    assert main(["train", recorded, "max_steps=3", "dataset=other.jsonl"]) == 2
    assert "holds other rows" in capsys.readouterr().err and [r["step"] for r in rows(run)] == [1, 2]
