"""Masked-diffusion LM: block-wise generation follows its schedule, d1 log-probs are deterministic and match a
hand computation on a toy model, identical rollout/trainer models give weights of exactly 1."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from aisrl.correction import correct
from aisrl.diffusion import (
    DiffusionParams,
    diffusion_generate,
    diffusion_logprobs,
    tiny_diffusion_model,
    transfer_schedule,
)
from aisrl.quant import quant_config, quantize_

V, MASK = 24, 23


def test_transfer_schedule_spreads_the_remainder_over_the_first_steps():
    assert transfer_schedule(torch.tensor([8, 7, 2]), 3).tolist() == [[3, 3, 2], [3, 2, 2], [1, 1, 0]]


@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
def test_generation_commits_the_scheduled_tokens_inside_the_current_block_only(remasking):
    model = tiny_diffusion_model(V, MASK, hidden=32, layers=1, max_len=64)
    params = DiffusionParams(gen_length=12, block_length=4, steps=9, temperature=1.0, remasking=remasking)
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    trace = []
    x, attn = diffusion_generate(model, prompts, params, mask_id=MASK, seeds=[0, 1], trace=trace)
    p = 5
    assert len(trace) == 9 and x.shape == (2, p + 12)
    assert attn[1].tolist() == [False] * 3 + [True] * 14 and x[1, 3:5].tolist() == [6, 7]
    for blk, step, commit in trace:
        lo, hi = p + 4 * blk, p + 4 * blk + 4
        assert not commit[:, :lo].any() and not commit[:, hi:].any()  # never outside the current block
        assert commit.sum(-1).tolist() == [[2, 1, 1][step]] * 2  # 4 masked over 3 steps: 2, 1, 1
    assert not (x[:, p:] == MASK).any()  # everything was committed
    # deterministic under the seeds, and the seed of one row does not depend on its batch-mates
    again, _ = diffusion_generate(model, prompts, params, mask_id=MASK, seeds=[0, 1])
    alone, _ = diffusion_generate(model, prompts[:1], params, mask_id=MASK, seeds=[0])
    assert torch.equal(x, again) and torch.equal(alone[0], x[0])


class Ramp(torch.nn.Module):
    """Logits that favour token 5 by 0.5 per position: the later a position, the more confident the model is there."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Parameter(torch.zeros(1))  # where the model sits

    def forward(self, x, attention_mask=None):
        logits = torch.zeros(*x.shape, V)
        logits[..., 5] = 0.5 * torch.arange(x.shape[1], dtype=torch.float32)
        return SimpleNamespace(logits=logits)


def test_low_confidence_remasking_commits_the_most_confident_position_first():
    params = DiffusionParams(gen_length=4, block_length=4, steps=4, temperature=0.0, remasking="low_confidence")
    trace = []
    x, _ = diffusion_generate(Ramp(), [[1, 2]], params, mask_id=MASK, seeds=[0], trace=trace)
    order = [commit[0].nonzero().flatten().tolist() for _, _, commit in trace]  # one position a step
    assert order == [[5], [4], [3], [2]] and x[0, 2:].tolist() == [5] * 4  # the last position first


