"""What each training step does, checked against values worked out by hand: the learning-rate warm-up across a
resume, the prompts drawn from seed and step, the rollout copy kept in sync, old log-probs scored without dropout,
accuracy as correct answers, which problems each accuracy is over, the last step always evaluated, an aligned run
evaluated in full precision, and AIS's EMA carried over a resume."""

import json
import random

import pytest
from conftest import TINY_LAB, varying_reward

from aisrl.build import task_of
from aisrl.train_config import load_config
from aisrl.trainer import train

TINY = [*TINY_LAB, "eval_every=2", "warmup_steps=5"]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AISRL_CACHE", str(tmp_path / "cache"))


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def quiet(_):
    pass


def test_lr_follows_the_linear_warmup_and_a_resume_stays_on_it(tmp_path, monkeypatch):
    # lr=5e-4, warmup_steps=5: update k (1-based) uses 5e-4 * k / 5 = 1e-4 * k, until k = 5
    import aisrl.trainer as trainer

    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    lrs, real = [], trainer.policy_update

    def record(cfg, model, ref, opt, *rest):
        lrs.append(opt.param_groups[0]["lr"])
        return real(cfg, model, ref, opt, *rest)

    monkeypatch.setattr(trainer, "policy_update", record)
    train(load_config("lab", [*TINY, "max_steps=3", f"output_dir={tmp_path / 'a'}"]), log=quiet)
    assert lrs == pytest.approx([1e-4, 2e-4, 3e-4], rel=1e-9)
    lrs.clear()
    b = tmp_path / "b"
    train(load_config("lab", [*TINY, "max_steps=2", "checkpoint_every=1", f"output_dir={b}"]), log=quiet)
    train(load_config("lab", [*TINY, "max_steps=7", "checkpoint_every=1", f"output_dir={b}"]), log=quiet)
    assert lrs == pytest.approx([1e-4, 2e-4, 3e-4, 4e-4, 5e-4, 5e-4, 5e-4], rel=1e-9)


def test_the_rollout_copy_follows_every_update(tmp_path, monkeypatch):
    # full-precision rollouts: after the step-1 update is synced, step 2's rollout log-probs are the trainer's again
    # (rounding only, as at step 1); an unsynced copy would sample from the step-0 weights
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    args = [*TINY, "max_steps=2", "rollout.quant=none", "correction.name=tis", "device=cpu", "warmup_steps=0",
            "lr=3e-3", f"output_dir={tmp_path}"]  # fmt: skip
    train(load_config("lab", args), log=quiet)
    first, second = rows(tmp_path)
    assert first["grad_norm"] > 0 and first["update_skipped"] == 0.0  # step 1 moved the weights
    assert first["k3_kl"] < 1e-12 and second["k3_kl"] < 1e-12
    assert abs(second["is_weight_max"] - 1) < 1e-5


def test_each_step_draws_its_prompts_from_seed_and_step(tmp_path, monkeypatch):
    # step s: random.Random(seed * 1_000_003 + s).sample(pool, B), each prompt G times in a row (module docstring)
    import aisrl.trainer as trainer

    batches, real = [], trainer.task_rewards
    monkeypatch.setattr(trainer, "task_rewards", lambda task, tok, r, problems: batches.append(list(problems))
                        or real(task, tok, r, problems))  # fmt: skip
    cfg = load_config("lab", [*TINY, "max_steps=3", "seed=0", f"output_dir={tmp_path}"])
    train(cfg, log=quiet)
    steps = [b for b in batches if len(b) == 16]
    pool = task_of(cfg).problems("train", 64, seed=0)
    want = [[p for p in random.Random(s).sample(pool, 4) for _ in range(4)] for s in (1, 2, 3)]
    assert [[p.question for p in b] for b in steps] == [[p.question for p in w] for w in want]
    assert len({tuple(p.question for p in b) for b in steps}) == 3  # every step its own prompts


def test_the_last_step_is_evaluated_whatever_eval_every(tmp_path):
    train(load_config("lab", [*TINY, "max_steps=1", "eval_every=2", f"output_dir={tmp_path}"]), log=quiet)
    (row,) = rows(tmp_path)
    assert "eval_accuracy" in row and "fit_accuracy" in row and "eval_accuracy_start" in row


