import copy
import json

import pytest
import torch

from aisrl.cli import main
from aisrl.doctor import DoctorConfig, diagnose, table
from aisrl.models import tiny_model


def test_doctor_orders_formats_by_precision():
    cfg = DoctorConfig(model="tiny-llama", formats=["bf16", "fp8_e4m3_w8a8", "mxfp4"], prompts=6, max_new_tokens=10)
    res = diagnose(cfg, tiny_model("tiny-llama", seed=1), None)
    assert list(res) == cfg.formats
    for r in res.values():
        assert r["tokens"] == 60 and len(r["log_ratios"]) == 60 and 0 < r["ess"] <= 1
    # coarser formats pull the rollout further from the trainer
    assert res["bf16"]["k3_kl"] < res["fp8_e4m3_w8a8"]["k3_kl"] < res["mxfp4"]["k3_kl"]
    assert "| fp8_e4m3_w8a8 | 60 |" in table(res)


def test_cli_writes_json_and_png(tmp_path):
    out = tmp_path / "doc"
    rc = main(["mismatch", "--model", "tiny-qwen2", "--formats", "fp8_e4m3,int4", "--out", str(out),
               "prompts=3", "max_new_tokens=5"])  # fmt: skip
    assert rc == 0
    data = json.loads((out / "mismatch.json").read_text())
    assert set(data["formats"]) == {"fp8_e4m3", "int4"} and data["config"]["prompts"] == 3
    assert (out / "logratio_hist.png").stat().st_size > 1000


def test_unknown_format_fails_before_loading(capsys, tmp_path):
    assert main(["mismatch", "--model", "tiny-llama", "--formats", "fp7", "--out", str(tmp_path / "o")]) == 2
    assert "unknown quantisation preset 'fp7'" in capsys.readouterr().err
    for bad, message in ((["--preset", "labb"], "unknown preset 'labb'"), (["--task", "chess"], "unknown task 'chess'"),
                         (["start=nowhere:3"], "give RUN:STEP"), (["device=gpu"], "device 'gpu' is not a device")):
        assert main(["mismatch", *bad, "--out", str(tmp_path / "o")]) == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before its output folder was made (before: made, then refused)
    with pytest.raises(ValueError, match="unknown task"):
        diagnose(DoctorConfig(model="tiny-llama", task="chess"), tiny_model(), None)
    assert main(["mismatch", "--preset", "lab", "--model", "tiny-llama", "temperature=0.7"]) == 2
    assert "with a preset or start, ['model', 'temperature'] come from the preset ('lab')" in capsys.readouterr().err
    assert main(["mismatch", "--preset", "lab", "--model", "smollm2", "--task", "arithmetic"]) == 2  # the defaults too
    assert "with a preset or start, ['model', 'task'] come from the preset ('lab')" in capsys.readouterr().err
    assert main(["mismatch", "--model", "smollm2", "preset=lab"]) == 2  # a preset given as a key, likewise
    assert "['model'] come from the preset or run (preset=, start=)" in capsys.readouterr().err
    assert main(["mismatch", "--model", "tiny-llama", "device=tpu"]) == 2  # before any model is loaded
    assert "device 'tpu' is not a device name" in capsys.readouterr().err
    for args, message in ((["--formats", ","], "formats is empty"), (["--formats", ""], "formats is empty"),
                          (["prompts=0"], "prompts must be >= 1, got 0"),
                          (["max_new_tokens=0"], "max_new_tokens must be >= 1, got 0"),
                          (["seed=-1"], "seed must be in [0, 1000000000), got -1"),  # training refuses it too
                          (["temperature=0", "--out", str(tmp_path / "t")], "temperature must be > 0"),
                          (["--out", "pyproject.toml/x"], "--out pyproject.toml/x cannot be created")):  # fmt: skip
        assert main(["mismatch", "--model", "tiny-llama", *args]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "t").exists()  # temperature=0 was refused after loading, its output folder made