class PositionFree(torch.nn.Module):
    """Logits of a position that depend only on its token (random weights): padding cannot change them."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(V, V)
        torch.nn.init.normal_(self.table.weight, std=3.0, generator=torch.Generator().manual_seed(0))

    def forward(self, x, attention_mask=None):
        return SimpleNamespace(logits=self.table(x))


def test_a_rows_sample_does_not_depend_on_its_batch_mates_prompt_lengths(monkeypatch):
    params = DiffusionParams(gen_length=8, block_length=4, steps=4, temperature=1.0)
    model = PositionFree()
    batch, _ = diffusion_generate(model, [[1, 2, 3, 4, 5], [6, 7]], params, mask_id=MASK, seeds=[0, 1])
    alone, _ = diffusion_generate(model, [[6, 7]], params, mask_id=MASK, seeds=[1])
    assert torch.equal(batch[1, 5:], alone[0, 2:])  # the short row, padded by 3 in the batch, samples the same
    # the largest uniform the generator gives: the FP32 CDF may end below it, and the draw must still not be [MASK]
    top = 1 - 2**-24
    monkeypatch.setattr(torch, "rand", lambda *shape, generator=None: torch.full(shape, top))
    x, _ = diffusion_generate(model, [[6, 7]] * 4, params, mask_id=MASK, seeds=[0, 1, 2, 3])
    assert not (x[:, 2:] == MASK).any()


class Toy(torch.nn.Module):
    """logits[b, i, v] = 2 [v == x_bi] + 1 [v == 3] [x_bi == MASK] + 0.5 [v == 4] * (#masked prompt tokens of b)."""

    def __init__(self, prompt_len):
        super().__init__()
        self.p = prompt_len

    def forward(self, x, attention_mask=None):
        onehot = torch.nn.functional.one_hot(x, V).float()  # (B, L, V)
        logits = 2 * onehot
        logits[..., 3] += (x == MASK).float()
        logits[..., 4] += 0.5 * (x[:, : self.p] == MASK).sum(-1, keepdim=True).float()
        return SimpleNamespace(logits=logits)


def test_d1_logprobs_match_a_hand_computation_and_are_seeded():
    p, t = 6, 3
    x = torch.tensor([[5, 6, 7, 8, 9, 10, 3, 4, 11], [0, 0, 7, 8, 9, 10, 12, 3, 0]])
    attn = torch.ones_like(x, dtype=torch.bool)
    attn[1, :2] = False  # left padding: never masked
    cmask = torch.tensor([[True, True, True], [True, True, False]])
    got = diffusion_logprobs(Toy(p), x, attn, p, cmask, mask_id=MASK, p_mask=0.5, seed=7)
    # by hand: which prompt tokens the seed masks, then the toy's softmax at each (all-masked) completion slot
    # (the draws run over a row's own prompt tokens, from its first: row 1's 4 tokens take the first 4 draws)
    n_masked = [int((torch.rand(int(n), generator=torch.Generator().manual_seed(7)) < 0.5).sum())
                for n in attn[:, :p].sum(-1)]  # fmt: skip
    for b in range(2):
        row = [0.0] * V
        row[MASK] += 2
        row[3] += 1
        row[4] += 0.5 * n_masked[b]
        log_z = math.log(sum(math.exp(v) for v in row))
        for j in range(t):
            want = row[int(x[b, p + j])] - log_z if cmask[b, j] else 0.0
            assert got[b, j].item() == pytest.approx(want, abs=1e-6)
    assert torch.equal(got, diffusion_logprobs(Toy(p), x, attn, p, cmask, mask_id=MASK, p_mask=0.5, seed=7))
    assert torch.equal(got, diffusion_logprobs(Toy(p), x, attn, p, cmask.long(), mask_id=MASK, p_mask=0.5, seed=7))
    # a 0/1 attention mask, Hugging Face's convention (was a RuntimeError of torch.where)
    assert torch.equal(got, diffusion_logprobs(Toy(p), x, attn.long(), p, cmask, mask_id=MASK, p_mask=0.5, seed=7))
    other = diffusion_logprobs(Toy(p), x, attn, p, cmask, mask_id=MASK, p_mask=0.5, seed=8)
    assert not torch.equal(got, other)  # another seed masks other prompt tokens (the toy counts them)
    one = diffusion_logprobs(Toy(p), x[1:], attn[1:], p, cmask[1:], mask_id=MASK, p_mask=0.5, seed=7)
    assert torch.equal(one, got[1:])  # a micro-batch is scored as inside the whole batch


def test_identical_models_give_weights_of_exactly_one_and_a_quantised_copy_does_not():
    model = tiny_diffusion_model(V, MASK, hidden=32, layers=2, max_len=64)
    params = DiffusionParams(gen_length=8, block_length=4, steps=4)
    x, attn = diffusion_generate(model, [[1, 2, 3], [4, 5, 6]], params, mask_id=MASK, seeds=[3, 4])
    cmask = torch.ones(2, 8, dtype=torch.bool)
    trainer = copy.deepcopy(model)
    old = diffusion_logprobs(trainer, x, attn, 3, cmask, mask_id=MASK, seed=11)
    same = diffusion_logprobs(model, x, attn, 3, cmask, mask_id=MASK, seed=11)
    for name in ("tis", "ais"):
        res = correct(name, old, same, cmask)
        assert torch.equal(res.weights, torch.ones_like(old)), name
    rollout = quantize_(copy.deepcopy(model), quant_config("mxfp4_w4a4"))
    low = diffusion_logprobs(rollout, x, attn, 3, cmask, mask_id=MASK, seed=11)
    res = correct("ais", old, low, cmask)
    assert res.metrics["k3_kl"] > 0 and not torch.equal(res.weights, torch.ones_like(old))


def test_bad_generation_parameters_are_named():
    with pytest.raises(ValueError, match="multiple of block_length"):
        DiffusionParams(gen_length=10, block_length=4)
    with pytest.raises(ValueError, match="multiple of the number of blocks"):
        DiffusionParams(gen_length=8, block_length=4, steps=3)
    with pytest.raises(ValueError, match="block_length=0 must be >= 1"):
        DiffusionParams(gen_length=8, block_length=0)
    with pytest.raises(ValueError, match="block_length=-8 must be >= 1"):
        DiffusionParams(gen_length=8, block_length=-8)
    with pytest.raises(ValueError, match="unknown remasking 'best'"):
        DiffusionParams(remasking="best")
    for bad in (-1.0, float("nan"), float("inf")):  # before: the argmax, and at inf every token id 0
        with pytest.raises(ValueError, match=r"temperature=.* must be >= 0 and finite \(0 = argmax\)"):
            DiffusionParams(temperature=bad)


def test_a_mask_of_ones_means_the_positions_of_no_mask():
    # positions count from each row's first token: with nothing padded they are 0..T-1, as without a mask
    model = tiny_diffusion_model(20, 19, hidden=32, layers=1, max_len=16)
    x = torch.tensor([[3, 4, 5, 19]])
    torch.testing.assert_close(model(x).logits, model(x, attention_mask=torch.ones_like(x, dtype=torch.bool)).logits)


def test_the_tiny_model_and_d1_log_probs_do_not_see_the_padding():
    # positions and prompt-mask draws are counted from each row's first token: a row samples and scores the same
    # alone, beside a longer prompt, or padded wider (another rank's share under torchrun)
    model = tiny_diffusion_model(V, MASK, hidden=32, layers=1)
    params = DiffusionParams(gen_length=8, block_length=8, steps=4, temperature=1.0)
    short, long_ = [1, 2, 3], [4, 5, 6, 7, 8, 9]
    alone, attn = diffusion_generate(model, [short], params, mask_id=MASK, seeds=[7])
    both, _ = diffusion_generate(model, [short, long_], params, mask_id=MASK, seeds=[7, 8])
    assert torch.equal(alone[0, -8:], both[0, -8:])
    done = torch.ones(1, 8, dtype=torch.bool)
    lp = diffusion_logprobs(model, alone, attn, 3, done, mask_id=MASK, p_mask=0.5, seed=3)
    wide = torch.cat([torch.zeros(1, 3, dtype=torch.long), alone], 1)
    wide_attn = torch.cat([torch.zeros(1, 3, dtype=torch.bool), attn], 1)
    lp_wide = diffusion_logprobs(model, wide, wide_attn, 6, done, mask_id=MASK, p_mask=0.5, seed=3)
    torch.testing.assert_close(lp, lp_wide, atol=1e-5, rtol=1e-5)


def test_micro_batched_generation_matches_the_whole_batch_and_bad_input_is_named():
    model = tiny_diffusion_model(V, MASK, hidden=32, layers=1, max_len=64)
    params = DiffusionParams(gen_length=8, block_length=4, steps=4, temperature=1.0, remasking="random")
    prompts, seeds = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]], [3, 1, 4, 1]
    seen, forward = [], model.forward
    model.forward = lambda x, **k: seen.append(x.shape[0]) or forward(x, **k)
    whole, attn = diffusion_generate(model, prompts, params, mask_id=MASK, seeds=seeds)
    assert set(seen) == {4}
    seen.clear()
    parts, attn_parts = diffusion_generate(model, prompts, params, mask_id=MASK, seeds=seeds, micro_batch=3)
    assert torch.equal(whole, parts) and torch.equal(attn, attn_parts)
    assert seen and set(seen) == {3, 1}  # no more than 3 rows' logits at a time
    # and the tokens are picked from each micro-batch's logits as they come (before: every row's block logits were
    # gathered on the host, then soft-maxed there: (B, K, V) several times over)
    import aisrl.diffusion as diffusion

    picked, pick = [], diffusion._pick
    diffusion._pick = lambda logits, *a: picked.append(logits.shape[0]) or pick(logits, *a)
    try:
        again, _ = diffusion_generate(model, prompts, params, mask_id=MASK, seeds=seeds, micro_batch=3)
        assert torch.equal(again, whole)
    finally:
        diffusion._pick = pick
    assert picked and set(picked) == {3, 1}
    with pytest.raises(ValueError, match="need one seed per prompt: 2 seeds for 4 prompts"):
        diffusion_generate(model, prompts, params, mask_id=MASK, seeds=[0, 1])
    with pytest.raises(ValueError, match="one or more prompts, each of one or more tokens"):
        diffusion_generate(model, [], params, mask_id=MASK)
    with pytest.raises(ValueError, match="one or more prompts, each of one or more tokens"):
        diffusion_generate(model, [[1], []], params, mask_id=MASK)
    # the scorer reads each completion from its prompt's last column: right-padded prompts are refused
    done = torch.ones(4, 8, dtype=torch.bool)
    right = torch.cat([attn[:, :5].flip(1), attn[:, 5:]], 1)
    with pytest.raises(ValueError, match="needs left-padded prompts"):
        diffusion_logprobs(model, whole, right, 5, done, mask_id=MASK)


