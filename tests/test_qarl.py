"""QaRL: rollout-aligned trainer forward (log-probs agree with the rollout copy, gradients reach the master
weights) and the error-token detector (planted loops and log-ratio runs flagged, ordinary text left alone)."""

import copy

import pytest
import torch
from torch import nn

from aisrl.lab import LabConfig, lab_model
from aisrl.qarl import AlignedLinear, align_, alignment, error_tokens, set_alignment
from aisrl.quant import quant_config, quantize_, sync_weights
from aisrl.rollout import SamplingParams, generate, logprobs


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AISRL_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("fmt,keep", [("fp8_e4m3_w8a8", ()), ("mxfp4_w4a4", ()), ("mxfp4_w4a4", ("*.0.self_attn.*",))])
def test_aligned_trainer_logprobs_match_the_rollout_copy(fmt, keep):
    model, tok, _ = lab_model(LabConfig(hidden=64, layers=2, sft_steps=0), verbose=False)
    torch.manual_seed(0)
    for p in model.parameters():  # a non-trivial policy: random weights of a realistic scale
        p.data.normal_(0, 0.2)
    rollout = quantize_(copy.deepcopy(model).eval(), quant_config(fmt, keep=keep))
    prompts = [[tok.bos_token_id] + tok.encode(f"{a}+{b}:") for a, b in [(3, 4), (12, 9), (20, 1), (7, 15)] * 4]
    params = SamplingParams(16)
    r = generate(rollout, prompts, params, seeds=list(range(len(prompts))), pad_id=0, eos_id=tok.eos_token_id)
    plain = logprobs(model.eval(), r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, params)
    align_(model, quant_config(fmt, keep=keep))  # the layers the rollout keeps in full precision stay plain
    assert all(isinstance(m, AlignedLinear) != (".0.self_attn." in n and bool(keep)) for n, m in
               model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head")  # fmt: skip
    aligned = logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, params)
    m = r.completion_mask
    gap_plain = (plain - r.rollout_logp)[m].abs().max().item()
    gap_aligned = (aligned - r.rollout_logp)[m].abs().max().item()
    # measured (max |diff| over tokens): aligned 4.8e-7 for both formats (KV-cache decoding vs one full
    # forward), unaligned 4.9e-2 (FP8 W8A8) and 2.6e-1 (MXFP4 W4A4)
    assert gap_aligned < 1e-4 < gap_plain / 100, (gap_aligned, gap_plain)
    set_alignment(model, False)  # switched off: the full-precision function again
    back = logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, params)
    assert torch.equal(back, plain)


def test_straight_through_gradients_reach_the_master_weights():
    torch.manual_seed(0)
    lin = nn.Linear(64, 4)
    layer = copy.deepcopy(lin)
    align_(nn.Sequential(layer, nn.Linear(4, 4)), quant_config("mxfp4_w4a4"))
    assert isinstance(layer, AlignedLinear) and set(dict(layer.named_parameters())) == {"weight", "bias"}
    x = torch.randn(5, 64, requires_grad=True)
    layer(x).sum().backward()
    # d sum(xq W_q^T) / dW = 1^T xq with the quantised input xq: the STE passes it to W unchanged
    from aisrl.quant import ACT_FORMATS, FakeQuantLinear

    # and to the input (the earlier layers' gradient): d / dx = 1 W_q, the quantised weight, not the master one
    wq = FakeQuantLinear(lin, quant_config("mxfp4_w4a4")).weight
    assert torch.allclose(x.grad, torch.ones(5, 4) @ wq, atol=1e-6)
    assert not torch.allclose(x.grad, torch.ones(5, 4) @ lin.weight.detach(), atol=1e-6)
    x = x.detach()

    xq = ACT_FORMATS["mxfp4"](x)
    assert torch.allclose(layer.weight.grad, xq.sum(0).expand(4, 64), atol=1e-6)
    assert not torch.equal(layer.weight.grad, x.sum(0).expand(4, 64))  # really the quantised input
    # the rollout copy synced from the aligned model holds the same quantised weights the trainer used
    rollout = quantize_(nn.Sequential(copy.deepcopy(lin), nn.Linear(4, 4)), quant_config("mxfp4_w4a4"))
    sync_weights(nn.Sequential(layer, nn.Linear(4, 4)), rollout)
    assert torch.allclose(rollout[0](x), layer(x), atol=1e-6)


