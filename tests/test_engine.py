"""The static-cache engine: exact against Hugging Face and the fake-quant layers on the CPU; GPU paths (real FP8
GEMMs, the Triton decode kernel, CUDA graphs) checked against the CPU when a GPU is present."""

import copy
import dataclasses

import pytest
import torch

from aisrl.engine import Engine
from aisrl.engine_ops import _ONEDNN, Linear, counter_uniform
from aisrl.kernels import decode_attention, decode_attention_ref, kernel_supports, triton_available
from aisrl.lora import merged_state
from aisrl.models import tiny_model
from aisrl.quant import FakeQuantLinear, QuantConfig, quant_config, quantize_
from aisrl.rollout import SamplingParams, generate, logprobs

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18]]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _recompute(model, r, params):
    return logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, params)


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=None, pad_token_id=0,
                        eos_token_id=2)  # fmt: skip
    return MistralForCausalLM(cfg).eval()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen2-tied", "tiny-qwen3", "mistral"])
def test_full_precision_matches_hugging_face(name):
    if name == "mistral":
        model = _mistral()
    else:
        model = tiny_model(name.removesuffix("-tied"), tie_word_embeddings=name.endswith("-tied"))
    eng = Engine(model, "none", max_len=64)  # as the trainer names full precision
    params = SamplingParams(20, temperature=0.9, top_k=50, top_p=0.95)
    r = eng.generate(PROMPTS, params, seeds=[1, 2, 3], eos_id=2)
    assert r.completion_ids.shape[0] == 3 and r.completion_mask.any(-1).all()
    # rollout_logp is the processed distribution's log-prob, as the trainer recomputes it
    torch.testing.assert_close(r.rollout_logp, _recompute(model, r, params), atol=1e-5, rtol=0)
    greedy = SamplingParams(15, greedy=True)
    ours = eng.generate(PROMPTS, greedy, eos_id=[])
    theirs = generate(model, PROMPTS, greedy, eos_id=[])
    assert torch.equal(ours.completion_ids, theirs.completion_ids)


@pytest.mark.parametrize("quant", [None, "fp8_e4m3_w8a8_kv"])
def test_sampling_is_per_request_and_deterministic(quant):
    eng = Engine(tiny_model("tiny-qwen3"), quant, max_len=64)
    params = SamplingParams(12)
    a = eng.generate(PROMPTS, params, seeds=[7, 8, 9], eos_id=[])
    b = eng.generate(PROMPTS[:2], params, seeds=[7, 8], eos_id=[])  # another batch, narrower padding
    c = eng.generate(PROMPTS, params, seeds=[7, 8, 10], eos_id=[])
    # a request's completion does not depend on its batch or padding (FP8 KV scales are per request)
    torch.testing.assert_close(a.rollout_logp[:2], b.rollout_logp, atol=1e-5, rtol=0)
    assert torch.equal(a.completion_ids[:2], b.completion_ids)
    assert torch.equal(a.completion_ids[:2], c.completion_ids[:2])
    assert not torch.equal(a.completion_ids[2], c.completion_ids[2])
    # the counter-based uniforms: in (0, 1), roughly uniform, a function of (seed, step) only
    for t in (0, 3):  # the first step too, where small seeds once all hashed near 0
        u = counter_uniform(torch.arange(4000), torch.tensor([t]))
        assert u.min() > 0 and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.02
        assert abs(u.var().item() - 1 / 12) < 0.005 and u[:8].min() > 1e-3  # seeds 0-7: none at the edge
    assert torch.equal(counter_uniform(torch.tensor([2**40 + 5]), torch.tensor([3])),
                       counter_uniform(torch.tensor([1, 2**40 + 5]), torch.tensor([3]))[1:])  # fmt: skip
    # every bit of a 64-bit seed counts: seeds 2^32 apart draw other uniforms
    u = counter_uniform(torch.tensor([5, 5 + 2**32]), torch.tensor([0]))
    assert u[0] != u[1]
    # seed 10303117 hashes to the top of the 24-bit range at step 0 (found by search): still below 1
    assert 1 - 2**-23 < counter_uniform(torch.tensor([10303117]), torch.tensor([0])).item() < 1


