"""Final-model scoring (aisrl.final_eval): the right weights, prompts and sampler are scored; results cache."""

import dataclasses
import hashlib
import json

import pytest
import torch
from conftest import TINY_LAB, varying_reward
from safetensors.torch import load_file, save_file

import aisrl.final_eval as fe
from aisrl.build import build
from aisrl.checkpoint import latest_checkpoint
from aisrl.quant import quantize_mxfp4
from aisrl.train_config import load_config
from aisrl.trainer import train


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AISRL_CACHE", str(tmp_path / "cache"))


def _run(tmp_path, quant, monkeypatch):
    """Two steps of a tiny lab run that moves its weights: the untrained model earns no reward, so every advantage
    (and the update) would be 0 and the final checkpoint the warm start; a reward by completion length is not."""
    cfg = load_config("lab", [*TINY_LAB, "max_steps=2", "eval_every=2", f"rollout.quant={quant}", "lr=0.01",
                              f"output_dir={tmp_path / quant}"])  # fmt: skip
    with monkeypatch.context() as m:
        m.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
        train(cfg, log=lambda _: None)
    return cfg


def test_scores_the_checkpoint_with_the_runs_prompts_and_sampler(tmp_path, monkeypatch):
    cfg = _run(tmp_path, "mxfp4_w4a4", monkeypatch)
    ckpt = load_file(latest_checkpoint(cfg.output_dir) / "model.safetensors")
    calls = []

    def fake_rewards(policy, model, task, tok, encode, problems, samples, kv_fp8=False):
        calls.append((model, [p.question for p in problems], samples))
        n = len(calls)  # distinct, known scores per call: 1st policy, 2nd sampler, 3rd held-out
        return [(0.1 * n, True), (0.1 * n + 0.2, False)]

    monkeypatch.setattr(fe, "_rewards", fake_rewards)
    res = fe.evaluate_final(cfg.output_dir, cfg, samples=3, held_samples=5)
    assert res["policy_reward"] == pytest.approx(0.2) and res["policy_accuracy"] == 0.5
    assert res["sampler_reward"] == pytest.approx(0.3) and res["held_reward"] == pytest.approx(0.4)
    assert res["sampler_accuracy"] == 0.5 and res["held_accuracy"] == 0.5  # the share of True, not a reward's mean
    (trained, pool, k1), (rollout, pool2, k2), (trained2, held, k3) = calls
    assert (k1, k2, k3) == (3, 3, 5) and trained is trained2 and pool == pool2
    for k, v in trained.state_dict().items():  # the final checkpoint's weights...
        assert torch.equal(v.cpu(), ckpt[k]), k
    start = build(cfg)[0].state_dict()  # ...which training moved away from the warm start
    assert any(not torch.equal(start[k], ckpt[k]) for k in ckpt)
    _, _, task, _ = build(cfg)
    assert pool == [p.question for p in task.problems("train", cfg.train_problems, seed=cfg.seed)]
    assert held == [p.question for p in task.problems("test", cfg.eval_problems, seed=cfg.seed + 1)]
    # the sampler is the run's MXFP4 copy of those weights: quantised, so not equal to them
    w = "model.layers.0.mlp.down_proj.weight"
    q = dict(rollout.named_buffers())[w].cpu()  # the fake-quantised copy keeps its linear weights as buffers
    assert rollout is not trained and torch.equal(q, quantize_mxfp4(ckpt[w])) and not torch.equal(q, ckpt[w])
    assert not torch.equal(q, quantize_mxfp4(start[w]))  # the checkpoint's rounding, not the warm start's