def test_a_kv_cache_format_is_refused_for_a_diffusion_model_and_byte_prompts_fit_a_small_vocabulary(tmp_path):
    # a diffusion sampler has no cache: the _kv row repeated the cache-less figures as if a cache were measured
    out = tmp_path / "o"
    with pytest.raises(ValueError, match=r"\['fp8_e4m3_w8a8_kv'\] quantise a KV cache, which a diffusion model"):
        main_args = DoctorConfig(preset="diffusion_lab", formats=["fp8_e4m3_w8a8", "fp8_e4m3_w8a8_kv"], prompts=1)
        diagnose(main_args)
    assert main(["mismatch", "--preset", "diffusion_lab", "--formats", "fp8_e4m3_w8a8_kv", "--out", str(out)]) == 2
    assert not out.exists()
    # a model without a tokenizer gets byte prompts: ids up to 202 crashed a 64-token vocabulary in the forward
    small = tiny_model(vocab_size=64)
    res = diagnose(DoctorConfig(formats=["fp8_e4m3_w8a8"], prompts=2, max_new_tokens=2, device="cpu"), small)
    assert res["fp8_e4m3_w8a8"]["tokens"] > 0
    with pytest.raises(ValueError, match="its vocabulary has V=3"):
        diagnose(DoctorConfig(formats=["fp8_e4m3_w8a8"], prompts=1, max_new_tokens=1), tiny_model(vocab_size=3))


@pytest.mark.parametrize("kind", ["causal", "diffusion"])
def test_preset_diagnoses_the_lab_models_as_their_trainer_scores_them(tmp_path, monkeypatch, kind):
    monkeypatch.setenv("AISRL_CACHE", str(tmp_path / "cache"))
    gen = "{max_new_tokens: 40}" if kind == "diffusion" else "{max_new_tokens: 8}"
    (tmp_path / "tiny.yaml").write_text(
        f"model: {{name: lab, kind: {kind}}}\n"
        "lab: {task: sudoku4, hidden: 32, layers: 1, sft_steps: 0}\n"
        f"rollout: {gen}\ndiffusion: {{block_length: 8, steps: 5}}\n"
    )
    import aisrl.trainer
    from aisrl.build import build, make_policy
    from aisrl.policy import CausalPolicy, DiffusionPolicy
    from aisrl.train_config import load_config

    scored, score_at = [], aisrl.trainer._score_at
    monkeypatch.setattr(aisrl.trainer, "_score_at", lambda policy, *a: scored.append(policy) or score_at(policy, *a))
    cfg = DoctorConfig(preset=str(tmp_path / "tiny.yaml"), formats=["fp8_e4m3_w8a8", "mxfp4_w4a4"], prompts=4)
    res = diagnose(cfg)
    for r in res.values():
        assert 0 < r["tokens"] <= 4 * 40 and len(r["log_ratios"]) == r["tokens"]
    assert 0 < res["fp8_e4m3_w8a8"]["k3_kl"] < res["mxfp4_w4a4"]["k3_kl"]
    # scored by the policy the trainer builds for this preset: d1's estimate for the diffusion model
    want = DiffusionPolicy if kind == "diffusion" else CausalPolicy
    assert len(scored) == 2 and all(type(p) is want for p in scored)
    tcfg = load_config(str(tmp_path / "tiny.yaml"))
    model, tok, _, _ = build(tcfg)
    assert scored[0].params == make_policy(tcfg, tok, model).params  # the preset's settings, not the doctor's


def test_preset_scores_at_its_training_precision(tmp_path, monkeypatch):
    """A bf16 preset's trainer scores under bf16 autocast; the doctor did in FP32, and so measured another mismatch."""
    import torch

    import aisrl.trainer

    monkeypatch.setenv("AISRL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "bf16.yaml").write_text("model: {name: lab}\nlab: {hidden: 32, layers: 1, sft_steps: 0}\n"
                                        "rollout: {max_new_tokens: 6}\nprecision: bf16\n")  # fmt: skip
    seen, score_at = [], aisrl.trainer._score_at

    def spy(policy, model, rows, step, precision="fp32"):
        seen.append(precision)
        return score_at(policy, model, rows, step, precision)

    monkeypatch.setattr(aisrl.trainer, "_score_at", spy)
    bf16 = diagnose(DoctorConfig(preset=str(tmp_path / "bf16.yaml"), formats=["fp8_e4m3_w8a8"], prompts=3))
    assert seen == ["bf16"]
    (tmp_path / "fp32.yaml").write_text((tmp_path / "bf16.yaml").read_text().replace("bf16", "fp32"))
    fp32 = diagnose(DoctorConfig(preset=str(tmp_path / "fp32.yaml"), formats=["fp8_e4m3_w8a8"], prompts=3))
    assert seen == ["bf16", "fp32"]
    a, b = torch.tensor(bf16["fp8_e4m3_w8a8"]["log_ratios"]), torch.tensor(fp32["fp8_e4m3_w8a8"]["log_ratios"])
    assert a.shape == b.shape and not torch.equal(a, b)  # same samples, scored at another precision


