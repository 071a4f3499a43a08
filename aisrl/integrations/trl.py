"""AIS inside TRL: `AISGRPOTrainer`, a `trl.GRPOTrainer` whose rollout/trainer mismatch correction is any
`aisrl.correction` (AIS by default), optionally generating with an `aisrl` low-precision rollout copy.

    from aisrl.integrations.trl import AISGRPOTrainer
    trainer = AISGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...), train_dataset=ds,
                             processing_class=tok, correction="ais", rollout_quant="fp8_e4m3_w8a8")

How it plugs in (TRL 1.x). TRL applies its own fixed correction only with vLLM, as a per-token factor on the
clipped loss: `loss_t = -min(r_t A, clip(r_t) A) * is_t`. Because every aisrl weight w_t is >= 0,
`-min(r_t A w_t, clip(r_t) A w_t) = w_t * -min(r_t A, clip(r_t) A)`, so the same correction is obtained by
handing TRL per-token advantages `A * w_t * m_t` (TRL accepts (N, T) advantages). That is done once per
generation batch in `_generate_and_score_completions`, right after TRL scores it:
    old_logp (trainer precision, no grad) and rollout_logp (what the generator sampled with)
    -> correct(name, old_logp, rollout_logp, mask) -> advantages * weights * mask, metrics logged as aisrl/*
With correction='none' the advantages are left as TRL made them (the metrics are still logged when the sampler
reported log-probs); a `veto` option then zeroes the advantages of the sequences it vetoes, and nothing else.

Loss denominators under rejection (icepop, seq_mask, geo_mask, k*_reject, veto=). The aisrl trainer takes rejected
tokens out of the loss and out of its denominators (aisrl.update: mask=res.mask); here they get advantage 0 but keep
their place in TRL's denominators, which TRL computes from completion_mask (as with TRL's own masking modes). So the
loss, and the step, are the aisrl trainer's scaled down by what was kept: for the token-normalised loss types (bnpo:
per micro-batch; dapo, cispo: over the generation batch, through num_items_in_batch) by the fraction of tokens kept;
for the per-sequence means (grpo, sapo) each sequence's term by its own kept-token fraction, wholly rejected
sequences still counting in the mean over sequences; for dr_grpo and luspo by the fraction of sequences kept. That
acts like a learning rate scaled by the kept fraction (Adam-type optimisers largely normalise a steady scale away, SGD
does not): tune the learning rate with the correction on, and watch aisrl/mask_frac_token and aisrl/mask_frac_seq
(1 - kept fraction). With beta > 0, TRL's KL penalty still applies to every completion token, rejected ones
included (the aisrl trainer drops it with the rest of the loss). Matching the aisrl convention exactly would need
the kept counts of the micro-batches TRL shuffles and splits the generation batch into afterwards
(`_prepare_inputs`), applied inside TRL's private `_compute_loss`; the adapter does not reach in there.

Rollout log-probs come from one of three sources: vLLM (`use_vllm=True`: TRL collects them; TRL's own
correction is switched off so that only ours applies), a `rollout_func` (TRL requires it to return the sampled
tokens' "logprobs"), or `rollout_quant=` (any hardware, CPU included): a
copy of the policy quantised with `aisrl.quant.quantize_`, re-synced from the trainer's weights whenever the
optimiser has stepped, samples the completions with `aisrl.rollout.generate`, which returns the log-probs of
the distribution it sampled from. TRL's trainer log-probs apply the temperature and no filter, so both paths need
top_p = 1 and no top_k / min_p: the copy refuses them, vLLM gets a warning.

The adapter overrides two of GRPOTrainer's private methods (`_generate_single_turn` and
`_generate_and_score_completions`) and calls a third (`_get_per_token_logps_and_entropies`), so it is pinned to
TRL 1.x and tested with 1.16.
"""

from __future__ import annotations

import copy
import warnings
from collections import Counter

import torch

try:
    from trl import GRPOTrainer
except ImportError as e:  # not installed, or broken: each named
    from aisrl.integrations import import_error

    fix = "aisrl.integrations.trl needs TRL: pip install 'aisrl[trl]' (or pip install trl)"
    raise import_error(e, "trl", fix, "trl>=1.16,<2") from e

from aisrl.correction import CORRECTIONS, check_options, correct
from aisrl.diagnostics import prepare
from aisrl.lora import is_peft
from aisrl.quant import QuantConfig, quant_config, quantize_, sync_weights
from aisrl.rollout import SamplingParams, generate, request_seeds