def test_cached_until_the_weights_or_settings_change(tmp_path, monkeypatch):
    cfg = _run(tmp_path, "none", monkeypatch)
    with monkeypatch.context() as m:  # a reward that tells completions apart (the tiny model earns none of its own)
        m.setattr("aisrl.tasks.Arithmetic.reward", lambda self, text, p: (float(len(text) % 2), len(text) % 2 == 0))
        first = fe.evaluate_final(cfg.output_dir, cfg, samples=1, held_samples=1)
    assert 0 < first["policy_reward"] < 1 and first["policy_accuracy"] == pytest.approx(1 - first["policy_reward"])
    assert first["policy_reward"] == first["sampler_reward"]  # full precision: the sampler is the model
    assert all(0.0 <= first[k] <= 1.0 for k in ("held_reward", "held_accuracy"))
    monkeypatch.setattr(fe, "_rewards", lambda *a, **k: [(1.0, True)])
    assert fe.evaluate_final(cfg.output_dir, cfg, samples=1, held_samples=1) == first  # cached
    assert fe.evaluate_final(cfg.output_dir, cfg, samples=1, held_samples=2)["held_reward"] == 1.0  # held-out count
    assert fe.evaluate_final(cfg.output_dir, cfg, samples=2, held_samples=1)["policy_reward"] == 1.0  # new settings
    monkeypatch.setattr(fe, "_rewards", lambda *a, **k: [(0.5, False)])
    hotter = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, temperature=0.5))
    assert fe.evaluate_final(cfg.output_dir, hotter, samples=2, held_samples=1)["policy_reward"] == 0.5  # new config
    # aggregation reads the scores of the step it pairs at: a run continued past it has another final model
    assert fe.cached_scores(cfg.output_dir, 2)["policy_reward"] == 0.5
    assert fe.cached_scores(cfg.output_dir, 2, step=2)["policy_reward"] == 0.5
    assert fe.cached_scores(cfg.output_dir, 2, step=1) is None and fe.cached_scores(cfg.output_dir, 1) is None
    cache = tmp_path / "none" / "final_eval.json"
    older = json.loads(cache.read_text())
    older["settings"]["scorer"] = fe.SCORER - 1  # made by the scorer before a change that moves scores
    cache.write_text(json.dumps(older))
    assert fe.cached_scores(cfg.output_dir, 2) is None  # not read by aggregation...
    assert fe.evaluate_final(cfg.output_dir, hotter, samples=2, held_samples=1)["settings"]["scorer"] == fe.SCORER
    assert fe.cached_scores(cfg.output_dir, 2)["policy_reward"] == 0.5  # ...and scored again
    monkeypatch.setattr(fe, "_rewards", lambda *a, **k: [(1.0, True)])
    path = latest_checkpoint(cfg.output_dir) / "model.safetensors"
    state = load_file(path)
    save_file({k: v * 0 for k, v in state.items()}, path)  # the run re-trained: same step name, new weights
    assert fe.cached_scores(cfg.output_dir, 2) is None  # the same settings as the cache, other weights: stale
    assert fe.evaluate_final(cfg.output_dir, hotter, samples=2, held_samples=1)["policy_reward"] == 1.0
    assert json.loads(cache.read_text())["policy_reward"] == 1.0
    # a file that parses but holds no settings (a hand edit) is stale, not a crash of the study's aggregation
    cache.write_text(json.dumps({"settings": None, "policy_reward": 0.2}))
    assert fe.cached_scores(cfg.output_dir, 2) is None
    assert fe.evaluate_final(cfg.output_dir, hotter, samples=2, held_samples=1)["policy_reward"] == 1.0


def test_scores_cached_when_the_schedule_was_hashed_are_kept_and_brought_up_to_date(tmp_path, monkeypatch):
    cfg = _run(tmp_path, "none", monkeypatch)
    first = fe.evaluate_final(cfg.output_dir, cfg, samples=1, held_samples=1)
    monkeypatch.setattr(fe, "_rewards", lambda *a, **k: [(1.0, True)])  # a score made now would be 1.0
    later = dataclasses.replace(cfg, checkpoint_every=5, eval_every=3)  # the study re-run with another schedule
    assert fe.evaluate_final(cfg.output_dir, later, samples=1, held_samples=1) == first
    cache = tmp_path / "none" / "final_eval.json"
    older = json.loads(cache.read_text())
    older["settings"]["config_sha256"] = fe._config_hash(cfg, schedule=True)  # as the scorer before SCHEDULE wrote it
    cache.write_text(json.dumps(older))
    assert fe.evaluate_final(cfg.output_dir, cfg, samples=1, held_samples=1)["policy_reward"] == first["policy_reward"]
    assert json.loads(cache.read_text())["settings"] == first["settings"]  # rewritten with today's hash
    older["settings"]["config_sha256"] = fe._config_hash(later, schedule=True)  # an old cache of another schedule:
    cache.write_text(json.dumps(older))  # which config it was made under cannot be told, so it is scored again
    assert fe.evaluate_final(cfg.output_dir, cfg, samples=1, held_samples=1)["policy_reward"] == 1.0


def test_a_run_without_checkpoint_is_an_error(tmp_path):
    cfg = load_config("lab", [*TINY_LAB, f"output_dir={tmp_path}"])
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        fe.evaluate_final(tmp_path, cfg)