def test_eos_ends_rows_and_masks_the_rest():
    eng = Engine(tiny_model("tiny-llama"), max_len=64)
    r = eng.generate(PROMPTS, SamplingParams(30), seeds=[1, 2, 3], eos_id=list(range(3, 60)))  # EOS comes fast
    again = eng.generate(PROMPTS, SamplingParams(30), seeds=[1, 2, 3], eos_id=torch.arange(3, 60))  # before: raised
    assert torch.equal(again.completion_mask, r.completion_mask)
    # the engine's state, sized by an earlier call with no EOS, grows for a longer EOS list
    eng.generate([[5, 6]], SamplingParams(2), eos_id=[])
    assert eng.generate([[5, 6]], SamplingParams(2), eos_id=list(range(60, 77))).completion_mask.shape == (1, 2)
    lengths = r.completion_mask.sum(-1)
    for i, n in enumerate(lengths.tolist()):
        assert 3 <= r.completion_ids[i, n - 1].item() < 60  # the EOS is the last kept token
        assert not ((r.completion_ids[i, : n - 1] >= 3) & (r.completion_ids[i, : n - 1] < 60)).any()
        assert (r.completion_ids[i, n:] == 0).all() and (r.rollout_logp[i, n:] == 0).all()


def test_fp8_linear_is_the_fake_quant_layer():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    for preset in ("fp8_e4m3_w8a8", "fp8_e4m3_tensor_w8a8"):
        cfg = quant_config(preset)
        ours = Linear(48, 64, True, cfg.granularity, torch.float32, "cpu")
        ours.load([lin.weight.detach()], [lin.bias.detach()])
        assert ours.w.dtype == torch.float8_e4m3fn and (ours.packed is not None) == _ONEDNN
        for rows in (5, 700):  # decode sizes (prepacked FP32 copies of the FP8 values) and prefill sizes
            x = torch.randn(rows, 64) * 3
            torch.testing.assert_close(ours(x), FakeQuantLinear(lin, cfg)(x), atol=1e-5, rtol=1e-5)
    # a NaN weight under a per-tensor scale: every output NaN, as the fake-quant layer (before: the scale fell back
    # to 1 and the other rows were quantised at it, finite and wrong)
    bad = torch.nn.Linear(64, 48)
    with torch.no_grad():
        bad.weight[0, 0] = float("nan")
    cfg = quant_config("fp8_e4m3_tensor_w8a8")
    ours = Linear(48, 64, True, cfg.granularity, torch.float32, "cpu")
    ours.load([bad.weight.detach()], [bad.bias.detach()])
    x = torch.randn(5, 64)
    assert FakeQuantLinear(bad, cfg)(x).isnan().all() and ours(x).isnan().all()


def test_full_precision_linear_matches_nn_linear_and_reloads():
    torch.manual_seed(0)
    lin, other = torch.nn.Linear(64, 48), torch.nn.Linear(64, 48)
    ours = Linear(48, 64, True, None, torch.float32, "cpu")
    for ref in (lin, other):  # a second load (a weight sync) must replace the prepacked copy too
        ours.load([ref.weight.detach()], [ref.bias.detach()])
        assert (ours.packed is not None) == _ONEDNN  # the fast path is on wherever oneDNN is built in
        for rows in (1, 5, 64, 700):  # decode sizes (oneDNN's prepacked weights where available) and prefill sizes
            x = torch.randn(rows, 64)
            torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen3"])
def test_fp8_engine_matches_fake_quant_model(name):
    model = tiny_model(name)
    fq = quantize_(copy.deepcopy(model), quant_config("fp8_e4m3_w8a8"))
    r = Engine(model, "fp8_e4m3_w8a8", max_len=64).generate(PROMPTS, SamplingParams(20), seeds=[1, 2, 3], eos_id=2)
    torch.testing.assert_close(r.rollout_logp, _recompute(fq, r, SamplingParams(20)), atol=1e-4, rtol=0)
    mismatch = (r.rollout_logp - _recompute(model, r, SamplingParams(20)))[r.completion_mask].abs().mean()
    assert mismatch > 1e-3  # and FP8 differs from the full-precision model far more than from its emulation