def test_alignment_switches_the_layers_for_a_block_and_restores_each_one():
    torch.manual_seed(0)
    model = align_(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 4)), quant_config("mxfp4_w4a4"))
    first, second = model[0], model[1]
    second.aligned = False  # a mixed state, as a caller may have left it
    x = torch.randn(3, 64)
    plain = nn.functional.linear(nn.functional.linear(x, first.weight, first.bias), second.weight, second.bias)
    with alignment(model, False):
        assert torch.equal(model[:2](x), plain)  # both full precision inside
    assert (first.aligned, second.aligned) == (True, False)
    with pytest.raises(RuntimeError, match="an error inside the block"), alignment(model, True):
        assert first.aligned and second.aligned
        raise RuntimeError("an error inside the block")
    assert (first.aligned, second.aligned) == (True, False)  # restored on the way out of an error too


def test_error_tokens_flag_loops_and_ratio_runs_only():
    t = 40
    ordinary = torch.tensor([(7 * i * i + 3 * i) % 23 for i in range(t)])  # no short period
    loop = torch.cat([ordinary[:10], torch.tensor([5, 9, 2] * 10)])  # period-3 loop from position 10
    ids = torch.stack([ordinary, loop, ordinary])
    mask = torch.ones(3, t, dtype=torch.bool)
    mask[2, 30:] = False
    log_ratio = torch.zeros(3, t)
    log_ratio[2, 5:11] = 2.5  # a 6-token run of large rollout/trainer disagreement
    log_ratio[0, 20] = 3.0  # a single spike is not a run
    flags = error_tokens(ids, mask, log_ratio, min_loop=12, min_run=4)
    assert not flags[0].any()
    assert flags[1, 10:].all() and not flags[1, :10].any()
    assert flags[2, 5:11].all() and flags[2].sum() == 6
    # either direction of disagreement, and a run exactly min_run long counts while one token shorter does not
    log_ratio = torch.zeros(3, t)
    log_ratio[0, 5:11] = -2.5  # the rollout far more confident than the trainer
    log_ratio[2, 2:6] = 1.5  # 4 tokens: min_run
    log_ratio[2, 20:23] = -1.5  # 3 tokens
    flags = error_tokens(ids, mask, log_ratio, min_loop=12, min_run=4)
    assert flags[0].nonzero().flatten().tolist() == list(range(5, 11))
    assert flags[2].nonzero().flatten().tolist() == [2, 3, 4, 5]
    # a loop of the longest period counts (period 8 over 40 tokens: all of them); a left padding whose id the first
    # tokens repeat is no loop (12 real zeros repeat 11 times, below min_loop)
    assert error_tokens(torch.arange(8).repeat(5)[None], torch.ones(1, 40, dtype=torch.bool), max_period=8).all()
    padded = torch.arange(22)[None] >= 10
    assert not error_tokens(torch.zeros(1, 22, dtype=torch.long), padded, min_loop=12).any()
    # padding is never flagged, even when it repeats
    pad = torch.zeros(1, t, dtype=torch.long)
    assert not error_tokens(pad, torch.zeros(1, t, dtype=torch.bool)).any()
    # on the device of its inputs (the meta device: no data, shapes and devices only)
    meta = error_tokens(ids.to("meta"), mask.to("meta"), log_ratio.to("meta"), min_loop=12, min_run=4)
    assert meta.device.type == "meta" and meta.shape == (3, t)
    # a per-sequence log-ratio would broadcast over the tokens and flag whole rows: refused, naming the shapes
    with pytest.raises(ValueError, match=r"one shape; got .*'log_ratio': \(3, 1\)"):
        error_tokens(ids, mask, torch.full((3, 1), 2.5))


def test_the_kl_reference_of_an_aligned_run_is_aligned_too(tmp_path, monkeypatch):
    # With kl_coef > 0 the reference is the starting policy as the aligned trainer computes it: before any update the
    # KL to it is 0, not the quantisation gap (a KL term that would pull the 4-bit function towards full precision)
    import json

    from conftest import TINY_LAB, varying_reward

    from aisrl.train_config import load_config
    from aisrl.trainer import train

    monkeypatch.setattr("aisrl.tasks.Arithmetic.reward", varying_reward)
    out = tmp_path / "run"
    cfg = load_config("lab", [*TINY_LAB, "max_steps=1", "rollout.align=true", "rollout.quant=mxfp4_w4a4",
                              "loss=tbpo", "correction.name=none", "kl_coef=0.1", f"output_dir={out}"])  # fmt: skip
    train(cfg, log=lambda _: None)
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert row["k3_kl"] < 1e-12 and row["kl_ref"] == 0.0


