"""The generation engine: rollout_logp consistency, greedy reference, EOS/padding, seeds, FP8 KV cache."""

import copy

import numpy as np
import pytest
import torch

from aisrl.correction import correct
from aisrl.models import tiny_model
from aisrl.quant import quant_config, quantize_
from aisrl.rollout import (
    SamplingParams,
    _positions,
    eos_list,
    generate,
    inverse_cdf,
    left_pad,
    length_order,
    logprobs,
    process_logits,
)

PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 3, 4, 5, 6, 7, 8, 10, 11]]


@pytest.fixture(scope="module")
def model():
    return tiny_model("tiny-llama", seed=0)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=10),
        SamplingParams(max_new_tokens=10, temperature=0.7, top_k=20),
        SamplingParams(max_new_tokens=10, temperature=1.3, top_p=0.8),
        SamplingParams(max_new_tokens=10, temperature=0.9, top_k=40, top_p=0.9),
    ],
)
def test_rollout_logp_equals_recomputed_logprobs(model, params):
    r = generate(model, PROMPTS, params, seeds=[3, 4, 5])
    lp = logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, params,
                  micro_batch=2, chunk=3)  # fmt: skip
    assert r.completion_mask.any()
    torch.testing.assert_close(lp, r.rollout_logp, atol=1e-5, rtol=0)
    assert (r.rollout_logp[r.completion_mask] <= 0).all() and torch.isfinite(r.rollout_logp).all()
    res = correct("ais", lp, r.rollout_logp, r.completion_mask)  # same model: no mismatch
    assert res.metrics["k3_kl"] < 1e-9 and res.metrics["ess"] > 0.999


def test_sampling_records_no_autograd_graph_and_the_trainers_sampler_has_no_gradients(model):
    # a model whose weights require grad recorded every decode step into rollout_logp's graph (the full-precision
    # sampler copy did: 3x the rollout time and twice the memory on a small model)
    assert any(p.requires_grad for p in model.parameters())
    r = generate(model, PROMPTS, SamplingParams(max_new_tokens=4), seeds=[3, 4, 5])
    assert not r.rollout_logp.requires_grad and r.rollout_logp.grad_fn is None
    from aisrl.build import rollout_model
    from aisrl.train_config import load_config

    cfg = load_config("lab", ["rollout.quant=none"])
    rollout, _ = rollout_model(cfg, model, "cpu", [[1, 2]], lambda p: p)
    assert not any(p.requires_grad for p in rollout.parameters())


def test_process_logits_top_k_top_p_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    lp = process_logits(logits, SamplingParams(top_k=2)).exp()
    torch.testing.assert_close(lp, torch.tensor([[5 / 7, 2 / 7, 0, 0, 0]]))
    lp = process_logits(logits, SamplingParams(top_p=0.8)).exp()  # 0.5 + 0.2 < 0.8 <= 0.85: three kept
    torch.testing.assert_close(lp, torch.tensor([[0.5, 0.2, 0.15, 0, 0]]) / 0.85)
    # the smallest set whose mass reaches top_p: a mass equal to it is enough (0.5 alone reaches 0.5)
    halves = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    assert process_logits(halves, SamplingParams(top_p=0.5)).exp().tolist() == [[1.0, 0.0, 0.0]]
    lp = process_logits(logits, SamplingParams(temperature=0.5)).exp()
    p2 = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]) ** 2
    torch.testing.assert_close(lp, (p2 / p2.sum())[None])


