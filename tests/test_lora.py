"""LoRA: merged weights equal peft's own merge; a LoRA run trains adapters only; the rollout copy follows."""

import copy

import pytest
import torch

pytest.importorskip("peft")

from aisrl.lora import apply_lora, merged_state  # noqa: E402
from aisrl.models import tiny_model  # noqa: E402
from aisrl.quant import quant_config, quantize_, sync_weights  # noqa: E402


def test_merged_state_equals_peft_merge_and_rollout_follows():
    plain = tiny_model(seed=0)
    rollout = quantize_(copy.deepcopy(plain), quant_config("bf16"))
    model = apply_lora(plain, r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)  # B starts at 0: make the delta real
    merged = merged_state(model)
    reference = copy.deepcopy(model).merge_and_unload()
    ref_state = dict(reference.named_parameters())
    assert set(merged) >= set(ref_state)
    for name, t in ref_state.items():
        torch.testing.assert_close(merged[name], t, msg=name)
    sync_weights(merged, rollout)
    ids = torch.tensor([[1, 5, 9, 12]])
    with torch.no_grad():
        torch.testing.assert_close(rollout(ids).logits, reference(ids).logits, atol=0.05, rtol=0.05)  # bf16 copy


def test_lora_training_moves_adapters_only(tmp_path, monkeypatch):
    from conftest import TINY_LAB, varying_reward
    from safetensors.torch import load_file

    from aisrl.checkpoint import latest_checkpoint
    from aisrl.lab import LabConfig, lab_model
    from aisrl.train_config import load_config
    from aisrl.trainer import train

    monkeypatch.setenv("AISRL_CACHE", str(tmp_path / "cache"))
    # an untrained policy never hits the format, so every reward (and advantage) would be 0: give it signal
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    tiny = [*TINY_LAB, "lr=0.01"]
    out = tmp_path / "run"
    train(load_config("lab", [*tiny, "max_steps=2", "lora.r=4", f"output_dir={out}"]), log=lambda _: None)
    state = load_file(latest_checkpoint(out) / "model.safetensors")
    base, _, _ = lab_model(LabConfig(hidden=32, layers=1, sft_steps=0), verbose=False)
    before = dict(base.named_parameters())
    lora_b = [k for k in state if "lora_B" in k]
    assert lora_b and any(state[k].abs().max() > 0 for k in lora_b)  # adapters trained
    for k, v in state.items():
        if "lora_" in k:
            continue
        plain = k.replace("base_model.model.", "", 1).replace(".base_layer", "")
        torch.testing.assert_close(v, before[plain].detach(), msg=plain)  # base weights frozen
    # what `aisrl eval` and `aisrl mismatch start=RUN:STEP` examine: the plain model with the adapters merged in
    from aisrl.build import build, build_trained
    from aisrl.doctor import DoctorConfig, _run_checkpoint, _subject
    from aisrl.lora import is_peft

    cfg = load_config("lab", [*tiny, "max_steps=2", "lora.r=4", f"output_dir={out}"])
    merged = build_trained(cfg, latest_checkpoint(out) / "model.safetensors")[0]
    adapted = apply_lora(build(cfg)[0], cfg.lora.r, cfg.lora.alpha, cfg.lora.targets)
    adapted.load_state_dict(state)
    x = torch.tensor([[1, 5, 6, 7, 8]])
    assert not is_peft(merged)
    torch.testing.assert_close(merged(x).logits, adapted(x).logits, atol=1e-5, rtol=0)
    doctor = DoctorConfig(start=f"{out}:2", formats=["mxfp4_w4a4"], prompts=2)
    assert not is_peft(_subject(doctor, None, None, _run_checkpoint(doctor))[0])  # before: a raw RuntimeError