def test_every_run_is_scored_on_the_same_draws_in_bounded_chunks():
    from types import SimpleNamespace

    class Recorder:  # a policy that records what it is asked to sample, and completes with the prompt itself
        def __init__(self):
            self.calls = []

        def sample(self, model, prompts, seeds, step, kv_fp8):
            self.calls.append((model, len(prompts), seeds, kv_fp8))
            ids = torch.tensor([[len(p)] for p in prompts])
            return SimpleNamespace(completion_ids=ids, completion_mask=torch.ones_like(ids, dtype=torch.bool))

    class Task:
        def reward(self, text, problem):
            return (float(text == str(len(problem))), text == str(len(problem)))

    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens: str(ids[0]))
    problems = ["a" * (i % 7 + 1) for i in range(150)]  # 150 prompts x 4 samples: chunks of 512 and 88
    out = {}
    for model in ("model", "its quantised copy"):
        rec = Recorder()
        out[model] = fe._rewards(rec, model, Task(), tok, lambda p: list(p), problems, 4, kv_fp8=True)
        assert [c[1] for c in rec.calls] == [512, 88] and all(c[0] == model and c[3] for c in rec.calls)
        seeds = [s for c in rec.calls for s in c[2]]
        assert seeds == [fe.SEED_BASE + i for i in range(600)]  # independent of the run and of the chunking
    assert out["model"] == out["its quantised copy"] == [(1.0, True)] * 600  # each completion scored with its problem


def test_fields_added_later_change_the_config_hash_only_away_from_their_default():
    from aisrl.final_eval import _settings
    from aisrl.train_config import load_config

    def digest(*overrides):
        return _settings("step_000001", "w", load_config("lab", list(overrides)), 4, 8)["config_sha256"]

    def sha(run):
        return hashlib.sha256(json.dumps(run, sort_keys=True, default=str).encode()).hexdigest()[:16]

    base = digest()
    before = load_config("lab")  # the hash a run scored before the fields existed would have had
    run = {k: v for k, v in dataclasses.asdict(before).items() if k != "output_dir"}
    del run["sample_salt"], run["correction"]["veto"], run["correction"]["guard"], run["correction"]["options"]
    del run["task_options"], run["scale_advantages"], run["rollout"]["keep"], run["keep_checkpoints"]
    assert fe._config_hash(load_config("lab"), schedule=True) == sha(run)  # as caches before SCHEDULE hashed it
    del run["max_steps"], run["eval_every"], run["checkpoint_every"]
    assert base == sha(run)
    assert digest("keep_checkpoints=0") == base  # which checkpoints a run keeps changes no score
    for when in ("max_steps=7", "eval_every=3", "checkpoint_every=5"):  # nor when it stops, evaluates, checkpoints
        assert digest(when) == base, when
    assert digest("sample_salt=1") != base and digest("correction.guard=4") != base and digest("lr=1e-3") != base
    assert digest("scale_advantages=false") != base and digest("correction.options={'normalize': True}") != base
    assert digest("rollout.keep=[model.layers.0.*]") != base
    # a task whose problems changed (sudoku4's version 2) enters the settings; version 1 leaves earlier scores valid
    assert "problems_version" not in _settings("step_000001", "w", load_config("lab"), 4, 8)
    assert _settings("step_000001", "w", load_config("diffusion_lab"), 4, 8)["problems_version"] == 2
    # and one whose judging changed (countdown's version 2 takes `expr = target`): its cached scores are redone
    assert "scorer_version" not in _settings("step_000001", "w", load_config("lab"), 4, 8)
    assert _settings("step_000001", "w", load_config("lab", ["lab.task=countdown"]), 4, 8)["scorer_version"] == 2
    # a model of the user's (its chat template may have a thinking mode, closed in prompts since version 2) is
    # scored again once; the lab, SmolLM2 (no thinking mode) and tiny models keep their cached scores
    assert _settings("step_000001", "w", load_config("lab", ["model.name=/models/qwen3"]), 4, 8)["prompts"] == 2
    for name in ("lab", "smollm2", "tiny-qwen3"):
        assert "prompts" not in _settings("step_000001", "w", load_config("lab", [f"model.name={name}"]), 4, 8)