def test_kept_layers_run_in_full_precision_like_the_fake_quant_model():
    model, params = tiny_model("tiny-qwen2"), SamplingParams(20)
    keep = ("model.layers.0.self_attn.*", "*.1.mlp.down_proj")  # fused QKV kept whole, one layer's o and down
    qc = quant_config("fp8_e4m3_w8a8", keep=keep)
    engine = Engine(model, qc, max_len=64)
    assert engine.layers[0]["qkv"].fp8 is None and engine.layers[0]["o"].fp8 is None
    assert engine.layers[1]["down"].fp8 is None and engine.layers[1]["qkv"].fp8 == "channel"
    r = engine.generate(PROMPTS, params, seeds=[1, 2, 3], eos_id=2)
    fq = quantize_(copy.deepcopy(model), qc)
    torch.testing.assert_close(r.rollout_logp, _recompute(fq, r, params), atol=1e-4, rtol=0)
    every = quantize_(copy.deepcopy(model), quant_config("fp8_e4m3_w8a8"))
    assert (r.rollout_logp - _recompute(every, r, params))[r.completion_mask].abs().max() > 1e-4  # keep mattered
    with pytest.raises(ValueError, match=r"fuses \['model.layers.0.self_attn.q_proj', .*keep all of them or none"):
        Engine(model, quant_config("fp8_e4m3_w8a8", keep=("*.0.self_attn.q_proj",)), max_len=64)
    with pytest.raises(ValueError, match=r"keep pattern 'layers.0.\*' matches none of this model's linear layers"):
        Engine(model, quant_config("fp8_e4m3_w8a8", keep=("layers.0.*",)), max_len=64)  # names start with model.


def test_a_kept_head_stays_in_full_precision_like_the_fake_quant_model():
    model, params = tiny_model("tiny-qwen2"), SamplingParams(12)
    qc = QuantConfig("fp8_e4m3", activations=True, lm_head=True, keep=("lm_head",))  # before: "matches none"
    engine = Engine(model, qc, max_len=64)
    assert engine.head.fp8 is None and engine.layers[0]["qkv"].fp8 == "channel"
    r = engine.generate(PROMPTS, params, seeds=[1, 2, 3], eos_id=2)
    torch.testing.assert_close(r.rollout_logp, _recompute(quantize_(copy.deepcopy(model), qc), r, params), atol=1e-4,
                               rtol=0)  # fmt: skip
    assert Engine(model, dataclasses.replace(qc, keep=()), max_len=64).head.fp8 == "channel"


def test_an_fp8_engine_computes_in_the_dtype_asked_for():
    # before: the FP8 GEMMs returned FP32 into a BF16 engine (BF16 into an FP32 one on a GPU), and the next
    # full-precision matmul refused the mix
    model = tiny_model("tiny-qwen3")
    ref = Engine(model, "fp8_e4m3_w8a8", max_len=32).next_logits(PROMPTS)
    bf16 = Engine(model, "fp8_e4m3_w8a8", max_len=32, dtype=torch.bfloat16)
    r = bf16.generate(PROMPTS, SamplingParams(4), seeds=[1, 2, 3], eos_id=[])
    assert r.completion_mask.all() and torch.isfinite(r.rollout_logp).all()
    assert ((bf16.next_logits(PROMPTS) - ref).norm() / ref.norm()).item() < 0.05  # BF16 rounding only


def test_fp8_kv_cache_stores_bytes_and_stays_close():
    model = tiny_model("tiny-qwen3")
    eng = Engine(model, "fp8_e4m3_w8a8_kv", max_len=64)
    r = eng.generate(PROMPTS, SamplingParams(16), seeds=[1, 2, 3], eos_id=[])
    assert eng._st.k[0].dtype == torch.float8_e4m3fn and (eng._st.ks > 0).all() and not (eng._st.ks == 1).all()
    fq = quantize_(copy.deepcopy(model), quant_config("fp8_e4m3_w8a8"))
    err = (r.rollout_logp - _recompute(fq, r, SamplingParams(16)))[r.completion_mask].abs()
    assert 0 < err.mean() < 0.05  # FP8 keys/values change the numbers a little, not the distribution


