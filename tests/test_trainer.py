"""The trainer end to end on a tiny lab model: smoke run, exact resume, crash-safe checkpoints, config errors."""

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from conftest import TINY_LAB

from aisrl.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from aisrl.cli import main
from aisrl.train_config import load_config
from aisrl.trainer import train

TINY = [*TINY_LAB, "eval_every=2"]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AISRL_CACHE", str(tmp_path / "cache"))


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_step_smoke_run(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "lab", *TINY, "max_steps=2", f"output_dir={out}"]) == 0
    r = rows(out)
    assert [x["step"] for x in r] == [1, 2]
    for key in ("reward", "accuracy", "alpha", "k3_kl", "ess", "weight_reliability", "time_rollout", "time_sync"):
        assert key in r[-1], key
    assert "eval_accuracy" in r[-1] and (out / "report.png").exists() and (out / "summary.json").exists()
    assert latest_checkpoint(out) is not None
    if importlib.util.find_spec("tensorboard"):
        assert list((out / "tensorboard").glob("events.out.tfevents.*"))


def test_resume_is_exact(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    train(load_config("lab", [*TINY, "max_steps=6", f"output_dir={a}", "checkpoint_every=3"]), log=lambda _: None)
    train(load_config("lab", [*TINY, "max_steps=3", f"output_dir={b}", "checkpoint_every=3"]), log=lambda _: None)
    train(load_config("lab", [*TINY, "max_steps=6", f"output_dir={b}", "checkpoint_every=3"]), log=lambda _: None)
    ra, rb = rows(a), rows(b)
    assert [x["step"] for x in rb] == [1, 2, 3, 4, 5, 6]
    drop = ("time_rollout", "time_logprob", "time_correction", "time_train", "time_sync")
    for x, y in zip(ra[3:], rb[3:], strict=True):
        assert {k: v for k, v in x.items() if k not in drop} == {k: v for k, v in y.items() if k not in drop}


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
        (["task=jsonl", "dataset=missing.jsonl", "model.name=smollm2"], "dataset file 'missing.jsonl' not found"),
        (["rollout.quant=fp9"], "unknown quantisation preset 'fp9'"),
    ],
)
def test_bad_config_fails_with_a_clear_message(args, message, capsys, monkeypatch):
    monkeypatch.setattr("aisrl.models.load_model", lambda name: (None, object()))  # never load real weights
    assert main(["train", "lab", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_unknown_preset_lists_the_presets(capsys):
    assert main(["train", "nonexistent-preset"]) == 2
    assert "unknown preset 'nonexistent-preset'" in capsys.readouterr().err
