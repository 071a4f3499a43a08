"""How a kind of language model samples, scores and is evaluated, so the GRPO step is written once.

    causal     aisrl.rollout.generate (KV cache) and logprobs: exact per-token log-probs of the
               processed sampling distribution.
    diffusion  aisrl.diffusion: LLaDA block-wise denoising, and d1's one-pass log-prob estimate with every
               completion token masked and prompt tokens masked with probability p_mask. The masking seed is
               derived from (seed, step), so the rollout copy, the old-log-prob pass and every update of a step
               score the same perturbed input, and identical models give importance weights of exactly 1.

Both return `aisrl.rollout.Rollout` batches, so rewards, advantages, the correction and the loss are shared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aisrl.engine import Engine
from aisrl.rollout import Rollout, SamplingParams, generate, length_order, logprobs


@dataclass
class CausalPolicy:
    params: SamplingParams
    pad_id: int
    eos_id: int
    micro_batch: int = 64
    tokenizer: object = None

    def sample(self, model, prompts: list[list[int]], seeds: list[int], step: int,
               kv_fp8: bool | None = None) -> Rollout:  # fmt: skip
        """The rollouts of `prompts`; kv_fp8=None follows the model, as `generate` does (an FP8 cache for a `*_kv`
        preset's copy)."""
        if isinstance(model, Engine):  # the static-cache engine samples by itself
            return model.generate(prompts, self.params, seeds=seeds, pad_id=self.pad_id, eos_id=self.eos_id)
        return generate(model, prompts, self.params, seeds=seeds, tokenizer=self.tokenizer, pad_id=self.pad_id,
                        eos_id=self.eos_id, kv_cache_fp8=kv_fp8)  # fmt: skip

    def score(self, model, r: Rollout, step: int) -> torch.Tensor:
        return logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, self.params,
                        micro_batch=self.micro_batch)  # fmt: skip

    def order(self, r: Rollout) -> torch.Tensor:
        """Row order for the update's micro-batches: by length, as `logprobs` groups them (least padding)."""
        return length_order(r.prompt_mask, r.completion_mask)

    def greedy(self, model, prompts: list[list[int]]) -> Rollout:
        greedy = SamplingParams(self.params.max_new_tokens, greedy=True, stop=self.params.stop)  # ends as rollouts do
        return generate(model, prompts, greedy, tokenizer=self.tokenizer, pad_id=self.pad_id, eos_id=self.eos_id)


@dataclass
class DiffusionPolicy:
    params: object  # aisrl.diffusion.DiffusionParams
    mask_id: int
    pad_id: int
    eos_id: int
    p_mask: float = 0.15
    seed: int = 0
    micro_batch: int = 64

    def _rollout(self, model, prompts, seeds, greedy: bool, step: int) -> Rollout:
        from aisrl.diffusion import DiffusionParams, diffusion_generate

        p = self.params
        params = DiffusionParams(p.gen_length, p.block_length, p.steps, 0.0, p.remasking) if greedy else p
        x, attn = diffusion_generate(model, prompts, params, mask_id=self.mask_id, pad_id=self.pad_id, seeds=seeds,
                                     micro_batch=self.micro_batch)  # fmt: skip
        n_prompt = x.shape[1] - p.gen_length
        comp = x[:, n_prompt:]  # (B, G)
        is_eos = comp == self.eos_id
        first = torch.where(is_eos.any(-1), is_eos.int().argmax(-1), comp.shape[1] - 1)  # (B,)
        cmask = torch.arange(comp.shape[1])[None] <= first[:, None]  # up to and including the first EOS
        r = Rollout(x[:, :n_prompt], attn[:, :n_prompt], comp, cmask, torch.zeros(comp.shape))
        if not greedy:
            with torch.no_grad():
                r.rollout_logp = self.score(model, r, step)
        return r

    def sample(self, model, prompts, seeds, step: int, kv_fp8: bool = False) -> Rollout:
        return self._rollout(model, prompts, seeds, False, step)

    def score(self, model, r: Rollout, step: int) -> torch.Tensor:
        from aisrl.diffusion import diffusion_logprobs

        x = torch.cat([r.prompt_ids, r.completion_ids], dim=1)
        attn = torch.cat([r.prompt_mask, torch.ones_like(r.completion_mask)], dim=1)
        out = []  # micro-batches: the masking draws are per position, so a row scores as inside the whole batch
        for s in range(0, x.shape[0], self.micro_batch):
            sl = slice(s, s + self.micro_batch)
            out.append(
                diffusion_logprobs(
                    model,
                    x[sl],
                    attn[sl],
                    r.prompt_ids.shape[1],
                    r.completion_mask[sl],
                    mask_id=self.mask_id,
                    p_mask=self.p_mask,
                    seed=self.seed * 1_000_003 + step,
                )
            )
        return torch.cat(out, dim=0)

    def order(self, r: Rollout) -> torch.Tensor:
        """Row order for the update's micro-batches: the batch's own, as every scoring pass slices it (full width)."""
        return torch.arange(r.completion_ids.shape[0])

    def greedy(self, model, prompts) -> Rollout:
        # one seed for every row: with random remasking a row's commit order (so its answer) must not depend on its
        # place in the batch, nor on how evaluation shares the problems out over ranks
        return self._rollout(model, prompts, [0] * len(prompts), True, 0)