def test_inverse_cdf_picks_the_first_token_whose_cumulative_mass_reaches_u():
    logp = torch.tensor([[0.1, 0.0, 0.3, 0.6]]).log().expand(6, 4)  # token 1 has zero probability
    u = torch.tensor([0.05, 0.09, 0.11, 0.39, 0.41, 0.99])
    assert inverse_cdf(logp, u).tolist() == [0, 0, 2, 2, 3, 3]
    # a u the cumulative mass reaches exactly: that token, not the next (cdf [0.5, 1.0], u 0.5 -> token 0)
    assert inverse_cdf(torch.zeros(1, 2).log_softmax(-1), torch.tensor([0.5])).tolist() == [0]
    g = torch.Generator().manual_seed(0)  # wide rows with masked holes: the count definition, checked by brute force
    logits = torch.randn(64, 5000, generator=g).masked_fill(torch.rand(64, 5000, generator=g) < 0.3, -torch.inf)
    logp, u = logits.log_softmax(-1), torch.rand(64, generator=g)
    cdf = logp.exp().cumsum(-1)
    expect = (cdf < u[:, None] * cdf[:, -1:]).sum(-1)  # the CUDA path's count, on the same FP32 cdf
    tok = inverse_cdf(logp, u)
    assert torch.equal(tok, expect) and torch.isfinite(logp.gather(-1, tok[:, None])).all()
    # u = 0 exactly (torch.rand on a CPU: once in 2^24 draws): the first token of positive probability, not token 0
    # whatever its probability (before: a token of FP32 probability 0, or under top-k the argmax in its place)
    zero = torch.tensor([[-200.0, 0.0, -1.0], [-torch.inf, -1.0, 0.0]]).log_softmax(-1)  # (2, 3)
    assert inverse_cdf(zero, torch.zeros(2)).tolist() == [1, 1]


def test_greedy_equals_reference_argmax_loop(model):
    r = generate(model, PROMPTS, SamplingParams(max_new_tokens=8, greedy=True), eos_id=[])
    for i, p in enumerate(PROMPTS):  # one prompt at a time, no cache, no padding: full recompute
        ids = torch.tensor([p])
        for t in range(8):
            with torch.no_grad():
                nxt = model(ids).logits[0, -1].argmax()
            assert r.completion_ids[i, t] == nxt, (i, t)
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)


def test_eos_stops_a_row_and_pads_the_rest(model):
    free = generate(model, PROMPTS, SamplingParams(max_new_tokens=6, greedy=True), eos_id=[])
    eos = int(free.completion_ids[0, 2])  # make row 0's third greedy token the EOS
    r = generate(model, PROMPTS, SamplingParams(max_new_tokens=6, greedy=True), eos_id=eos, pad_id=0)
    first = [int((row == eos).nonzero()[0]) + 1 if (row == eos).any() else 6 for row in free.completion_ids]
    assert r.completion_mask.sum(1).tolist() == first
    assert r.completion_ids[0, :3].tolist() == free.completion_ids[0, :3].tolist()
    assert (r.completion_ids[~r.completion_mask] == 0).all() and (r.rollout_logp[~r.completion_mask] == 0).all()
    # an id from a tensor or an array is an id; before, a 1-d tensor of two raised, and tensor([0]) read as "none"
    for same in (torch.tensor(eos), np.int64(eos), [np.int64(eos)], torch.tensor([eos, 10**6]), np.array([eos])):
        again = generate(model, PROMPTS, SamplingParams(max_new_tokens=6, greedy=True), eos_id=same, pad_id=0)
        assert torch.equal(again.completion_mask, r.completion_mask)
    assert eos_list(torch.tensor([0])) == [0] and eos_list(None) == [] and eos_list(torch.tensor([], dtype=int)) == []


def test_logprobs_of_an_empty_batch_are_empty(model):
    none = torch.zeros(0, 3, dtype=torch.long)
    lp = logprobs(model, none, none.bool(), none, none.bool(), SamplingParams())  # before: torch.cat of nothing
    assert lp.shape == (0, 3)


def test_seeds_make_requests_reproducible_and_independent(model):
    p = SamplingParams(max_new_tokens=8)
    a = generate(model, PROMPTS, p, seeds=[7, 8, 9])
    b = generate(model, PROMPTS, p, seeds=[7, 8, 9])
    assert torch.equal(a.completion_ids, b.completion_ids)
    alone = generate(model, [PROMPTS[1]], p, seeds=[8])
    n = int(alone.completion_mask.sum())
    assert torch.equal(alone.completion_ids[0, :n], a.completion_ids[1, :n])  # batch-mates don't matter
    c = generate(model, PROMPTS, p, seeds=[70, 80, 90])
    assert not torch.equal(a.completion_ids, c.completion_ids)