def test_sync_tracks_trainer_updates_and_bad_inputs():
    model = tiny_model("tiny-llama")
    eng = Engine(model, "fp8_e4m3_w8a8", max_len=32)
    before = eng.next_logits(PROMPTS)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    eng.sync(model)
    after = eng.next_logits(PROMPTS)
    fresh = Engine(model, "fp8_e4m3_w8a8", max_len=32).next_logits(PROMPTS)
    assert not torch.allclose(before, after) and torch.equal(after, fresh)
    with pytest.raises(ValueError, match="FP8 E4M3 W8A8"):
        Engine(model, "int4")
    with pytest.raises(ValueError, match="exceeds the engine's max_len=32"):
        eng.generate(PROMPTS, SamplingParams(30))
    with pytest.raises(ValueError, match="EOS tokens only"):
        eng.generate(PROMPTS, SamplingParams(4, stop=["x"]))
    with pytest.raises(ValueError, match="no tensor"):
        eng.sync({})
    with pytest.raises(ValueError, match="prompt width 40 exceeds the engine's max_len=32"):  # before: IndexError
        eng.next_logits([list(range(3, 43))])
    # an untied model's head is its own: without it a sync is refused, not served the embedding (as before)
    with pytest.raises(ValueError, match="no tensor 'lm_head.weight'"):
        eng.sync({k: v for k, v in merged_state(model).items() if k != "lm_head.weight"})
    tied = tiny_model("tiny-qwen2", tie_word_embeddings=True)
    tied_eng = Engine(tied, max_len=32)
    tied_eng.sync({k: v for k, v in merged_state(tied).items() if k != "lm_head.weight"})  # the embedding it is
    torch.testing.assert_close(tied_eng.next_logits(PROMPTS), Engine(tied, max_len=32).next_logits(PROMPTS))
    with pytest.raises(ValueError, match="without biases"):
        Engine(tiny_model("tiny-llama", mlp_bias=True))
    with pytest.raises(ValueError, match="sliding-window attention"):
        model = _mistral()
        model.config.sliding_window = 16
        Engine(model, max_len=32)
    # dynamic NTK scales the rotary frequencies by the current length; a table built once for max_len would not
    dynamic = tiny_model("tiny-llama", max_position_embeddings=32, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="'dynamic' RoPE scaling changes with the sequence length"):
        Engine(dynamic, max_len=64)
    linear = tiny_model("tiny-llama", max_position_embeddings=32, rope_scaling={"rope_type": "linear", "factor": 2.0})
    Engine(linear, max_len=64)  # a fixed rescaling is the same at every length: run


def test_state_is_reused_safely_across_calls():
    model = tiny_model("tiny-qwen3")
    eng = Engine(model, "fp8_e4m3_w8a8_kv", max_len=24)
    full = eng.generate(PROMPTS, SamplingParams(17), seeds=[1, 2, 3], eos_id=[])  # 7 + 17: the cache is full
    eng._warm_up(eng._st, SamplingParams(4, greedy=True))  # what CUDA-graph capture runs first: must stay in bounds
    narrow = eng.generate(PROMPTS[:2], SamplingParams(5, greedy=True), eos_id=[])  # other batch, width, settings
    wide = eng.generate(PROMPTS, SamplingParams(17), seeds=[1, 2, 3], eos_id=[])
    fresh = Engine(model, "fp8_e4m3_w8a8_kv", max_len=24)
    assert torch.equal(wide.completion_ids, full.completion_ids) and torch.equal(wide.rollout_logp, full.rollout_logp)
    again = fresh.generate(PROMPTS[:2], SamplingParams(5, greedy=True), eos_id=[])
    assert torch.equal(narrow.completion_ids, again.completion_ids)
    # EOS comes from the model's config: made the token row 0 draws first, that row ends there and the others run on
    first = int(full.completion_ids[0, 0])
    model.config.eos_token_id = first
    stops = Engine(model, "fp8_e4m3_w8a8_kv", max_len=24).generate(PROMPTS, SamplingParams(17), seeds=[1, 2, 3])
    assert stops.completion_mask.sum(1).tolist()[0] == 1 and stops.completion_ids[0, 0] == first
    others = [i for i in (1, 2) if first not in full.completion_ids[i].tolist()]  # rows that never draw it
    assert others and all(stops.completion_mask[i].sum() == 17 for i in others)


