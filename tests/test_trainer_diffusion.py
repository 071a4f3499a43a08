"""GRPO on a masked-diffusion policy: a real 2-step run through the same trainer, corrections and outputs."""

import json

import pytest

from aisrl.cli import main

TINY = ["model.kind=diffusion", "lab.task=sudoku4", "lab.hidden=32", "lab.layers=1", "lab.sft_max_steps=0",
        "prompts_per_step=4", "group_size=4", "rollout.max_new_tokens=40", "diffusion.block_length=8",
        "diffusion.steps=5", "eval_problems=4", "train_problems=16", "max_steps=2", "eval_every=2"]  # fmt: skip


@pytest.fixture(autouse=True)
def setup(tmp_path, monkeypatch):
    monkeypatch.setenv("AISRL_CACHE", str(tmp_path / "cache"))
    # an untrained policy never solves a Sudoku: a reward that varies with the text gives real gradients
    monkeypatch.setattr("aisrl.tasks.Sudoku4.reward", lambda self, text, p: (float(len(text) % 3), False))


def rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_grpo_steps_with_fp8_rollouts_and_ais(tmp_path):
    out = tmp_path / "fp8"
    assert main(["train", "lab", *TINY, "rollout.quant=fp8_e4m3_w8a8", "correction.name=ais", f"output_dir={out}"]) == 0
    r = rows(out)
    assert [x["step"] for x in r] == [1, 2]
    assert all(x["k3_kl"] > 0 and 0 <= x["alpha"] <= 1 and x["grad_norm"] > 0 for x in r)
    assert "eval_accuracy" in r[-1] and (out / "summary.json").exists()


def test_identical_rollout_and_trainer_give_weights_of_exactly_one(tmp_path):
    out = tmp_path / "fp32"
    assert main(["train", "lab", *TINY, "rollout.quant=none", "correction.name=tis", f"output_dir={out}"]) == 0
    for x in rows(out):
        assert x["k3_kl"] == 0 and x["is_weight_min"] == 1 and x["is_weight_max"] == 1


def test_bad_diffusion_geometry_is_named(tmp_path, capsys):
    assert main(["train", "lab", *TINY, "diffusion.block_length=7", f"output_dir={tmp_path}"]) == 2
    assert "multiple of block_length=7" in capsys.readouterr().err