def test_per_layer_sensitivity_is_the_mismatch_with_each_layer_kept_alone():
    import copy

    import torch

    from aisrl.doctor import keep_hint, layer_sensitivity, sensitivity_table
    from aisrl.policy import CausalPolicy
    from aisrl.quant import FakeQuantLinear, quant_config, quantize_
    from aisrl.rollout import SamplingParams, generate

    model = tiny_model("tiny-llama", seed=1).eval()
    params = SamplingParams(max_new_tokens=8)
    rollout = quantize_(copy.deepcopy(model), quant_config("mxfp4"))
    r = generate(rollout, [[5, 6, 7], [8, 9], [10, 11, 12, 13]], params, seeds=[0, 1, 2], pad_id=0, eos_id=2)
    policy = CausalPolicy(params, 0, 2)
    old = policy.score(model, r, 0)
    before = policy.score(rollout, r, 0)
    rows = layer_sensitivity(policy, model, rollout, r, old)
    names = [n for n, m in rollout.named_modules() if isinstance(m, FakeQuantLinear)]
    assert sorted(x["layer"] for x in rows) == sorted(names)
    assert abs(sum(x["weights"] for x in rows) - 1) < 1e-6
    base = (old - before).abs()[r.completion_mask].mean()
    for x in rows[:3] + rows[-2:]:  # by hand: a fresh copy quantised with that one layer kept
        partial = quantize_(copy.deepcopy(model), quant_config("mxfp4", keep=(x["layer"],)))
        left = (old - policy.score(partial, r, 0)).abs()[r.completion_mask].mean()
        assert abs(left.item() - x["logprob_abs_diff_mean"]) < 1e-6
        assert abs((1 - left / base).item() - x["removed"]) < 1e-5
    assert [x["logprob_abs_diff_mean"] for x in rows] == sorted(x["logprob_abs_diff_mean"] for x in rows)
    assert torch.equal(policy.score(rollout, r, 0), before)  # every quantised layer is back in place
    assert f"| {rows[0]['layer']} |" in sensitivity_table(rows)
    hint = keep_hint(rows)
    assert f'"rollout.keep=[{rows[0]["layer"]},{rows[1]["layer"]}]"' in hint and f'"keep=[{rows[0]["layer"]},' in hint
    # ranked with a layer kept already: the override keeps it too (before: it was dropped from the advice)
    hint = keep_hint(rows, kept=["model.embed"])
    assert f'"rollout.keep=[model.embed,{rows[0]["layer"]},{rows[1]["layer"]}]"' in hint


def test_keep_applies_to_every_format_and_reports_the_kept_share():
    cfg = DoctorConfig(model="tiny-llama", formats=["mxfp4", "int4"], prompts=4, max_new_tokens=6,
                       keep=["model.layers.*.mlp.*"], per_layer=True)  # fmt: skip
    model = tiny_model("tiny-llama", seed=1)
    c = model.config
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads) == (64, 128, 4, 2)
    # by hand, per block: attention q, o 64x64 and k, v 64x32 (2 of 4 heads' width): 12288 weights; MLP 3 x 64x128:
    # 24576. The share counts weights, not layers (3 of 7 would be 0.43)
    kept = 24576 / (12288 + 24576)
    res = diagnose(cfg, model, None)
    for r in res.values():
        assert r["kept_weights"] == pytest.approx(kept) and "kept_weights" in table(res)
        assert r["per_layer"] and not any(".mlp." in x["layer"] for x in r["per_layer"])
    with pytest.raises(ValueError, match="keep must be a list of non-empty module-name patterns"):
        diagnose(DoctorConfig(model="tiny-llama", keep=[""]), tiny_model(), None)