def test_a_fresh_start_is_not_stopped_by_a_damaged_metrics_file_it_replaces(tmp_path):
    """No checkpoint: every old row is dropped, so a bad line among them is no reason to refuse (before: an error
    telling to remove the line 'to resume', found by review); a resume still refuses one it would keep."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "re\n{"step": 3}\n')
    train(load_config("lab", [*TINY, "max_steps=1", "checkpoint_every=1", f"output_dir={tmp_path}"]), log=quiet)
    assert [r["step"] for r in rows(tmp_path)] == [1]
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "re\n{"step": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl line 2 is not JSON"):
        train(load_config("lab", [*TINY, "max_steps=2", "checkpoint_every=1", f"output_dir={tmp_path}"]), log=quiet)


@pytest.mark.parametrize("which", ["train", "test"])
def test_fit_accuracy_is_over_training_problems_and_eval_accuracy_over_held_out_ones(tmp_path, monkeypatch, which):
    # a reward that is correct exactly on one split's problems: the training pool is task.problems("train", 64,
    # seed=0) (fit_accuracy decodes its first eval_problems=8), the held-out set task.problems("test", 8, seed=1);
    # the two splits are disjoint
    cfg = load_config("lab", [*TINY, "max_steps=1", "seed=0", f"output_dir={tmp_path}"])
    task = task_of(cfg)
    right = {p.question for p in (task.problems("train", 64, seed=0)[:8] if which == "train"
                                  else task.problems("test", 8, seed=1))}  # fmt: skip
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", lambda self, text, p: (0.0, p.question in right))
    train(cfg, log=quiet)
    (row,) = rows(tmp_path)
    fit, held = (1.0, 0.0) if which == "train" else (0.0, 1.0)
    assert (row["fit_accuracy_start"], row["eval_accuracy_start"]) == (fit, held)
    assert (row["fit_accuracy"], row["eval_accuracy"]) == (fit, held)


@pytest.mark.parametrize("reward, accuracy", [((1.0, False), 0.0), ((0.0, True), 1.0)])
def test_accuracy_counts_correct_answers_not_rewarded_ones(tmp_path, monkeypatch, reward, accuracy):
    # a reward of 1.0 for a wrong answer (format only) is no correct answer; a right answer with reward 0 is one
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", lambda self, text, p: reward)
    train(load_config("lab", [*TINY, "max_steps=1", f"output_dir={tmp_path}"]), log=quiet)
    (row,) = rows(tmp_path)
    assert row["accuracy"] == accuracy and row["reward"] == reward[0]


def test_old_log_probs_are_scored_without_dropout(tmp_path, monkeypatch):
    # LoRA adapters with dropout 0.5 and full-precision rollouts: step 1's update makes B != 0, so from step 2 on a
    # dropout-noised old_logp would differ from the (dropout-free) rollout log-probs; without it they agree up to the
    # rounding of the merged copy
    pytest.importorskip("peft")
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    args = [*TINY, "max_steps=2", "lora.r=4", "lora.dropout=0.5", "rollout.quant=none", "correction.name=tis",
            "warmup_steps=0", "lr=1e-2", f"output_dir={tmp_path}"]  # fmt: skip
    train(load_config("lab", args), log=quiet)
    first, second = rows(tmp_path)
    assert first["grad_norm"] > 0 and first["update_skipped"] == 0.0
    assert second["k3_kl"] < 1e-9


def test_evaluation_of_an_aligned_run_decodes_in_full_precision(tmp_path, monkeypatch):
    from aisrl.policy import CausalPolicy
    from aisrl.qarl import AlignedLinear

    seen, greedy = [], CausalPolicy.greedy

    def probe(self, model, prompts):
        seen.append([getattr(m, "aligned", True) for m in model.modules() if isinstance(m, AlignedLinear)])
        return greedy(self, model, prompts)

    monkeypatch.setattr(CausalPolicy, "greedy", probe)
    train(load_config("lab", [*TINY_LAB, "max_steps=1", "rollout.align=true", "rollout.quant=mxfp4_w4a4", "loss=tbpo",
                              "correction.name=none", f"output_dir={tmp_path}"]), log=quiet)  # fmt: skip
    seen = [layers for layers in seen if layers]  # (the lab's own warm-start evaluation comes before align_)
    assert len(seen) == 4  # held-out and fit, at the start and at the last step
    assert not any(any(layers) for layers in seen)


def test_a_resumed_run_smooths_alpha_from_the_checkpoints_ema(tmp_path, monkeypatch):
    # ema=0.5: alpha_s = 0.5 * alpha_{s-1} + 0.5 * alpha_batch_s, across the resume as well (prev_alpha is checkpointed)
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    args = [*TINY, "rollout.quant=fp8_e4m3_w8a8", "correction.ema=0.5", "checkpoint_every=1", f"output_dir={tmp_path}"]
    train(load_config("lab", [*args, "max_steps=2"]), log=quiet)
    train(load_config("lab", [*args, "max_steps=3"]), log=quiet)
    _, second, third = rows(tmp_path)
    assert third["alpha"] != third["alpha_batch"]
    assert third["alpha"] == pytest.approx(0.5 * second["alpha"] + 0.5 * third["alpha_batch"], rel=1e-6)


def test_a_kv_format_samples_with_the_fp8_cache(tmp_path, monkeypatch):
    # the same run with and without `_kv`: the same weights, prompts and seeds, so only the FP8 cache can change what
    # the sampler computes; with it left out of sampling the two would log the same mismatch to the last bit
    import aisrl.policy

    cache, real = [], aisrl.policy.generate
    monkeypatch.setattr(aisrl.policy, "generate", lambda *a, **k: cache.append(k.get("kv_cache_fp8")) or real(*a, **k))
    k3 = {}
    for quant in ("fp8_e4m3_w8a8", "fp8_e4m3_w8a8_kv"):
        train(load_config("lab", [*TINY, "max_steps=1", f"rollout.quant={quant}", f"output_dir={tmp_path / quant}"]),
              log=quiet)  # fmt: skip
        (row,) = rows(tmp_path / quant)
        k3[quant] = row["k3_kl"]
    assert True in cache and k3["fp8_e4m3_w8a8"] != k3["fp8_e4m3_w8a8_kv"]