def test_lora_reference_is_the_base_model_with_adapters_off(tmp_path, monkeypatch):
    import json

    from conftest import TINY_LAB, varying_reward

    from aisrl.train_config import load_config
    from aisrl.trainer import train
    from aisrl.update import _as_reference

    monkeypatch.setenv("AISRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    out = tmp_path / "run"
    cfg = [*TINY_LAB, "lr=0.01", "max_steps=3", "lora.r=4", "kl_coef=0.1", f"output_dir={out}"]
    train(load_config("lab", cfg), log=lambda _: None)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["kl_ref"] == 0  # LoRA's B starts at zero: policy == reference, exactly
    assert rows[2]["kl_ref"] > 0  # the adapters moved the policy away from the adapters-off model
    plain = torch.nn.Sequential(torch.nn.Linear(3, 3))
    peft_model = apply_lora(plain, r=2, alpha=4, targets=["0"])
    peft_model.train()
    for _, m in peft_model.named_modules():
        if hasattr(m, "lora_B"):
            torch.nn.init.normal_(m.lora_B["default"].weight)
    x = torch.randn(2, 3)
    base_layer = peft_model.get_base_model()[0].base_layer  # the frozen nn.Linear under the adapter
    assert not torch.allclose(peft_model(x), base_layer(x))  # adapters on: the policy
    with _as_reference(peft_model):
        torch.testing.assert_close(peft_model(x), base_layer(x))  # adapters off: the reference
    assert peft_model.training  # train mode restored


def test_active_dropout_is_found_where_it_makes_the_ppo_ratio_noisy():
    # The trainer warns when dropout is on: old log-probs are computed without it, so no ratio is 1 on-policy.
    from aisrl.update import active_dropout

    assert active_dropout(tiny_model(seed=0)) == 0.0
    assert active_dropout(apply_lora(tiny_model(seed=0), r=2, alpha=4, targets=["q_proj"])) == 0.0
    assert active_dropout(apply_lora(tiny_model(seed=0), r=2, alpha=4, targets=["q_proj"], dropout=0.1)) == 0.1
    model = tiny_model(seed=0)
    model.config.attention_dropout = 0.05
    assert active_dropout(model) == 0.05


def test_a_target_whose_weight_is_tied_is_refused():
    # SmolLM2 ties lm_head to the embeddings: an adapter on lm_head changes the head but not the embedding, and the
    # rollout copy (whose tied weight is one parameter) would receive only one of the two
    model = tiny_model(seed=0, tie_word_embeddings=True)
    with pytest.raises(ValueError, match=r"adapts 'lm_head', whose weight is tied to \['model.embed_tokens.weight'\]"):
        apply_lora(model, r=2, alpha=4, targets=["q_proj", "lm_head"])
    apply_lora(tiny_model(seed=0, tie_word_embeddings=True), r=2, alpha=4, targets=["q_proj"])  # the default targets
    # a misspelt target is named with the layers there are (before: peft adapted q_proj alone, without a word)
    with pytest.raises(ValueError, match=r"lora.targets \['vproj'\] name no module of this model; its linear layers"):
        apply_lora(tiny_model(seed=0), r=2, alpha=4, targets=["q_proj", "vproj"])
    # GPT-2-style models' projections are transformers' Conv1D, which the list names (before: only lm_head), and a
    # list of optional defaults none of which the model has is refused here too (before: peft's bare error)
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    with pytest.raises(ValueError, match=r"\['c_atn'\] name no module.*\['c_attn', 'c_fc', 'c_proj', 'lm_head'\]"):
        apply_lora(gpt2, r=2, alpha=4, targets=["c_atn"])
    with pytest.raises(ValueError, match=r"\['q_proj', 'v_proj'\] name no module.*'c_attn'"):
        apply_lora(gpt2, r=2, alpha=4, targets=["q_proj", "v_proj"], optional=["q_proj", "v_proj"])
    adapted = apply_lora(tiny_model(seed=0), r=2, alpha=4, targets=["q_proj", "w_gate"], optional=["w_gate"])
    assert any(n.endswith("q_proj.lora_A.default.weight") for n, _ in adapted.named_parameters())
    # the trainer: the default list may name layers a model lacks (the diffusion lab has no gate_proj); a list the
    # user wrote may not, default names included (before: [q_proj, gate_proj] adapted q_proj alone, without a word)
    from aisrl.build import with_lora
    from aisrl.diffusion import tiny_diffusion_model
    from aisrl.train_config import load_config

    no_gate = lambda: tiny_diffusion_model(40, 39, hidden=32, layers=1, max_len=64)  # noqa: E731
    adapted = with_lora(load_config("lab", ["lora.r=2"]), no_gate())
    assert any("up_proj.lora_A" in n for n, _ in adapted.named_parameters())
    with pytest.raises(ValueError, match=r"lora.targets \['gate_proj'\] name no module"):
        with_lora(load_config("lab", ["lora.r=2", "lora.targets=[q_proj,gate_proj]"]), no_gate())
    apply_lora(tiny_model(seed=0), r=2, alpha=4, targets=["lm_head"])  # an untied head may be adapted


def test_merged_weight_is_w_plus_alpha_over_r_b_a():
    base = tiny_model("tiny-llama")
    w0 = base.model.layers[0].self_attn.q_proj.weight.detach().clone()
    model = apply_lora(base, r=4, alpha=16, targets=["q_proj"])
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    with torch.no_grad():
        layer.lora_A["default"].weight.fill_(1.0)  # (r, in)
        layer.lora_B["default"].weight.fill_(1.0)  # (out, r)
    merged = merged_state(model)["model.layers.0.self_attn.q_proj.weight"]
    # (alpha / r) B A = (16 / 4) * 4 (each entry of B A sums r = 4 ones) = 16
    torch.testing.assert_close(merged, w0 + 16.0)