def test_start_examines_a_runs_checkpoint_with_the_runs_settings(tmp_path, monkeypatch):
    import torch
    from conftest import TINY_LAB, varying_reward
    from safetensors.torch import load_file

    from aisrl.build import build
    from aisrl.checkpoint import checkpoint_dir
    from aisrl.doctor import _run_checkpoint, _subject
    from aisrl.train_config import load_config
    from aisrl.trainer import train

    monkeypatch.setenv("AISRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    run = tmp_path / "run"
    train(load_config("lab", [*TINY_LAB, "max_steps=2", "checkpoint_every=2", "eval_every=2", "lr=0.01",
                              f"output_dir={run}"]), log=lambda _: None)  # fmt: skip
    cfg = DoctorConfig(start=f"{run}:2", formats=["mxfp4_w4a4"], prompts=4, per_layer=True)
    model, prompts, _, _ = _subject(cfg, None, None, _run_checkpoint(cfg))
    saved = load_file(checkpoint_dir(run, 2) / "model.safetensors")
    initial = build(load_config(str(run / "config.json")))[0].state_dict()
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())  # the checkpoint's weights
    assert any(not torch.equal(v, initial[k]) for k, v in saved.items())  # which training moved
    assert len(prompts) == 4
    res = diagnose(cfg)["mxfp4_w4a4"]
    assert res["tokens"] > 0 and len(res["per_layer"]) == 7  # 1 block x (q, k, v, o, gate, up, down)
    with pytest.raises(ValueError, match="give RUN:STEP"):
        diagnose(DoctorConfig(start=str(run)))
    with pytest.raises(ValueError, match=r"has no checkpoint at step 1; it holds complete ones at steps \[2\]"):
        diagnose(DoctorConfig(start=f"{run}:1", formats=["mxfp4_w4a4"]))
    with pytest.raises(ValueError, match="records its settings .*; drop preset='lab'"):
        diagnose(DoctorConfig(start=f"{run}:2", preset="lab"))
    with pytest.raises(ValueError, match=r"\['temperature'\] come from the run"):
        diagnose(DoctorConfig(start=f"{run}:2", temperature=0.5))
    # a config.json an older aisrl wrote no longer loads: the preset stands in for it (before: refused either way)
    recorded = (run / "config.json").read_text()
    (run / "config.json").write_text(json.dumps({**json.loads(recorded), "old_removed_key": 1}))
    assert _run_checkpoint(DoctorConfig(start=f"{run}:2", preset="lab"))[0] == "lab"
    with pytest.raises(ValueError, match="does not load .* takes no training keys: .* pass --preset FILE"):
        _run_checkpoint(DoctorConfig(start=f"{run}:2"))
    (run / "config.json").write_text(recorded)
    (run / "config.json").unlink()  # a run from before runs recorded their settings: the way to give them here
    with pytest.raises(ValueError, match="has no config.json .* takes no training keys: .* pass --preset FILE"):
        diagnose(DoctorConfig(start=f"{run}:2", formats=["mxfp4_w4a4"]))


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_device_cuda_moves_a_given_model_and_measures_as_on_the_cpu():
    # device=auto leaves a caller's model where it is; device=cuda takes it to the GPU, where FP32 sampling and scoring
    # round differently but measure the same mismatch
    model = tiny_model("tiny-llama", seed=1)
    cfg = DoctorConfig(model="tiny-llama", formats=["fp8_e4m3_w8a8", "mxfp4"], prompts=6, max_new_tokens=10)
    cpu = diagnose(cfg, model, None)
    assert next(model.parameters()).device.type == "cpu"
    gpu = diagnose(DoctorConfig(**{**cfg.__dict__, "device": "cuda"}), model, None)
    assert next(model.parameters()).device.type == "cuda"
    for f in cfg.formats:
        assert gpu[f]["tokens"] == cpu[f]["tokens"] == 60
        assert 0.5 < gpu[f]["k3_kl"] / cpu[f]["k3_kl"] < 2, (f, gpu[f]["k3_kl"], cpu[f]["k3_kl"])
    assert gpu["fp8_e4m3_w8a8"]["k3_kl"] < gpu["mxfp4"]["k3_kl"]


ROWS = [{"layer": "a", "logprob_abs_diff_mean": 0.1, "removed": 0.5, "weights": 0.25},
        {"layer": "b", "logprob_abs_diff_mean": 0.15, "removed": 0.25, "weights": 0.5},
        {"layer": "c", "logprob_abs_diff_mean": 0.2, "removed": 0.0, "weights": 0.25}]


def test_sensitivity_table_shows_exactly_top_rows():
    from aisrl.doctor import sensitivity_table

    lines = sensitivity_table(ROWS, top=2).strip().split("\n")
    assert lines[2:] == ["| a | 0.1 | 50.0% | 25.0% |", "| b | 0.15 | 25.0% | 50.0% |"]


def test_keep_hint_counts_only_the_rows_there_are():
    from aisrl.doctor import keep_hint

    assert keep_hint(ROWS[:1], top=2).startswith('to keep the top 1: "rollout.keep=[a]"')