def test_a_nan_reward_leaves_the_mean_and_a_damaged_cache_is_scored_again(tmp_path, monkeypatch):
    cfg = _run(tmp_path, "none", monkeypatch)
    monkeypatch.setattr(fe, "_rewards", lambda *a, **k: [(1.0, True)] * 3 + [(float("nan"), False)])
    res = fe.evaluate_final(cfg.output_dir, cfg, samples=1, held_samples=1)
    assert res["policy_reward"] == 1.0 and res["held_reward"] == 1.0  # a task that could not score one: as training
    assert res["policy_accuracy"] == 0.75  # (before: every reward NaN, which the study then dropped without a word)
    cache = tmp_path / "none" / "final_eval.json"
    cache.write_text(cache.read_text()[:40])  # a copy cut short
    assert fe.cached_scores(cfg.output_dir, 1) is None  # stale, not a JSONDecodeError that stops the aggregation
    assert fe.evaluate_final(cfg.output_dir, cfg, samples=1, held_samples=1)["policy_reward"] == 1.0


FILE_TASK = ["model.name=smollm2"]  # the lab trains on its own task: a file task needs another model


def test_a_local_dataset_enters_the_cached_settings_by_its_contents(tmp_path):
    from aisrl.final_eval import _settings
    from aisrl.train_config import load_config

    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n')

    def settings():
        return _settings("step_000001", "w", load_config("lab", [*FILE_TASK, "task=dataset", f"dataset={data}"]), 4, 8)

    first = settings()
    assert first["dataset_sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    data.write_text('{"question": "1+2", "answer": "3"}\n')  # edited in place: same path, other problems
    again = settings()
    assert again["dataset_sha256"] != first["dataset_sha256"] and again["config_sha256"] == first["config_sha256"]
    saved = tmp_path / "saved"  # a `datasets` directory: its files by name and bytes
    (saved / "sub").mkdir(parents=True)
    (saved / "sub" / "a.arrow").write_bytes(b"xyz")
    from_dir = load_config("lab", [*FILE_TASK, "task=jsonl", f"dataset={saved}"])
    d = _settings("s", "w", from_dir, 4, 8)["dataset_sha256"]
    (saved / "sub" / "a.arrow").write_bytes(b"xyw")
    assert _settings("s", "w", from_dir, 4, 8)["dataset_sha256"] != d
    d = _settings("s", "w", from_dir, 4, 8)["dataset_sha256"]
    (saved / "sub" / "a.arrow").rename(saved / "a.arrow")  # the same bytes at another place in the directory
    assert _settings("s", "w", from_dir, 4, 8)["dataset_sha256"] != d
    assert "dataset_sha256" not in _settings("s", "w", load_config("lab"), 4, 8)  # lab runs' caches stay valid
    gone = load_config("lab", [*FILE_TASK, "task=dataset", f"dataset={tmp_path / 'moved.jsonl'}"])
    assert _settings("s", "w", gone, 4, 8)["dataset_sha256"] == "missing"


def _record_rollouts(monkeypatch) -> list:
    """The rollouts final evaluation scores, in order (trained model, then the run's sampler, then held-out)."""
    import aisrl.build

    drawn, real = [], aisrl.build.task_rewards
    monkeypatch.setattr(aisrl.build, "task_rewards", lambda task, tok, r, p: drawn.append(r) or real(task, tok, r, p))
    return drawn


def _same_completions(a, b) -> float:
    """Fraction of rows where two rollouts drew the same completion."""
    same = [torch.equal(x[m], y[m2]) for x, y, m, m2 in zip(a.completion_ids, b.completion_ids, a.completion_mask,
            b.completion_mask, strict=True)]  # fmt: skip
    return sum(same) / len(same)


def _score_a_static_fp8_run(tmp_path, monkeypatch, device: str):
    """One step of an FP8 static-engine run on `device`, then its final scoring: (config, the rollouts scored in
    order, the result)."""
    cfg = load_config("lab", [*TINY_LAB, "max_steps=1", f"device={device}", "rollout.engine=static",
                              "rollout.quant=fp8_e4m3_w8a8", f"output_dir={tmp_path / device}"])  # fmt: skip
    train(cfg, log=lambda _: None)
    drawn = _record_rollouts(monkeypatch)
    return cfg, drawn, fe.evaluate_final(cfg.output_dir, cfg, samples=4, held_samples=1)


def test_a_static_engine_run_scores_both_sides_through_the_engine_so_equal_seeds_pair(tmp_path, monkeypatch):
    # the static engine draws its own random numbers: an HF-sampled trained model would share no draws with it
    cfg, drawn, res = _score_a_static_fp8_run(tmp_path, monkeypatch, "cpu")
    # FP8 rounding changes a few samples; unpaired draws would change most
    assert _same_completions(drawn[0], drawn[1]) >= 0.75
    assert res["settings"]["trained_sampler"] == "engine_fp32"
    # full precision through the engine: the sampler is still the run's engine (BF16 on a GPU), scored on its own
    full = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, quant="none"),
                               output_dir=str(tmp_path / "static_none"))  # fmt: skip
    train(full, log=lambda _: None)
    drawn.clear()
    fe.evaluate_final(full.output_dir, full, samples=2, held_samples=1)
    assert len(drawn) == 3 and torch.equal(drawn[0].completion_ids, drawn[1].completion_ids)  # FP32 on the CPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_static_engine_run_on_the_gpu_is_scored_through_an_fp32_engine_there(tmp_path, monkeypatch):
    # on a GPU the sampler is real FP8 with BF16 activations and the trained model an FP32 engine on the same
    # device: the two still share their random numbers, so most completions pair
    _, drawn, res = _score_a_static_fp8_run(tmp_path, monkeypatch, "cuda")
    assert res["settings"]["trained_sampler"] == "engine_fp32"
    assert _same_completions(drawn[0], drawn[1]) >= 0.5