def test_reference_attention_is_plain_softmax_attention():
    assert kernel_supports(128) and kernel_supports(16) and not kernel_supports(8) and not kernel_supports(96)
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    ks, vs = torch.tensor([[0.5, 2.0], [1.0, 3.0]]), torch.tensor([[1.5, 0.25], [0.5, 1.0]])  # (B, Hk)
    start, end = torch.tensor([1, 0]), torch.tensor([7, 10])
    out = decode_attention_ref(q, k, v, ks, vs, start, end, 10, 0.3)
    for b in range(2):
        for h in range(4):
            kv = h // 2  # grouped-query: heads 0,1 read kv head 0
            keys, vals = k[b, kv, start[b] : end[b]] * ks[b, kv], v[b, kv, start[b] : end[b]] * vs[b, kv]
            expect = ((keys @ q[b, h]) * 0.3).softmax(0) @ vals
            torch.testing.assert_close(out[b, h], expect)
    # heads that no kv head serves whole: named on either path (before: a view's shape error, or on the kernel path
    # heads left uninitialised)
    for use_kernel in (False, None):
        with pytest.raises(ValueError, match=r"H a multiple of Hk .* got q \(2, 3, 8\), cache \(2, 2, 10, 8\)"):
            decode_attention(q[:, :3], k, v, ks, vs, start, end, 10, 0.3, use_kernel=use_kernel)
    # an empty span attends to nothing: 0
    empty = decode_attention(q, k, v, ks, vs, torch.tensor([4, 0]), torch.tensor([4, 0]), 10, 0.3, use_kernel=False)
    assert torch.equal(empty, torch.zeros_like(q))


@cuda
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_cuda_decode_kernel_matches_reference(kv_dtype):
    torch.manual_seed(0)
    B, H, Hk, S, D = 5, 32, 8, 300, 128
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
    k = (torch.randn(B, Hk, S, D, device="cuda") * 3).to(kv_dtype)
    v = torch.randn(B, Hk, S, D, device="cuda").to(kv_dtype)
    ks, vs = torch.rand(B, Hk, device="cuda") + 0.5, torch.rand(B, Hk, device="cuda") + 0.5
    start = torch.tensor([0, 3, 100, 0, 250], device="cuda", dtype=torch.int32)
    end = torch.tensor([1, 200, 101, 300, 290], device="cuda", dtype=torch.int32)
    ref = decode_attention_ref(q, k, v, ks, vs, start, end, S, D**-0.5).float()
    out = decode_attention(q, k, v, ks, vs, start, end, S, D**-0.5, use_kernel=True).float()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2
    # an empty span gives 0 on both paths (before: the kernel divided 0 by 0)
    start[2], end[2] = 100, 100
    ref = decode_attention_ref(q, k, v, ks, vs, start, end, S, D**-0.5).float()
    out = decode_attention(q, k, v, ks, vs, start, end, S, D**-0.5, use_kernel=True).float()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2 and out[2].abs().max() == 0 and ref[2].abs().max() == 0


@cuda
def test_cuda_decode_attention_leaves_fp32_queries_to_the_reference_by_default():
    # the kernel computes in BF16: an FP32 caller that names no path gets the FP32 reference
    torch.manual_seed(0)
    B, H, Hk, S, D = 2, 4, 2, 40, 64
    q, k, v = torch.randn(B, H, D, device="cuda"), *(torch.randn(B, Hk, S, D, device="cuda") for _ in range(2))
    ks = vs = torch.rand(B, Hk, device="cuda") + 0.5
    start = torch.zeros(B, dtype=torch.int32, device="cuda")
    end = torch.full((B,), S, dtype=torch.int32, device="cuda")
    out = decode_attention(q, k, v, ks, vs, start, end, S, D**-0.5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, decode_attention_ref(q, k, v, ks, vs, start, end, S, D**-0.5))


@cuda
@pytest.mark.parametrize("quant", [None, "fp8_e4m3_w8a8", "fp8_e4m3_w8a8_kv"])
def test_cuda_engine_graphs_match_eager_and_cpu(quant):
    model = tiny_model("tiny-qwen3", hidden=128)
    params = SamplingParams(24)
    engine = Engine(model.cuda(), quant, max_len=64)
    graphed = engine.generate(PROMPTS, params, seeds=[1, 2, 3], eos_id=2)
    eager = Engine(model, quant, max_len=64, cuda_graphs=False).generate(PROMPTS, params, seeds=[1, 2, 3], eos_id=2)
    assert torch.equal(graphed.completion_ids, eager.completion_ids)
    engine.generate(PROMPTS, SamplingParams(57, greedy=True), eos_id=[])  # a second graph; leaves the cache full
    engine.generate(PROMPTS, SamplingParams(8, temperature=0.7), eos_id=[])  # a third, captured from that state
    again = engine.generate(PROMPTS, params, seeds=[1, 2, 3], eos_id=2)
    assert torch.equal(again.completion_ids, graphed.completion_ids)
    torch.testing.assert_close(graphed.rollout_logp, eager.rollout_logp)
    # BF16 on the GPU against FP32 on the CPU: the same uniforms, so the first tokens agree unless a uniform falls
    # at a CDF boundary that the rounding moves (then the neighbouring token is drawn)
    cpu = Engine(model.cpu().float(), quant, max_len=64).generate(PROMPTS, params, seeds=[1, 2, 3], eos_id=2)
    first, cpu_first = graphed.completion_ids[:, 0], cpu.completion_ids[:, 0]
    assert (first == cpu_first).sum() >= 2 and ((first - cpu_first).abs() <= 1).all()
    same = first == cpu_first
    assert (graphed.rollout_logp[same, 0] - cpu.rollout_logp[same, 0]).abs().max() < 0.1