def test_logprobs_of_ragged_rows_equal_unpadded_forwards(model):
    """Rows sorted into micro-batches and cut to their width score as each row alone, unpadded, in the caller's
    order; a row without completion tokens scores 0 and the result stays differentiable."""
    g = torch.Generator().manual_seed(0)
    prompts, ends = [[1, 5, 6, 7], [1, 9], [1, 3, 4, 5, 6, 7, 8, 10, 11], [1, 2], [1, 4, 4]], [6, 1, 3, 0, 6]
    ids, pmask = left_pad(prompts, pad_id=0)
    comp = torch.randint(3, 60, (5, 6), generator=g)
    cmask = torch.arange(6)[None] < torch.tensor(ends)[:, None]
    cmask[4, 2] = False  # a hole before the row's last token
    assert length_order(pmask, cmask).tolist() == [3, 1, 2, 4, 0]  # by completion extent, then prompt length
    params = SamplingParams(temperature=0.8)  # no top-k: random tokens would mostly score -inf, equal on both sides
    lp = logprobs(model, ids, pmask, comp, cmask, params, micro_batch=2, chunk=4)
    assert torch.isfinite(lp[cmask]).all()
    for i, (p, n) in enumerate(zip(prompts, ends, strict=True)):
        seq = torch.tensor([p + comp[i, :n].tolist()])
        with torch.no_grad():  # alone and unpadded: a plain forward (a hole is context, only left out of the result)
            logits = model(seq).logits
        expect = process_logits(logits[0, len(p) - 1 : -1], params).gather(-1, comp[i, :n, None]).squeeze(-1)
        torch.testing.assert_close(lp[i, :n], torch.where(cmask[i, :n], expect, 0.0), atol=1e-5, rtol=0)
        assert (lp[i, n:] == 0).all()
    empty = logprobs(model, ids, pmask, comp, torch.zeros_like(cmask), micro_batch=2)
    assert (empty == 0).all() and empty.requires_grad


def test_training_logprobs_keep_no_vocabulary_wide_tensor_for_backward_and_give_the_plain_gradient():
    """The trainer differentiates logprobs: chunking the head bounds its memory only if backward does not hold
    every chunk's (b, c, V) log-softmax (and top-p's sort) until the end; the gradient is that of one plain pass."""
    model = tiny_model("tiny-llama", seed=0, vocab_size=500)
    g = torch.Generator().manual_seed(1)
    ids, pmask = left_pad([[1, 5, 6, 7], [1, 9]], pad_id=0)
    comp, cmask = torch.randint(3, 500, (2, 12), generator=g), torch.ones(2, 12, dtype=torch.bool)
    params = SamplingParams(temperature=0.7, top_p=0.9)
    widths = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: widths.append(t.shape[-1:]) or t, lambda t: t):
        lp = logprobs(model, ids, pmask, comp, cmask, params, micro_batch=2, chunk=4)
    assert widths and (500,) not in widths
    lp.sum().backward()
    chunked = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    mask = torch.cat([pmask, cmask], 1)
    logits = model(torch.cat([ids, comp], 1), attention_mask=mask.long(), position_ids=_positions(mask)).logits
    process_logits(logits[:, 3:-1], params).gather(-1, comp[..., None]).sum().backward()  # whole (B, T, V) at once
    for a, b in zip(chunked, [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_left_padding_and_errors(model):
    ids, mask = left_pad([[5], [6, 7, 8]], pad_id=0)
    assert ids.tolist() == [[0, 0, 5], [6, 7, 8]] and mask.tolist() == [[False, False, True], [True] * 3]
    with pytest.raises(ValueError, match="at least one token"):
        left_pad([[]], 0)
    with pytest.raises(ValueError, match="one seed per prompt"):
        generate(model, PROMPTS, seeds=[1])
    with pytest.raises(ValueError, match="need the tokenizer"):
        generate(model, PROMPTS, SamplingParams(stop=["</answer>"]))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0)
    # the scorer reads each completion from its prompt's last column: right-padded prompts were scored from padding
    r = generate(model, [[5], [6, 7, 8]], SamplingParams(max_new_tokens=3), seeds=[1, 2])
    right_ids = torch.tensor([[5, 0, 0], [6, 7, 8]])
    right_mask = torch.tensor([[True, False, False], [True] * 3])
    with pytest.raises(ValueError, match=r"needs left-padded prompts of one or more tokens \(prompt_mask\[:, -1\]"):
        logprobs(model, right_ids, right_mask, r.completion_ids, r.completion_mask)


def test_quantised_rollout_and_fp8_kv_cache_show_mismatch(model):
    p = SamplingParams(max_new_tokens=12)
    for kv in (False, True):
        rollout = quantize_(copy.deepcopy(model), quant_config("fp8_e4m3_w8a8"))
        r = generate(rollout, PROMPTS, p, seeds=[1, 2, 3], kv_cache_fp8=kv)
        old = logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, p)
        m = correct("none", old, r.rollout_logp, r.completion_mask).metrics
        assert 0 < m["logprob_abs_diff_mean"] < 0.2 and torch.isfinite(m["k3_kl"])