def test_settings_that_would_bring_the_mismatch_back_are_refused():
    from aisrl.train_checks import validate
    from aisrl.train_config import load_config

    base = ["rollout.align=true", "loss=tbpo", "correction.name=none"]
    # BF16 autocast of every operation the aligned layers do not cover: the copy computes them in FP32
    with pytest.raises(ValueError, match="use precision=fp32 with rollout.align"):
        validate(load_config("lab", [*base, "rollout.quant=fp8_e4m3_w8a8", "precision=bf16"]))
    # an FP8 KV cache the trainer does not reproduce would be most of what is left
    with pytest.raises(ValueError, match="not the FP8 KV cache of 'fp8_e4m3_w8a8_kv'"):
        validate(load_config("lab", [*base, "rollout.quant=fp8_e4m3_w8a8_kv"]))
    validate(load_config("lab", [*base, "rollout.quant=fp8_e4m3_w8a8"]))


def test_aligning_again_takes_the_new_format():
    model = align_(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4)), quant_config("fp8_e4m3_w8a8"))
    align_(model, quant_config("mxfp4_w4a4"))  # before: the aligned layer kept FP8
    assert model[0].qcfg.format == quant_config("mxfp4_w4a4").format != quant_config("fp8_e4m3_w8a8").format
    with pytest.raises(ValueError, match="keep pattern 'typo\\*' matches none"):
        align_(model, quant_config("nvfp4", keep=("typo*",)))
    assert type(model[0]) is AlignedLinear and model[0].qcfg.format == "mxfp4"  # a refused cfg leaves it as it was


def test_aligning_again_replaces_the_earlier_format_everywhere():
    from aisrl.models import tiny_model

    model = tiny_model("tiny-llama")
    base = copy.deepcopy(model)
    align_(model, quant_config("nvfp4"))
    again = quant_config("fp8_e4m3", keep=("model.layers.0.*",))
    align_(model, again)
    q = model.model.layers[0].self_attn.q_proj
    assert type(q) is nn.Linear and not hasattr(q, "qcfg")  # kept now: plain, not left in nvfp4
    assert model.model.layers[1].self_attn.q_proj.qcfg.format == "fp8_e4m3"
    x = torch.randint(3, 100, (2, 7))
    with torch.no_grad():
        assert torch.equal(model(x).logits, quantize_(base, again)(x).logits)  # the trainer computes as the copy


@pytest.mark.parametrize("fmt", ["fp8_e4m3_block_w8a8", "int8_w8a8", "int4", "mxfp4_w4a4", "nvfp4_w4a4"])
def test_an_aligned_layer_computes_exactly_as_the_rollout_copy_whatever_its_width(fmt):
    # 200 inputs: not a multiple of MXFP4's 32 (nor NVFP4's 16, FP8 blocks' 128): padded blocks, whose unpadded slice
    # was strided, so the matmul summed in another order than the copy's stored weight (1.2e-7 apart for MXFP4)
    from aisrl.quant import FakeQuantLinear

    torch.manual_seed(0)
    lin, x = nn.Linear(200, 64), torch.randn(9, 200) * 3
    rollout = FakeQuantLinear(copy.deepcopy(lin), quant_config(fmt))
    align_(nn.Sequential(lin, nn.Linear(64, 4)), quant_config(fmt))
    with torch.no_grad():
        assert torch.equal(lin(x), rollout(x))


def test_alignment_refuses_what_it_cannot_align():
    import peft

    from aisrl.models import tiny_model

    model = peft.get_peft_model(tiny_model("tiny-llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    # the adapters' B A path would run in full precision beside a layer the copy quantises as W + B A
    with pytest.raises(ValueError, match="without LoRA adapters.*merge_and_unload"):
        align_(model, quant_config("fp8_e4m3_w8a8"))
    assert not any(isinstance(m, AlignedLinear) for m in model.modules())
    plain = tiny_model("tiny-llama")  # switching on layers that were never aligned gave full precision, silently
    with pytest.raises(ValueError, match=r"found no aligned layer: call align_\(model, cfg\)"), alignment(plain, True):
        pass
    with alignment(plain, False):  # off is what an unaligned model computes anyway
        pass