MULTIMODAL_FIELDS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                     "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")
"""The batch fields GRPOTrainer._compute_loss passes to _get_per_token_logps_and_entropies (TRL 1.16)."""


def _sampling_filters(args) -> dict:
    """The GRPOConfig sampling settings that change the distribution away from temperature-only sampling, with
    their values (those left at their defaults omitted). TRL's trainer log-probs apply the temperature only."""
    settings = {"top_p": (getattr(args, "top_p", 1.0), 1.0), "top_k": (getattr(args, "top_k", 0) or 0, 0),
                "min_p": (getattr(args, "min_p", None), None),
                "repetition_penalty": (getattr(args, "repetition_penalty", 1.0), 1.0),
                "generation_kwargs": (getattr(args, "generation_kwargs", None) or None, None)}  # fmt: skip
    return {k: value for k, (value, default) in settings.items() if value != default}


def _check_rollout_copy_settings(model, args, kwargs) -> None:
    """What an aisrl rollout copy cannot honour is an error, not a silent difference."""
    if isinstance(model, str):
        raise ValueError(f"rollout_quant needs a model instance (load it first), not the name {model!r}")
    if kwargs.get("peft_config") is not None or is_peft(model):
        raise ValueError("rollout_quant with a PEFT (LoRA) model is not supported: the copy would quantise the "
                         "adapters as layers of their own and never see the merged weights; use full fine-tuning, "
                         "or use_vllm=True")  # fmt: skip
    if kwargs.get("rollout_func") is not None:
        raise ValueError("rollout_quant and rollout_func both generate completions; pass one of them")
    if args is None:
        return
    if getattr(args, "use_vllm", False):
        raise ValueError("rollout_quant and use_vllm=True both generate completions; pass one of them")
    length = getattr(args, "max_completion_length", 1)
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:  # TRL allows None: generate to the end
        raise ValueError(f"rollout_quant generates at most max_completion_length tokens per completion; set it to a "
                         f"positive integer in GRPOConfig (got {length!r})")  # fmt: skip
    bad = list(_sampling_filters(args))  # the copy's log-probs would include any of them, TRL's would not
    if bad:
        raise ValueError(f"rollout_quant samples with temperature only; unset {bad} (TRL's trainer log-probs do "
                         "not apply them, so the importance ratios would be biased)")  # fmt: skip


def _shards_parameters(trainer) -> bool:
    """Whether the Trainer shards the model's parameters (FSDP, or DeepSpeed ZeRO stage 3)."""
    if getattr(trainer, "is_fsdp_enabled", False):
        return True
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return bool(getattr(trainer, "is_deepspeed_enabled", False) and plugin is not None and plugin.zero_stage == 3)


class AISGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` plus three keyword arguments.

    correction: a name of aisrl.correction.CORRECTIONS ('ais' by default; 'none' leaves TRL's loss as it is, its
        advantages untouched, and logs the mismatch metrics where the sampler reports log-probs). A rejecting
        correction keeps the rejected tokens in TRL's denominators: the step shrinks by the kept fraction (module
        docstring).
    correction_options: keyword options of that correction, e.g. {"cap": 2.0} or {"ema": 0.9} for AIS.
    rollout_quant: an aisrl.quant preset ('fp8_e4m3_w8a8', 'mxfp4', ...), an aisrl.quant.QuantConfig (e.g.
        `quant_config("nvfp4_w4a4", keep=("model.layers.0.self_attn.*",))` for mixed precision) or 'none'
        (full-precision copy) to generate with an aisrl rollout copy; None keeps TRL's generation (then any
        correction other than 'none' needs the sampling log-probs: use_vllm=True, or a rollout_func that returns
        them).
    """

    def __init__(self, model, *args, correction: str = "ais", correction_options: dict | None = None,
                 rollout_quant: str | QuantConfig | None = None, **kwargs):  # fmt: skip
        if correction not in CORRECTIONS:
            raise ValueError(f"unknown correction {correction!r}; choose from {sorted(CORRECTIONS)}")
        check_options(correction, **(correction_options or {}))  # now, not after the first generation
        train_args = kwargs.get("args") or (args[1] if len(args) > 1 else None)
        use_vllm = bool(getattr(train_args, "use_vllm", False))
        own_sampler = use_vllm or kwargs.get("rollout_func") is not None  # reports the log-probs it sampled with
        if correction != "none" and getattr(train_args, "loss_type", None) == "vespo":
            raise ValueError("loss_type='vespo' builds its own weights from TRL's ratio, which the adapter's "
                             "per-token advantages do not reach; use another loss_type (grpo, bnpo, dr_grpo, dapo, "
                             "cispo, sapo, luspo) or correction='none'")  # fmt: skip
        if own_sampler and correction != "none":
            filters = _sampling_filters(train_args)  # filters, penalties and extra generation_kwargs alike
            if filters:
                warnings.warn(f"{filters}: the sampler's processed log-probs include these settings and TRL's trainer "
                              "log-probs do not, so every importance ratio is biased; sample with temperature only "
                              "for an exact correction", stacklevel=2)  # fmt: skip
        vetoes = bool((correction_options or {}).get("veto"))
        if rollout_quant is None and not own_sampler and correction == "none" and vetoes:
            raise ValueError("a veto judges each token's rollout/trainer ratio, which needs the log-probs the "
                             "rollouts were sampled with: pass rollout_quant (an aisrl rollout copy), use vLLM "
                             "(GRPOConfig(use_vllm=True)) or a rollout_func that returns them, or drop the veto")
        if rollout_quant is None and not own_sampler and correction != "none":
            raise ValueError(
                f"correction {correction!r} needs the log-probs the rollouts were sampled with: pass "
                "rollout_quant='fp8_e4m3_w8a8' (or another aisrl.quant preset, or 'none') to generate with an "
                "aisrl rollout copy, use vLLM (GRPOConfig(use_vllm=True)), or pass a rollout_func that returns them"
            )
        if rollout_quant is not None:
            _check_rollout_copy_settings(model, train_args, kwargs)
        if use_vllm and correction != "none" and getattr(train_args, "vllm_importance_sampling_correction", False):
            warnings.warn(
                "AISGRPOTrainer trains with vllm_importance_sampling_correction=False (on a copy of your GRPOConfig): "
                f"the {correction!r} correction replaces TRL's, so the ratio is applied once",
                stacklevel=2,
            )
            train_args = copy.copy(train_args)  # the caller's GRPOConfig is theirs: change a copy of it
            train_args.vllm_importance_sampling_correction = False  # one correction, ours, not two
            if kwargs.get("args") is not None:
                kwargs["args"] = train_args
            else:
                args = (args[0], train_args, *args[2:])
        self._aisrl = {"name": correction, "options": dict(correction_options or {}), "prev_alpha": None}
        self._rollout, self._synced_step, self._generations = None, None, Counter()  # batches per mode this step
        if rollout_quant is not None:  # copy before TRL patches the model's forward in place
            self._rollout = copy.deepcopy(model).eval().requires_grad_(False)
            if rollout_quant != "none":
                qc = rollout_quant if isinstance(rollout_quant, QuantConfig) else quant_config(rollout_quant)
                quantize_(self._rollout, qc)
        super().__init__(model, *args, **kwargs)
        if self._rollout is not None:
            if _shards_parameters(self):
                raise ValueError("rollout_quant re-quantises the trainer's full weights into a local copy every step, "
                                 "and FSDP / DeepSpeed ZeRO-3 shard them across processes; use vLLM "
                                 "(use_vllm=True) or DDP / ZeRO-1/2 with rollout_quant")  # fmt: skip
            self._rollout.to(self.accelerator.device)  # the Trainer placed the policy; the copy follows it
        if use_vllm and correction != "none":
            self._check_vllm_logprobs_mode()

    def _check_vllm_logprobs_mode(self) -> None:
        """Our correction needs vLLM's log-probs after temperature/logit processing (TRL checks this only when
        its own correction is on, which we switched off)."""
        if getattr(self, "vllm_mode", None) != "server" or not self.accelerator.is_main_process:
            return  # colocated engines are created by TRL with logprobs_mode="processed_logprobs"
        mode = self.vllm_generation.vllm_client.get_server_info()["model_config"]["logprobs_mode"]
        if mode != "processed_logprobs":
            raise ValueError(f"the vLLM server runs with --logprobs-mode {mode}; the correction needs "
                             "--logprobs-mode processed_logprobs (restart `trl vllm-serve` with it)")  # fmt: skip

    def train(self, *args, **kwargs):
        # every train() (a second call, a resume) starts a new TrainerState at step 0: a step number the copy was
        # synced at no longer says that it holds the current weights
        self._synced_step = None
        return super().train(*args, **kwargs)

    # -- generation with the aisrl rollout copy ------------------------------------------------------
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self._rollout is None:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)  # fmt: skip
        if images is not None and any(x is not None for x in images):
            raise ValueError("rollout_quant generates from token ids only and would drop the images of this batch; "
                             "use TRL's generation (rollout_quant=None with use_vllm=True) for vision-language models")
        if self._synced_step != self.state.global_step:  # the optimiser stepped: re-quantise its weights
            sync_weights(self.accelerator.unwrap_model(self.model).state_dict(), self._rollout)
            self._synced_step, self._generations = self.state.global_step, Counter()
        mode = "train" if self.model.training else "eval"
        self._generations[mode] += 1  # a step may generate several batches (steps_per_generation)
        params = SamplingParams(self.max_completion_length, self.temperature)
        # per-request seeds from (seed, step, batch of the step, process, row): reproducible (a resume starts at a
        # step boundary), no two batches alike, and TRL's global RNG left alone. Evaluation counts its own batches
        # under its own key, so turning it on changes no training sample.
        key = (self.args.seed, self.state.global_step, self._generations[mode], self.accelerator.process_index)
        key = key if mode == "train" else (*key, -1)
        seeds = request_seeds(key, len(prompt_ids))
        r = generate(self._rollout, [list(p) for p in prompt_ids], params, seeds=seeds,
                     pad_id=self._tokenizer.pad_token_id, eos_id=list(self.eos_token_ids))  # fmt: skip
        mask, comp, logp = r.completion_mask.cpu(), r.completion_ids.cpu(), r.rollout_logp.cpu()
        ids = [comp[i][mask[i]].tolist() for i in range(len(prompt_ids))]
        logps = [logp[i][mask[i]].tolist() for i in range(len(prompt_ids))]
        return ids, logps

    # -- the correction, folded into per-token advantages ------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        vetoes = bool(self._aisrl["options"].get("veto"))
        if self._aisrl["name"] == "none" and not vetoes and "sampling_per_token_logps" not in out:
            return out
        if "sampling_per_token_logps" not in out:  # TRL sets it only when the sampler reported log-probs
            raise ValueError(f"correction {self._aisrl['name']!r} needs the log-probs the rollouts were sampled with, "
                             "and this batch came without them (a rollout_func that returned logprobs=None?); return "
                             "the sampled tokens' log-probs, or use correction='none'")  # fmt: skip
        mask = out["completion_mask"] * out["tool_mask"] if "tool_mask" in out else out["completion_mask"]
        rollout_logp = out["sampling_per_token_logps"]  # (N, T), 0 where padded
        old_logp = out.get("old_per_token_logps")
        if old_logp is None:  # TRL only computes it when it needs it; the correction always does
            old_logp = self._trainer_logps(out)
        opts = dict(self._aisrl["options"])
        if self._aisrl["name"] == "ais" and opts.get("ema"):
            opts["prev_alpha"] = self._aisrl["prev_alpha"]
        res = correct(self._aisrl["name"], old_logp, rollout_logp, mask.bool(), **opts)
        adv = out["advantages"]
        if self._aisrl["name"] == "none":  # TRL's loss as it is: `correct` would zero a token vLLM could not score
            if vetoes:  # ... but a veto asked for still drops its sequences, and only them
                usable = prepare(old_logp, rollout_logp, mask.bool()).mask  # (N, T) tokens `correct` could judge
                kept = ~(usable & ~res.mask.to(usable.device)).any(-1)  # (N,) sequences the veto left alone
                kept = kept.to(adv.device, adv.dtype)
                out["advantages"] = adv * (kept if adv.dim() == 1 else kept[:, None])
        else:
            adv = adv.unsqueeze(1) if adv.dim() == 1 else adv  # (N, 1) or already (N, T)
            out["advantages"] = adv * (res.weights * res.mask).to(adv.dtype).detach()  # (N, T)
        mode = "train" if self.model.training else "eval"
        measured = res.metrics["num_tokens"].item() > 0  # a batch with no scored token measured nothing
        if "alpha" in res.metrics and mode == "train" and measured:  # nor do evaluation batches move the EMA
            self._aisrl["prev_alpha"] = res.metrics["alpha"].item()
        for key, value in res.metrics.items():  # already global under torch.distributed (aisrl.dist)
            self._metrics[mode][f"aisrl/{key}"].append(float(value))
        return out

    @torch.no_grad()
    def _trainer_logps(self, out) -> torch.Tensor:
        from trl.models.utils import disable_gradient_checkpointing

        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attn = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        # a vision-language batch carries its images: the same fields TRL's loss scores the completions with
        multimodal = {k: out.get(k) for k in MULTIMODAL_FIELDS}
        with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model, ids, attn, out["completion_ids"].size(1), batch_size=self.args.per_device_train_batch_size,
                **multimodal,
            )
        return logps