def test_request_seeds_differ_where_cpu_generators_look():
    from aisrl.rollout import request_seeds

    g = lambda s: torch.rand(3, generator=torch.Generator().manual_seed(s))  # noqa: E731
    assert torch.equal(g(5), g(5 + 2**32))  # why: a CPU generator keeps the low 32 bits of its seed only
    a, b, c = request_seeds((42, 0, 1, 0), 64), request_seeds((42, 7, 1, 0), 64), request_seeds((12345, 0, 1, 0), 64)
    assert a == request_seeds((42, 0, 1, 0), 64) and all(0 <= s < 2**32 for s in a + b + c)  # reproducible
    assert len({s for s in a + b + c}) == 192  # no step, seed or row draws like another
    assert not torch.equal(g(a[0]), g(b[0]))


def test_a_kv_preset_samples_with_an_fp8_cache_by_default(model):
    p = SamplingParams(max_new_tokens=12)
    kv = quantize_(copy.deepcopy(model), quant_config("fp8_e4m3_w8a8_kv"))
    plain = quantize_(copy.deepcopy(model), quant_config("fp8_e4m3_w8a8"))
    default, fp8, full = (generate(kv, PROMPTS, p, seeds=[1, 2, 3], kv_cache_fp8=k) for k in (None, True, False))
    assert torch.equal(default.rollout_logp, fp8.rollout_logp) and not torch.equal(fp8.rollout_logp, full.rollout_logp)
    assert torch.equal(generate(plain, PROMPTS, p, seeds=[1, 2, 3]).rollout_logp, full.rollout_logp)
    from aisrl.policy import CausalPolicy  # the trainer's sampler follows the model the same way unless told

    policy = CausalPolicy(p, pad_id=0, eos_id=[])
    assert torch.equal(policy.sample(kv, PROMPTS, [1, 2, 3], step=0).rollout_logp, fp8.rollout_logp)
    assert torch.equal(policy.sample(kv, PROMPTS, [1, 2, 3], step=0, kv_fp8=False).rollout_logp, full.rollout_logp)


def _finishing_model(family: str):
    """A tiny causal LM of a family whose forward changes the output head's logits (a scale or a soft cap)."""
    transformers = pytest.importorskip("transformers")
    shape = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 1, "pad_token_id": 0, "eos_token_id": 2}  # fmt: skip
    torch.manual_seed(0)
    if family == "granite":
        model = transformers.GraniteForCausalLM(transformers.GraniteConfig(**shape, logits_scaling=8.0))
    elif family == "cohere":
        model = transformers.CohereForCausalLM(transformers.CohereConfig(**shape, logit_scale=0.25))
    else:
        cfg = transformers.Gemma2Config(**shape, head_dim=16, final_logit_softcapping=5.0)
        model = transformers.Gemma2ForCausalLM(cfg)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(40)  # logits of tens: the finishing changes the distribution
    return model.eval()


@pytest.mark.parametrize("family", ["granite", "cohere", "gemma2"])
def test_trainer_log_probs_finish_the_logits_as_the_models_forward_does(family):
    # logprobs runs the decoder and the head itself (to chunk the head): without the family's finishing, the
    # trainer's log-probs are of another distribution than the sampler's (0.2 to 25 nats apart on these models)
    model = _finishing_model(family)
    p = SamplingParams(6)
    r = generate(model, [[1, 5, 6, 7], [1, 9]], p, seeds=[1, 2], eos_id=[])
    lp = logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, p)
    torch.testing.assert_close(lp, r.rollout_logp, atol=1e-5, rtol=1e-5)


def test_a_logit_finishing_it_does_not_know_is_an_error():
    model = tiny_model(seed=0)

    class Doubled(type(model)):  # a family whose forward doubles the logits, which logprobs cannot know
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = 2 * out.logits
            return out

    model.__class__ = Doubled
    ids, mask = torch.tensor([[1, 5]]), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="Doubled's forward changes its output head's logits"):
        logprobs(model, ids, mask, ids, mask)


