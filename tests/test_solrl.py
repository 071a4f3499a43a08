"""Sol-RL selection keeps each prompt's lowest and highest rewards, and the trainer runs with it."""

import json
import math

import pytest
import torch
from conftest import TINY_LAB, varying_reward

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
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
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
    from aisrl.train_checks import validate
    from aisrl.train_config import load_config

    validate(load_config("lab", ["prompts_per_step=256", "group_size=16"]))  # 4096 exactly
    with pytest.raises(ValueError, match=r"seed must be in \[0, 1000000000\)"):  # seed * 1000003 * 4096 in int64
        validate(load_config("lab", ["seed=10000000000"]))
    with pytest.raises(ValueError, match="= 4128 samples a step"):
        validate(load_config("lab", ["prompts_per_step=258", "group_size=16"]))
    with pytest.raises(ValueError, match=r"prompts_per_step x rollout.pool = 8192"):
        validate(load_config("lab", ["prompts_per_step=256", "rollout.pool=32", "correction.name=none"]))


def test_trainer_trains_on_each_prompts_extremes_and_counts_error_tokens_of_the_kept_rows(tmp_path, monkeypatch):
    # the rows rescored at training precision (old log-probs) are, per prompt, the 2 lowest- and 2 highest-reward
    # completions of its pool of 8, and error_token_frac is the flagged share of those rows' completion tokens
    import aisrl.trainer as tr

    monkeypatch.setenv("AISRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", lambda self, text, p: (float(len(text) % 5), False))
    pools, scored, flagged = [], [], []

    def rows(r):  # each completion as its tokens
        return [tuple(ids[m.bool()].tolist()) for ids, m in zip(r.completion_ids, r.completion_mask, strict=True)]

    real_rewards = tr.task_rewards

    def task_rewards(task, tok, r, problems):
        out = real_rewards(task, tok, r, problems)
        if len(problems) == 32:  # a step's pool (evaluations score other sets)
            pools.append(list(zip(rows(r), [s[0] for s in out], strict=True)))
        return out

    monkeypatch.setattr(tr, "task_rewards", task_rewards)
    score_at = tr._score_at

    def old_logp_rows(policy, model, r, *a, **k):  # the old log-probs are the call without grad (the loss's has it)
        logp = score_at(policy, model, r, *a, **k)
        if not torch.is_grad_enabled():
            scored.append(rows(r))
            logp[:, 1::4] = -math.inf  # tokens the trainer gives probability 0 (cut by its top-k, say): still tokens
        return logp

    monkeypatch.setattr(tr, "_score_at", old_logp_rows)
    error_tokens = tr.error_tokens

    def every_other(ids, mask, log_ratio):  # flags every other token of each kept completion
        flags = torch.zeros_like(mask, dtype=torch.bool)
        flags[:, ::2] = mask[:, ::2].bool()
        flagged.append((flags.sum().item(), mask.sum().item()))
        error_tokens(ids, mask, log_ratio)  # the real detector still runs on the same shapes
        return flags

    monkeypatch.setattr(tr, "error_tokens", every_other)
    advantages, update = [], tr.policy_update

    def record(cfg, model, ref, opt, r, old_logp, adv, *rest):
        advantages.append((rows(r), adv))
        return update(cfg, model, ref, opt, r, old_logp, adv, *rest)

    monkeypatch.setattr(tr, "policy_update", record)
    out = tmp_path / "solrl"
    train(load_config("lab", [*TINY_LAB, "max_steps=2", "rollout.pool=8", "correction.name=none",
                              "correction.mask_errors=true", f"output_dir={out}"]), log=lambda _: None)  # fmt: skip
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(pools) == len(scored) == len(advantages) == 2
    for pool, kept, (trained, adv) in zip(pools, scored, advantages, strict=True):
        assert len(kept) == 16 and trained == kept  # the rows scored are the rows trained, in order
        reward = dict(pool)
        for g in range(4):  # prompt g's 8 candidates and the 4 kept
            values = sorted(r for _, r in pool[8 * g : 8 * g + 8])
            assert sorted(reward[c] for c in kept[4 * g : 4 * g + 4]) == values[:2] + values[-2:]
            assert set(kept[4 * g : 4 * g + 4]) <= {c for c, _ in pool[8 * g : 8 * g + 8]}
            # advantages within the 4 kept of one prompt: (r - mean) / (sample std + 1e-4), by hand
            mine = [reward[c] for c in kept[4 * g : 4 * g + 4]]
            mean = sum(mine) / 4
            std = math.sqrt(sum((x - mean) ** 2 for x in mine) / 3)
            want = [(x - mean) / (std + 1e-4) for x in mine]
            assert adv[4 * g : 4 * g + 4].tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)
    for row, (n_flagged, n_tokens) in zip(metrics, flagged, strict=True):
        assert 0 < n_flagged < n_tokens
        assert row["error_token_frac"] == pytest.approx(n_flagged / n_tokens)  # not over the tokens the loss keeps


def test_solrl_refuses_bypass():
    from aisrl.train_checks import validate

    with pytest.raises(ValueError, match="rescores the kept samples at training precision.*correction.bypass=false"):
        validate(load_config("lab", ["rollout.pool=16", "correction.name=none", "correction.bypass=true"]))