def test_greedy_evaluation_with_random_remasking_does_not_depend_on_a_problems_place():
    from aisrl.policy import DiffusionPolicy

    model = tiny_diffusion_model(V, MASK, hidden=32, layers=1, max_len=64)
    params = DiffusionParams(gen_length=8, block_length=8, steps=8, temperature=1.0, remasking="random")
    policy = DiffusionPolicy(params, MASK, pad_id=0, eos_id=2, micro_batch=2)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    batch = policy.greedy(model, prompts).completion_ids
    for i, p in enumerate(prompts):  # alone, as another rank's share would hold it
        assert torch.equal(policy.greedy(model, [p]).completion_ids[0], batch[i])


def test_a_diffusion_rollout_keeps_tokens_up_to_its_first_eos_and_each_step_masks_prompts_anew(monkeypatch):
    import aisrl.diffusion
    from aisrl.policy import DiffusionPolicy

    params = DiffusionParams(gen_length=4, block_length=4, steps=4, temperature=1.0)
    policy = DiffusionPolicy(params, MASK, pad_id=0, eos_id=2, p_mask=0.5, micro_batch=4)
    x = torch.tensor([[1, 5, 7, 2, 9, 9], [1, 5, 7, 8, 9, 9]])  # a prompt of 2; row 0 ends at its EOS, row 1 never
    attn = torch.ones_like(x, dtype=torch.bool)
    monkeypatch.setattr(aisrl.diffusion, "diffusion_generate", lambda *a, **k: (x.clone(), attn.clone()))
    model = tiny_diffusion_model(V, MASK, hidden=32, layers=1, max_len=16)
    r = policy.sample(model, [[1, 5], [1, 5]], [0, 1], 0)
    assert r.completion_mask.tolist() == [[True, True, False, False], [True, True, True, True]]  # EOS included
    # the d1 log-probs draw their prompt masks from (seed, step): another step, other masks, other log-probs
    assert not torch.equal(policy.score(model, r, 0), policy.score(model, r, 1))
    assert torch.equal(policy.score(model, r, 1), policy.score(model, r, 1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_model_on_the_gpu_samples_and_scores_as_on_the_cpu():
    # the sampler's random numbers are drawn on the CPU whatever the model's device, and its state stays there: an
    # FP32 model on the GPU picks the CPU's tokens (rounding may flip a near tie) and gives its d1 log-probs
    torch.manual_seed(0)
    cpu = tiny_diffusion_model(V, MASK, hidden=32, layers=2, max_len=64)
    gpu = copy.deepcopy(cpu).cuda()
    params = DiffusionParams(gen_length=8, block_length=4, steps=4, temperature=1.0, remasking="random")
    prompts, seeds = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]] * 4, list(range(16))
    x, attn = diffusion_generate(cpu, prompts, params, mask_id=MASK, seeds=seeds)
    y, attn_gpu = diffusion_generate(gpu, prompts, params, mask_id=MASK, seeds=seeds, micro_batch=5)
    assert y.device.type == "cpu" and torch.equal(attn, attn_gpu)
    assert (x == y).float().mean() > 0.95
    done = torch.ones(16, 8, dtype=torch.bool)
    a = diffusion_logprobs(cpu, x, attn, x.shape[1] - 8, done, mask_id=MASK, seed=11)
    b = diffusion_logprobs(gpu, x, attn, x.shape[1] - 8, done, mask_id=MASK, seed=11)
    assert b.device.type == "cpu" and a.abs().min() > 0
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