@cuda
def test_cuda_fp8_gemm_matches_fake_quant():
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 384, bias=False)
    x = torch.randn(40, 256).bfloat16()  # the engine's activations are BF16 on the GPU
    ref = FakeQuantLinear(lin, quant_config("fp8_e4m3_w8a8"))(x.float())  # FP32 emulation on the CPU
    ours = Linear(384, 256, False, "channel", torch.bfloat16, "cuda")
    ours.load([lin.weight.detach().cuda()], None)
    y = ours(x.cuda()).float().cpu()  # one torch._scaled_mm
    assert ((y - ref).norm() / ref.norm()).item() < 1e-2  # BF16 output rounding


@cuda
def test_cuda_fp32_engine_keeps_fp32_attention_and_matches_the_cpu():
    # the Triton kernel computes in BF16: an FP32 engine (the final evaluation's) must take the FP32 reference
    model = tiny_model("tiny-qwen3", hidden=128)
    assert Engine(copy.deepcopy(model).cuda(), None, max_len=64).use_kernel == triton_available()  # BF16 default
    gpu = Engine(copy.deepcopy(model).cuda(), None, max_len=64, dtype=torch.float32)
    assert gpu.dtype == torch.float32 and not gpu.use_kernel
    params = SamplingParams(24)
    a = gpu.generate(PROMPTS, params, seeds=[1, 2, 3], eos_id=2)
    b = Engine(model, None, max_len=64).generate(PROMPTS, params, seeds=[1, 2, 3], eos_id=2)  # FP32 on the CPU
    # the same uniforms through FP32 on both sides: equal draws, log-probs equal to FP32 rounding
    assert torch.equal(a.completion_ids.cpu(), b.completion_ids)
    torch.testing.assert_close(a.rollout_logp.cpu(), b.rollout_logp, atol=1e-4, rtol=0)


@pytest.mark.parametrize("quant", [None, "fp8_e4m3_w8a8_kv"])
def test_a_nan_an_earlier_batch_left_in_the_cache_does_not_reach_the_next(quant):
    # the CPU decode read one slot past its span, and a masked slot still entered the product with V (0 * NaN)
    bad = tiny_model("tiny-llama")
    with torch.no_grad():
        bad.model.layers[0].mlp.down_proj.weight[3, 5] = float("nan")
    prompts, params = [[5, 6, 7], [8, 9]], SamplingParams(8)
    engine = Engine(bad, quant, max_len=32)
    assert engine.generate(prompts, params, seeds=[1, 2], eos_id=[]).rollout_logp.isnan().any()
    engine.sync(tiny_model("tiny-llama"))  # healthy weights again
    again = engine.generate(prompts, params, seeds=[1, 2], eos_id=[])
    fresh = Engine(tiny_model("tiny-llama"), quant, max_len=32).generate(prompts, params, seeds=[1, 2], eos_id=[])
    assert torch.equal(again.completion_ids, fresh.completion_ids)
    torch.testing.assert_close(again.rollout_logp, fresh.rollout_logp)
    q, k, v = torch.randn(1, 4, 16), torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16)
    k[:, :, 9], v[:, :, 9] = float("nan"), float("nan")  # outside the span [0, 5)
    one = torch.ones(1, 2)
    assert not decode_attention_ref(q, k, v, one, one, torch.tensor([0]), torch.tensor([5]), 10, 0.25).isnan().any()