def _result(**kept):
    base = dict(tokens=5, k3_kl=0.1, ess=0.9, chi2_token=0.1, logprob_abs_diff_mean=0.1, ratio_frac_above_2=0.0,
                ratio_frac_below_half=0.0, token_prob_mult_error=0.1, sync_seconds=0.01)
    return {f: {**base, "kept_weights": w} for f, w in kept.items()}


def test_table_shows_kept_weights_when_any_format_keeps_some():
    t = table(_result(bf16=0.0, mxfp4=0.5))
    assert "kept_weights" in t.splitlines()[0] and "| mxfp4 | 5 |" in t and t.splitlines()[3].endswith("| 0.5 |")
    assert "kept_weights" not in table(_result(bf16=0.0, mxfp4=0.0))


def test_check_names_the_run_when_both_preset_and_start_are_given():
    from aisrl.doctor import check

    with pytest.raises(ValueError, match=r"\['temperature'\] come from the run \('x:1'\)"):
        check(DoctorConfig(preset="lab", start="x:1", temperature=0.5))


def test_per_layer_weight_shares_are_of_all_quantisable_weights_with_keep():
    # by hand (tiny-llama, 2 blocks): attention 12288 and MLP 24576 weights per block; keeping the MLP leaves the 4
    # attention layers per block ranked, whose shares of all quantisable weights add up to 12288 / 36864 = 1/3
    cfg = DoctorConfig(model="tiny-llama", formats=["mxfp4"], prompts=2, max_new_tokens=3,
                       keep=["model.layers.*.mlp.*"], per_layer=True, device="cpu")
    rows = diagnose(cfg, tiny_model("tiny-llama", seed=1), None)["mxfp4"]["per_layer"]
    assert len(rows) == 8 and sum(x["weights"] for x in rows) == pytest.approx(1 / 3)
    assert sorted(x["weights"] for x in rows) == pytest.approx([2048 / 73728] * 4 + [4096 / 73728] * 4)


def test_doctor_log_ratios_and_seeds_are_as_documented():
    # log_ratios = log pi_trainer - log mu_rollout on the completions sampled with seeds seed * 100003 + i
    from aisrl.doctor import _prompt_ids
    from aisrl.policy import CausalPolicy
    from aisrl.quant import quant_config, quantize_
    from aisrl.rollout import SamplingParams

    model = tiny_model("tiny-llama", seed=1)
    cfg = DoctorConfig(model="tiny-llama", formats=["mxfp4"], prompts=3, max_new_tokens=4, seed=2, device="cpu")
    got = diagnose(cfg, model, None)["mxfp4"]["log_ratios"]
    policy = CausalPolicy(SamplingParams(max_new_tokens=4), 0, 2)
    rollout = quantize_(copy.deepcopy(model), quant_config("mxfp4"))
    prompts = _prompt_ids(cfg, None, model.config.vocab_size)
    r = policy.sample(rollout, prompts, [200006, 200007, 200008], 0)
    with torch.no_grad():
        old = policy.score(model, r, 0)
    want = (old - r.rollout_logp)[r.completion_mask]
    torch.testing.assert_close(torch.tensor(got), want, rtol=0, atol=1e-6)
    assert want.abs().sum() > 0  # the sign is tested


def test_byte_prompts_fold_into_ids_3_to_v_minus_1():
    # without a tokenizer a prompt is BOS (1) then its first 24 bytes folded into ids 3..V-1: for V=35 the fold is
    # min(200, 32) = 32, so "What " -> W=87 -> 3+23, h=104 -> 3+8, a=97 -> 3+1, t=116 -> 3+20, ' '=32 -> 3+0
    from aisrl.doctor import _prompt_ids

    ids = _prompt_ids(DoctorConfig(prompts=4), None, 35)
    assert all(p[:6] == [1, 26, 11, 4, 23, 3] for p in ids)
    assert all(len(p) == 25 and max(p) <= 34 for p in ids)


def test_seed_upper_bound_is_exclusive():
    # 10^9 itself is outside [0, 10^9), as in training
    from aisrl.doctor import check

    assert check(DoctorConfig(model="tiny-llama", seed=999_999_999)) is None
    with pytest.raises(ValueError, match=r"seed must be in \[0, 1000000000\), got 1000000000"):
        check(DoctorConfig(model="tiny-llama", seed=1_000_000_000))