def test_a_gap_in_the_completion_mask_hides_nothing_from_the_tokens_after_it(model):
    """Tokens left out of the loss (a correction's mask, tool output) were still sampled in context: logprobs of
    the tokens after a gap equal those of the unbroken mask (before: the gap was left out of attention)."""
    params = SamplingParams(max_new_tokens=8)
    r = generate(model, PROMPTS, params, seeds=[3, 4, 5], eos_id=[])
    holed = r.completion_mask.clone()
    holed[:, 2] = False
    whole = logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, params)
    gap = logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, holed, params)
    torch.testing.assert_close(gap, torch.where(holed, whole, 0.0), atol=1e-6, rtol=0)


def test_sampling_params_are_checked():
    assert SamplingParams(stop="</answer>").stop == ["</answer>"]  # one string: not its characters
    for bad, message in [({"stop": [""]}, "stop must be a list of non-empty strings"),
                         ({"max_new_tokens": 8.0}, "max_new_tokens must be an integer, got 8.0"),
                         ({"top_k": None}, "top_k must be an integer, got None"),
                         ({"max_new_tokens": True}, "max_new_tokens must be an integer")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            SamplingParams(**bad)
    assert SamplingParams(max_new_tokens=np.int64(4)).max_new_tokens == 4


def test_greedy_evaluation_stops_where_the_rollouts_do():
    from aisrl.models import word_tokenizer
    from aisrl.policy import CausalPolicy

    model = tiny_model("tiny-llama")
    tok = word_tokenizer(model.get_input_embeddings().num_embeddings)
    plain = CausalPolicy(SamplingParams(8), pad_id=0, eos_id=[], tokenizer=tok).greedy(model, [[5, 6, 7]])
    assert plain.completion_mask.sum() == 8
    second = tok.decode(plain.completion_ids[0, 1:2].tolist())  # the second greedy token's text, as a stop string
    stopping = CausalPolicy(SamplingParams(8, stop=[second]), pad_id=0, eos_id=[], tokenizer=tok)
    r = stopping.greedy(model, [[5, 6, 7]])  # before: greedy decoding dropped the stop strings and ran to 8
    assert r.completion_mask.sum() == 2 and torch.equal(r.completion_ids[0, :2], plain.completion_ids[0, :2])


def test_fp8_kv_scales_are_calibrated_on_each_prompts_own_tokens():
    # a padded row samples as it does alone even when its padding's keys dwarf its own: the padding stays out of the
    # per-request scales (with it in, the row's keys were rounded on a ~30x coarser grid)
    from conftest import loud_pad

    model = loud_pad(tiny_model("tiny-llama"))
    p = SamplingParams(max_new_tokens=6)
    batch = generate(model, PROMPTS, p, seeds=[7, 8, 9], pad_id=0, kv_cache_fp8=True)
    alone = generate(model, PROMPTS[:1], p, seeds=[7], pad_id=0, kv_cache_fp8=True)
    assert torch.equal(batch.completion_ids[:1], alone.completion_ids)
    torch.testing.assert_close(batch.rollout_logp[:1], alone.rollout_logp, atol=1e-5, rtol=0)


def test_a_stop_string_is_found_across_tokens_that_decode_to_nothing():
    # a byte-level tokenizer may spell one character over several tokens, some decoding to nothing alone: the stop
    # check decodes a row's last 8 + len(stop) tokens, so `</answer>` (9 characters) is found over 15 tokens
    from aisrl.rollout import _hit_stop

    class Chars:  # one character per id; id 0 decodes to nothing
        def decode(self, ids):
            return "".join(chr(i) if i else "" for i in ids)

    def ids(text):
        return [ord(c) for c in text]

    spread = ids("so </ans") + [0] * 6 + ids("wer> then")  # the stop ends at token 18
    plain = ids("</answer>") + [0] * (len(spread) - 9)
    out = torch.tensor([spread, plain])
    hits = [_hit_stop(Chars(), out, torch.tensor([n, m]), ["</answer>"]).tolist() for n, m in ((17, 8), (18, 9))]
    assert hits == [[False, False], [True, True]]  # one character short, then whole; nothing past a row's length
    assert _hit_stop(Chars(), out, torch.tensor([23, 9]), ["xyz", "then"]).tolist() == [True, False]