def test_a_lora_run_is_scored_with_its_adapters_merged(tmp_path, monkeypatch):
    # the model scored is W + (alpha / r) B A of the checkpoint's adapters, worked out here from its tensors (before:
    # LoRA runs were refused, and a study of them had no final-model scores)
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    cfg = load_config("lab", [*TINY_LAB, "max_steps=2", "eval_every=2", "rollout.quant=mxfp4_w4a4", "lora.r=4",
                              "lora.alpha=8", "lr=0.01", f"output_dir={tmp_path / 'lora'}"])  # fmt: skip
    train(cfg, log=lambda _: None)
    saved = load_file(latest_checkpoint(cfg.output_dir) / "model.safetensors")
    models = []
    monkeypatch.setattr(fe, "_rewards", lambda policy, model, *a, **k: models.append(model) or [(1.0, True)])
    fe.evaluate_final(cfg.output_dir, cfg, samples=1, held_samples=1)
    scored = models[0].state_dict()
    name = "model.layers.0.self_attn.q_proj"
    at = f"base_model.model.{name}"
    delta = (8 / 4) * saved[f"{at}.lora_B.default.weight"] @ saved[f"{at}.lora_A.default.weight"]
    assert delta.abs().max() > 0  # training moved the adapters
    # the model is scored on the GPU where there is one
    torch.testing.assert_close(scored[f"{name}.weight"].cpu(), saved[f"{at}.base_layer.weight"] + delta)
    assert not any("lora" in k for k in scored)  # a plain model: the rollout copy syncs from it as in training


def test_scores_of_a_users_model_made_with_earlier_prompts_are_not_read(tmp_path):
    """Prompts close a chat template's thinking mode since version 2: a user model's cached scores from before are
    stale for aggregation too (cached_scores), not only for evaluate_final's own settings check."""
    import hashlib
    import json

    from aisrl.final_eval import SCORER, cached_scores

    for name in ("/models/qwen3", "lab"):
        run = tmp_path / name.strip("/").replace("/", "_")
        ckpt = run / "checkpoints" / "step_000002"
        ckpt.mkdir(parents=True)
        (ckpt / "model.safetensors").write_bytes(b"w")
        (ckpt / "state.pt").write_bytes(b"s")
        (run / "checkpoints" / "latest").write_text("step_000002")
        (run / "config.json").write_text(json.dumps({"model": {"name": name}}))
        settings = {"checkpoint": "step_000002", "scorer": SCORER, "samples": 4,
                    "weights_sha256": hashlib.sha256(b"w").hexdigest()}  # fmt: skip
        (run / "final_eval.json").write_text(json.dumps({"settings": settings, "policy_reward": 0.5}))
        assert (cached_scores(run, 4) is None) == (name != "lab")  # the lab's prompts never changed
        (run / "final_eval.json").write_text(json.dumps({"settings": {**settings, "prompts": 2}, "policy_reward": 0.5}))
        assert cached_scores(run, 4)["policy_reward"] == 0.5
