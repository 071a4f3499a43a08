"""Sol-RL selection keeps each prompt's lowest and highest rewards, and the trainer runs with it."""

import json

import pytest
import torch
from conftest import TINY_LAB

from aisrl.solrl import select_extremes
from aisrl.train_config import load_config
from aisrl.trainer import train


def test_select_extremes_keeps_bottom_and_top_per_prompt():
    rewards = torch.tensor([0.5, 1.5, 0.0, 1.0, 0.5, 1.5,   # prompt 0: pool of 6
                            1.0, 1.0, 1.0, 1.0, 0.0, 1.0])  # prompt 1: ties broken by position  # fmt: skip
    idx = select_extremes(rewards, pool=6, keep=4)
    assert idx.tolist() == [2, 0, 1, 5, 10, 6, 9, 11]  # 2 lowest then 2 highest of each prompt
    assert select_extremes(rewards, pool=6, keep=3).tolist() == [2, 1, 5, 10, 9, 11]
    # candidates that could not be scored (NaN) are never taken as extremes: they sort with the pool's median
    nan = float("nan")
    r = torch.tensor([nan, 0.0, 2.0, 1.0, nan, 3.0])
    assert select_extremes(r, pool=6, keep=4).tolist() == [1, 3, 2, 5]
    assert select_extremes(torch.full((4,), nan), pool=4, keep=2).tolist() == [0, 3]  # nothing scored: any
    inf = float("inf")  # nor are infinite ones, which the advantages treat as unscored too (advantage 0)
    assert select_extremes(torch.tensor([0.0, 1.0, 0.0, 1.0, inf, -inf]), pool=6, keep=4).tolist() == [0, 2, 1, 3]
    with pytest.raises(ValueError, match="keep must be in"):
        select_extremes(rewards, pool=6, keep=7)
    with pytest.raises(ValueError, match="pool=5"):
        select_extremes(rewards, pool=5, keep=2)
    with pytest.raises(ValueError, match=r"pool is the candidates sampled per prompt, at least 2 .*; got 0"):
        select_extremes(rewards, pool=0, keep=2)  # before: ZeroDivisionError


def test_trainer_with_solrl_pool_and_qarl_tbpo_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("AISRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", lambda self, text, p: (float(len(text) % 3), False))
    out = tmp_path / "solrl"
    train(load_config("lab", [*TINY_LAB, "max_steps=2", "rollout.pool=8", "correction.name=none", f"output_dir={out}"]),
          log=lambda _: None)  # fmt: skip
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["num_seqs"] for r in rows] == [16.0, 16.0]  # 4 prompts x group 4 kept out of 4 x 8 sampled
    assert all(r["k3_kl"] > 0 and r["alpha"] is None for r in rows)  # the real FP8 mismatch is still reported
    with pytest.raises(ValueError, match="set correction.name=none"):
        train(load_config("lab", [*TINY_LAB, "rollout.pool=8", "correction.name=ais", f"output_dir={out}z"]))
    out = tmp_path / "qarl"
    train(load_config("lab", [*TINY_LAB, "max_steps=2", "rollout.align=true", "loss=tbpo", "correction.name=none",
                              "rollout.quant=mxfp4_w4a4", f"output_dir={out}"]), log=lambda _: None)  # fmt: skip
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["k3_kl"] < 1e-9 and "error_token_frac" in r and r["grad_norm"] > 0 for r in rows)
    with pytest.raises(ValueError, match="rollout.align"):
        train(load_config("lab", [*TINY_LAB, "rollout.align=true", "rollout.quant=none", f"output_dir={out}x"]))
    with pytest.raises(ValueError, match="unknown loss 'ppo'"):
        train(load_config("lab", [*TINY_LAB, "loss=ppo", f"output_dir={out}y"]))


def test_more_samples_a_step_than_the_seed_streams_hold_is_refused():
    # a step's sampling seeds are stream * 4096 + row: past 4096 rows they would repeat the next step's
    from aisrl.train_config import load_config, validate

    validate(load_config("lab", ["prompts_per_step=256", "group_size=16"]))  # 4096 exactly
    with pytest.raises(ValueError, match=r"seed must be in \[0, 1000000000\)"):  # seed * 1000003 * 4096 in int64
        validate(load_config("lab", ["seed=10000000000"]))
    with pytest.raises(ValueError, match="= 4128 samples a step"):
        validate(load_config("lab", ["prompts_per_step=258", "group_size=16"]))
    with pytest.raises(ValueError, match=r"prompts_per_step x rollout.pool = 8192"):
        validate(load_config("lab", ["prompts_per_step=256", "rollout.pool=32", "correction.name=none"]))