def test_prompt_ids_outside_the_vocabulary_and_seeds_past_64_bits_are_named():
    engine = Engine(tiny_model("tiny-llama"), None, max_len=32)
    with pytest.raises(ValueError, match=r"prompt token id -3 is outside this model's vocabulary \[0, "):
        engine.generate([[5, -3]], SamplingParams(4, greedy=True))  # before: wrapped to the last row silently
    with pytest.raises(ValueError, match=r"prompt token id -3 is outside"):
        engine.next_logits([[5, -3]])
    with pytest.raises(ValueError, match=r"seeds must fit in 64 signed bits"):
        engine.generate([[5, 6]], SamplingParams(4), seeds=[2**64 - 1])
    # a pad id past the embedding (a tokenizer's added pad token): named (before: IndexError in the forward pass)
    model = tiny_model("tiny-llama")
    vocab = model.get_input_embeddings().num_embeddings
    for pad in (vocab, -1):  # -1: before, the engine wrapped it to the last row without a word
        for run in (engine.generate, lambda p, s, **k: generate(model, p, s, **k)):
            with pytest.raises(ValueError, match=rf"pad_id {pad} is outside this model's vocabulary \[0, {vocab}\)"):
                run([[5, 6], [7]], SamplingParams(4), pad_id=pad)


def test_the_fp8_size_check_reads_only_the_layers_that_run_in_fp8(monkeypatch):
    # the sizes an FP8 GPU must check (multiples of 16): a layer `keep` leaves in full precision may have any size
    import aisrl.engine as engine_mod

    seen = []
    monkeypatch.setattr(engine_mod, "_check_fp8_device", lambda device, dims: seen.append(dims))
    head_kept = QuantConfig("fp8_e4m3", activations=True, lm_head=True, keep=("lm_head",))
    Engine(tiny_model("tiny-qwen2", vocab_size=250), head_kept, max_len=32)
    assert "vocab_size" not in seen[-1] and "intermediate_size" in seen[-1]
    Engine(tiny_model("tiny-qwen2", vocab_size=256), QuantConfig("fp8_e4m3", activations=True, lm_head=True),
           max_len=32)  # fmt: skip
    assert seen[-1]["vocab_size"] == 256
    Engine(tiny_model("tiny-qwen2"), QuantConfig("fp8_e4m3", activations=True, keep=("*mlp*",)), max_len=32)
    assert "intermediate_size" not in seen[-1] and "kv_heads * head_dim" in seen[-1]


def test_fp8_kv_scales_leave_out_the_padding_however_loud():
    # the engine's prefill calibrates each request's KV scales on its own prompt positions: a row padded beside a
    # longer prompt samples as it does alone, though its padding's keys are ~30x its own
    from conftest import loud_pad

    eng = Engine(loud_pad(tiny_model("tiny-llama")), "fp8_e4m3_w8a8_kv", max_len=64)
    params = SamplingParams(6)
    batch = eng.generate(PROMPTS, params, seeds=[7, 8, 9], pad_id=0, eos_id=[])
    alone = eng.generate(PROMPTS[:1], params, seeds=[7], pad_id=0, eos_id=[])
    assert torch.equal(batch.completion_ids[:1], alone.completion_ids)
    torch.testing.assert_close(batch.rollout_logp[:1], alone.rollout_logp, atol=1e-5, rtol=0)


def test_prefill_attention_padding_query_sees_itself():
    # a padding query (not valid, nothing valid before it) would have an all-False mask row, so NaN; it attends to
    # itself only, so its output is its own value, for both query heads sharing the one key head
    from aisrl.engine_ops import prefill_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 3, 2, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)  # H=2, Hk=1 (G=2)
    out = prefill_attention(q, k, v, torch.tensor([[False, True, True]]), 0.5)
    assert out.isfinite().all()
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 0])
    torch.testing.assert_close(out[0, 0, 1], v[0, 0, 0])


def test_compiled_stage_falls_back_only_on_compiler_failures():
    # a shape error inside the stage reaches the caller and leaves the compiled path on; a failure of the compiler
    # (an exception from torch._dynamo) falls back to eager PyTorch with a warning, `failure` naming it
    from aisrl.engine_ops import CompiledStage

    def double(x):
        return 2 * x

    st = CompiledStage(double)

    def shape_error(*a):
        raise RuntimeError("shape mismatch")

    st.compiled = shape_error
    with pytest.raises(RuntimeError, match="shape mismatch"):
        st(torch.ones(2))
    assert st.failure is None

    DynamoError = type("Unsupported", (Exception,), {"__module__": "torch._dynamo.exc"})

    def compiler_failure(*a):
        raise DynamoError("graph break")

    st.compiled = compiler_failure
    with pytest.warns(UserWarning, match="torch.compile failed on double"):
        assert torch.equal(st(torch.ones(2)), torch.full((2,), 2.0))
    assert st.failure == "Unsupported: graph break"
