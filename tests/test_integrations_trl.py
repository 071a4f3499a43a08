"""AISGRPOTrainer on CPU with a tiny Llama: real optimisation steps with an FP8 rollout copy, AIS metrics in
TRL's logs, the loss equal to TRL's own when nothing is corrected, and the weights TIS folds in."""

import os
import types
from collections import Counter, defaultdict

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from aisrl.integrations.trl import AISGRPOTrainer  # noqa: E402
from aisrl.quant import FakeQuantLinear, quant_config  # noqa: E402


def tiny_setup():
    from aisrl.models import tiny_model, word_tokenizer

    tok = word_tokenizer(29)
    model = tiny_model("tiny-llama", vocab_size=32, hidden=32, layers=1)
    ds = datasets.Dataset.from_dict({"prompt": ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9", "w10 w11"]})
    return model, tok, ds


def reward_w5(prompts, completions, **kwargs):  # a reward that varies, so advantages are non-zero
    return [float(c.count("w5")) + 0.1 * len(c.split()) for c in completions]


def grpo_args(tmp_path, **kw):
    return trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, gradient_checkpointing=False,
                          per_device_train_batch_size=8, num_generations=4, max_completion_length=6, max_steps=2,
                          logging_steps=1, report_to="none", save_strategy="no", learning_rate=1e-2, seed=0,
                          **kw)  # fmt: skip


def test_two_real_steps_with_an_fp8_rollout_copy_log_ais_metrics(tmp_path, monkeypatch):
    import aisrl.integrations.trl as adapter

    seeds, real = [], adapter.generate
    monkeypatch.setattr(adapter, "generate", lambda *a, **k: seeds.append(k["seeds"]) or real(*a, **k))
    model, tok, ds = tiny_setup()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tr = AISGRPOTrainer(model=model, reward_funcs=reward_w5, args=grpo_args(tmp_path), train_dataset=ds,
                        processing_class=tok, correction="ais", rollout_quant="fp8_e4m3_w8a8")  # fmt: skip
    tr.train()
    assert tr.state.global_step == 2
    low = [[s % 2**32 for s in batch] for batch in seeds]  # what CPU generators see: each step draws afresh
    assert len(seeds) == 2 and low[0] != low[1] and len(set(low[0])) == len(low[0])
    logs = [h for h in tr.state.log_history if "aisrl/alpha" in h]
    assert len(logs) == 2
    for h in logs:
        assert 0.0 <= h["aisrl/alpha"] <= 1.0 and h["aisrl/k3_kl"] > 0  # FP8 rollouts: a real mismatch
        for key in ("aisrl/weight_reliability", "aisrl/divergence_severity", "aisrl/variance_amplification",
                    "aisrl/ess"):  # fmt: skip
            assert key in h, key
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())  # it optimised
    # the rollout copy was re-synced after step 1: its weights are the FP8 image of the step-1 trainer weights,
    # so they differ from the FP8 image of the initial weights
    from aisrl.quant import quant_config, quantize_

    init = quantize_(tiny_setup()[0].eval(), quant_config("fp8_e4m3_w8a8"))
    name = "model.layers.0.self_attn.q_proj"
    assert not torch.equal(tr._rollout.get_submodule(name).weight, init.get_submodule(name).weight)


def test_evaluation_draws_its_own_seeds_and_leaves_the_training_samples_alone(tmp_path, monkeypatch):
    import aisrl.integrations.trl as adapter

    seeds, real = [], adapter.generate
    monkeypatch.setattr(adapter, "generate", lambda *a, **k: seeds.append(k["seeds"]) or real(*a, **k))
    batch = [{"prompt": p} for p in tiny_setup()[2]["prompt"][:2] for _ in range(4)]

    def drawn(evaluate_first: bool) -> list:
        model, tok, ds = tiny_setup()
        tr = AISGRPOTrainer(model=model, reward_funcs=reward_w5, args=grpo_args(tmp_path), train_dataset=ds,
                            processing_class=tok, correction="ais", rollout_quant="fp8_e4m3_w8a8")  # fmt: skip
        seeds.clear()
        if evaluate_first:  # an evaluation at the step boundary, before the step's training batch
            tr.model.eval()
            tr._generate_and_score_completions(batch)
        tr.model.train()
        tr._generate_and_score_completions(batch)
        return list(seeds)

    plain, with_eval = drawn(False), drawn(True)
    assert len(plain) == 1 and len(with_eval) == 2
    assert with_eval[1] == plain[0]  # before: the evaluation took the training batch's seeds, training others
    assert with_eval[0] != plain[0]


def test_correction_none_gives_trls_own_loss(tmp_path, monkeypatch):
    model, tok, ds = tiny_setup()
    ours = AISGRPOTrainer(model=model, reward_funcs=reward_w5, args=grpo_args(tmp_path / "a"), train_dataset=ds,
                          processing_class=tok, correction="none", rollout_quant="none")  # fmt: skip
    batch = [{"prompt": p} for p in ds["prompt"][:2] for _ in range(4)]
    captured = {}
    _spy_on_trl(monkeypatch, captured)
    inputs = ours._generate_and_score_completions(batch)
    trls = captured["out"]["advantages"]  # what TRL's own scoring returned, before the adapter
    assert trls.abs().sum() > 0 and torch.equal(inputs["advantages"], trls)  # untouched: same (N,) values
    plain = trl.GRPOTrainer(model=model, reward_funcs=reward_w5, args=grpo_args(tmp_path / "b"), train_dataset=ds,
                            processing_class=tok)  # fmt: skip
    theirs = {k: v for k, v in inputs.items() if k != "sampling_per_token_logps"}
    model.train()
    ours.current_gradient_accumulation_steps = plain.current_gradient_accumulation_steps = 1
    loss_ours, loss_theirs = ours._compute_loss(model, inputs), plain._compute_loss(model, theirs)
    assert loss_theirs.abs() > 0 and torch.equal(loss_ours, loss_theirs)


@pytest.mark.parametrize("veto", [0.0, 0.992])
def test_tis_weights_are_folded_into_the_advantages(tmp_path, veto):
    model, tok, ds = tiny_setup()
    options = {"cap": 1.01} | ({"veto": veto} if veto else {})
    tr = AISGRPOTrainer(model=model, reward_funcs=reward_w5, args=grpo_args(tmp_path), train_dataset=ds,
                        processing_class=tok, correction="tis", correction_options=options,
                        rollout_quant="mxfp4")  # fmt: skip
    captured = {}
    orig = trl.GRPOTrainer._generate_and_score_completions

    def spy(self, inputs):
        captured["out"] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in orig(self, inputs).items()}
        return captured["out"] | {}

    trl.GRPOTrainer._generate_and_score_completions = spy
    tr.model.train()  # a training batch (tiny_model comes in eval mode)
    try:
        out = tr._generate_and_score_completions([{"prompt": p} for p in ds["prompt"][:2] for _ in range(4)])
    finally:
        trl.GRPOTrainer._generate_and_score_completions = orig
    raw = captured["out"]
    mask = raw["completion_mask"].bool()
    old = tr._trainer_logps(raw)
    raw_w = torch.exp(old - raw["sampling_per_token_logps"])
    w = raw_w.clamp(max=1.01)  # token TIS, worked out by hand
    kept = ~(mask & (raw_w < veto)).any(-1, keepdim=True)  # (N, 1) sequences the veto keeps (all when veto = 0)
    expect = raw["advantages"][:, None] * torch.where(mask & kept, w, torch.zeros_like(w))
    assert torch.allclose(out["advantages"], expect, atol=1e-6)
    assert (raw_w[mask] > 1.01).any() and (raw_w[mask] < 1.01).any()  # real ratios, on both sides of the cap
    if veto:  # the MXFP4 copy of this tiny model puts w < 0.992 in some sequences and not in others
        assert 0 < kept.sum() < len(kept)
        (logged,) = [m["aisrl/veto_frac_seq"][-1] for m in tr._metrics.values() if m.get("aisrl/veto_frac_seq")]
        assert logged == pytest.approx(1 - kept.float().mean().item())


def test_configuration_errors_are_explained(tmp_path):
    model, tok, ds = tiny_setup()
    kw = {"reward_funcs": reward_w5, "args": grpo_args(tmp_path), "train_dataset": ds, "processing_class": tok}
    with pytest.raises(ValueError, match="unknown correction 'nope'; choose from"):
        AISGRPOTrainer(model=model, correction="nope", **kw)
    with pytest.raises(ValueError, match="needs the log-probs the rollouts were sampled with"):
        AISGRPOTrainer(model=model, correction="ais", **kw)
    with pytest.raises(ValueError, match="a veto judges each token's rollout/trainer ratio"):  # before: ignored
        AISGRPOTrainer(model=model, correction="none", correction_options={"veto": 0.5}, **kw)
    with pytest.raises(ValueError, match="unknown quantisation preset"):
        AISGRPOTrainer(model=model, rollout_quant="fp7", **kw)
    with pytest.raises(ValueError, match="keep pattern 'layers.9.*' matches none"):  # a QuantConfig is used as given
        AISGRPOTrainer(model=model, rollout_quant=quant_config("mxfp4", keep=("layers.9.*",)), **kw)
    mixed = AISGRPOTrainer(model=model, rollout_quant=quant_config("mxfp4", keep=("*.layers.0.self_attn.*",)), **kw)
    kinds = {n: isinstance(m, FakeQuantLinear) for n, m in mixed._rollout.named_modules() if ".layers." in n}
    assert any(kinds.values()) and not any(q for n, q in kinds.items() if ".layers.0.self_attn." in n)
    # a correction's options are checked when the trainer is built, not after the first generation
    q = {**kw, "rollout_quant": "fp8_e4m3_w8a8"}
    with pytest.raises(ValueError, match=r"got unknown option\(s\) \['capp'\]"):
        AISGRPOTrainer(model=model, correction="tis", correction_options={"capp": 2.0}, **q)
    with pytest.raises(ValueError, match="need cap > 0"):
        AISGRPOTrainer(model=model, correction="tis", correction_options={"cap": -1.0}, **q)
    with pytest.raises(ValueError, match="loss_type='vespo'"):
        AISGRPOTrainer(model=model, **{**q, "args": grpo_args(tmp_path, loss_type="vespo")})


def test_trainer_log_probs_get_the_fields_trls_loss_scores_with():
    """The recompute of old log-probs (a vision-language batch included) passes what GRPOTrainer._compute_loss
    passes: if TRL adds a field, this fails rather than the adapter scoring images-less prompts."""
    import inspect
    import re

    from aisrl.integrations.trl import MULTIMODAL_FIELDS

    scorer = inspect.signature(trl.GRPOTrainer._get_per_token_logps_and_entropies).parameters
    fed = set(re.findall(r'inputs\.get\("(\w+)"\)', inspect.getsource(trl.GRPOTrainer._compute_loss)))
    assert set(MULTIMODAL_FIELDS) == fed & set(scorer)


def test_settings_the_rollout_copy_cannot_honour_are_refused(tmp_path):
    model, tok, ds = tiny_setup()
    kw = {"reward_funcs": reward_w5, "train_dataset": ds, "processing_class": tok, "rollout_quant": "fp8_e4m3_w8a8"}
    with pytest.raises(ValueError, match=r"unset \['top_p'\]"):
        AISGRPOTrainer(model=model, args=grpo_args(tmp_path, top_p=0.9), **kw)
    with pytest.raises(ValueError, match="rollout_quant and use_vllm=True"):
        AISGRPOTrainer(model=model, args=grpo_args(tmp_path, use_vllm=True), **kw)
    unbounded = grpo_args(tmp_path)
    unbounded.max_completion_length = None  # TRL allows it; before, train() failed naming max_new_tokens
    with pytest.raises(ValueError, match=r"max_completion_length .* positive integer .*\(got None\)"):
        AISGRPOTrainer(model=model, args=unbounded, **kw)
    with pytest.raises(ValueError, match="with a PEFT"):
        AISGRPOTrainer(model=model, args=grpo_args(tmp_path), peft_config=object(), **kw)
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(tiny_setup()[0], peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="with a PEFT"):  # a model already wrapped, no peft_config passed
        AISGRPOTrainer(model=wrapped, args=grpo_args(tmp_path), **kw)
    trainer = AISGRPOTrainer(model=model, args=grpo_args(tmp_path), **kw)
    with pytest.raises(ValueError, match="would drop the images of this batch"):  # a vision-language batch
        trainer._generate_single_turn([[5, 6]], [[object()]], {}, 1)
    # two generation batches at one optimizer step (steps_per_generation, an evaluation) get other seeds
    prompts = [[5, 6, 7]] * 8
    first, _ = trainer._generate_single_turn(prompts, None, {}, 1)
    second, _ = trainer._generate_single_turn(prompts, None, {}, 1)
    assert first != second


def test_a_rollout_func_is_a_source_of_rollout_log_probs(tmp_path):
    # TRL requires a rollout_func to return the sampled tokens' "logprobs", with or without vLLM: the correction
    # runs on them. One that returns logprobs=None gets an error that says so, not a KeyError.
    from aisrl.rollout import SamplingParams, generate

    model, tok, ds = tiny_setup()
    calls = []

    def rollout_func(prompts, trainer, logprobs=True):
        ids = [tok(p)["input_ids"] for p in prompts]
        r = generate(model, ids, SamplingParams(6, 1.0), pad_id=tok.pad_token_id, eos_id=list(trainer.eos_token_ids))
        m = r.completion_mask
        calls.append(r)
        return {"prompt_ids": ids, "completion_ids": [r.completion_ids[i][m[i]].tolist() for i in range(len(ids))],
                "logprobs": [r.rollout_logp[i][m[i]].tolist() for i in range(len(ids))] if logprobs else None}

    kw = {"reward_funcs": reward_w5, "args": grpo_args(tmp_path), "train_dataset": ds, "processing_class": tok}
    tr = AISGRPOTrainer(model=model, correction="tis", rollout_func=rollout_func, **kw)
    batch = [{"prompt": p} for p in ds["prompt"][:2] for _ in range(4)]
    tr.model.train()  # metrics of training batches land in "train"
    out = tr._generate_and_score_completions(batch)
    r = calls[-1]  # the generator is the model itself: its log-probs are the trainer's, every TIS weight is 1
    assert out["advantages"].shape == r.completion_mask.shape
    # equal to round-off: the two forwards (KV-cache decoding, one full pass) differ in the last bits (1 - 6e-8 seen)
    assert tr._metrics["train"]["aisrl/k3_kl"][-1] < 1e-8
    assert tr._metrics["train"]["aisrl/weight_mean"][-1] == pytest.approx(1.0, abs=1e-6)
    tr2 = AISGRPOTrainer(model=model, correction="tis", rollout_func=lambda p, t: rollout_func(p, t, False), **kw)
    with pytest.raises(ValueError, match="came without them .*rollout_func that returned logprobs=None"):
        tr2._generate_and_score_completions(batch)


def test_a_rollout_copy_is_refused_when_the_trainer_shards_the_weights(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import aisrl.integrations.trl as adapter

    state = lambda stage: SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=stage)))  # noqa: E731
    assert adapter._shards_parameters(SimpleNamespace(is_fsdp_enabled=True, accelerator=state(None)))
    assert adapter._shards_parameters(SimpleNamespace(is_deepspeed_enabled=True, accelerator=state(3)))
    assert not adapter._shards_parameters(SimpleNamespace(is_deepspeed_enabled=True, accelerator=state(2)))
    assert not adapter._shards_parameters(SimpleNamespace(accelerator=SimpleNamespace(state=SimpleNamespace())))
    model, tok, ds = tiny_setup()
    monkeypatch.setattr(adapter, "_shards_parameters", lambda trainer: True)
    with pytest.raises(ValueError, match="FSDP / DeepSpeed ZeRO-3 shard them"):
        AISGRPOTrainer(model=model, reward_funcs=reward_w5, args=grpo_args(tmp_path), train_dataset=ds,
                       processing_class=tok, rollout_quant="fp8_e4m3_w8a8")  # fmt: skip


@pytest.mark.parametrize("positional", [False, True])
def test_the_callers_grpo_config_is_left_as_it_was(tmp_path, monkeypatch, positional):
    # With vLLM the adapter switches TRL's own correction off so that the ratio applies once; it does so on a copy:
    # the caller's GRPOConfig may be shared with another trainer (a baseline run with TRL's correction, say).
    seen = {}
    monkeypatch.setattr(trl.GRPOTrainer, "__init__", lambda self, model, *a, **kw: seen.update(a=a, kw=kw))
    model, tok, ds = tiny_setup()
    cfg = grpo_args(tmp_path, use_vllm=True)
    assert cfg.vllm_importance_sampling_correction  # TRL's default
    with pytest.warns(UserWarning, match="on a copy of your GRPOConfig"):
        if positional:
            AISGRPOTrainer(model, reward_w5, cfg, train_dataset=ds, processing_class=tok)
        else:
            AISGRPOTrainer(model=model, reward_funcs=reward_w5, args=cfg, train_dataset=ds, processing_class=tok)
    used = seen["a"][1] if positional else seen["kw"]["args"]
    assert used is not cfg and not used.vllm_importance_sampling_correction
    assert cfg.vllm_importance_sampling_correction and used.output_dir == cfg.output_dir


def _spy_on_trl(monkeypatch, captured, nan_at=None):
    """Wrap GRPOTrainer._generate_and_score_completions: keep a copy of what TRL returned (before the adapter), and
    optionally make one sampling log-prob NaN, as TRL does for a token vLLM returned no log-prob for."""
    orig = trl.GRPOTrainer._generate_and_score_completions

    def spy(self, inputs):
        out = orig(self, inputs)
        if nan_at is not None:
            out["sampling_per_token_logps"][nan_at] = float("nan")
        captured["out"] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in out.items()}
        return out

    monkeypatch.setattr(trl.GRPOTrainer, "_generate_and_score_completions", spy)


@pytest.mark.parametrize("veto", [0.0, 0.992])
def test_correction_none_leaves_the_advantages_alone_where_a_log_prob_is_missing(tmp_path, monkeypatch, veto):
    """correction='none' is TRL's loss as it is: a token without a sampling log-prob (NaN) keeps its advantage (the
    correction would drop it), and the mismatch metrics are still logged. A veto asked for with it drops the vetoed
    sequences, and nothing else."""
    model, tok, ds = tiny_setup()
    tr = AISGRPOTrainer(model=model, reward_funcs=reward_w5, args=grpo_args(tmp_path), train_dataset=ds,
                        processing_class=tok, correction="none", correction_options={"veto": veto} if veto else None,
                        rollout_quant="mxfp4")  # fmt: skip
    captured = {}
    _spy_on_trl(monkeypatch, captured, nan_at=(0, 0))
    tr.model.train()
    out = tr._generate_and_score_completions([{"prompt": p} for p in ds["prompt"][:2] for _ in range(4)])
    raw = captured["out"]
    mask = raw["completion_mask"].bool()
    assert mask[0, 0] and torch.isnan(raw["sampling_per_token_logps"][0, 0]) and raw["advantages"][0] != 0
    logged = {k: v[-1] for k, v in tr._metrics["train"].items() if k.startswith("aisrl/")}
    assert logged["aisrl/nonfinite_frac"] == pytest.approx(1 / mask.sum().item())  # the metrics still come
    if not veto:
        assert out["advantages"].shape == raw["advantages"].shape  # TRL's (N,) advantages, bit for bit
        assert torch.equal(out["advantages"], raw["advantages"])
        return
    raw_w = torch.exp(tr._trainer_logps(raw) - raw["sampling_per_token_logps"])  # NaN at (0, 0)
    kept = ~(mask & (raw_w < veto)).any(-1)  # by hand: a NaN compares False, so it vetoes nothing
    assert 0 < kept.sum() < len(kept)
    assert torch.equal(out["advantages"], raw["advantages"] * kept)
    assert logged["aisrl/veto_frac_seq"] == pytest.approx(1 - kept.float().mean().item())


@pytest.mark.parametrize("loss_type", ["bnpo", "dapo"])
def test_a_rejecting_correction_scales_trls_loss_by_the_kept_fraction(tmp_path, monkeypatch, loss_type):
    """Rejected tokens get advantage 0 but stay in TRL's denominators (the documented convention): with TRL's
    token-normalised loss types, TRL's loss is aisrl's grpo_loss (rejected tokens out of the denominator) times
    the fraction of tokens kept."""
    from aisrl.losses import grpo_loss

    model, tok, ds = tiny_setup()
    tr = AISGRPOTrainer(model=model, reward_funcs=reward_w5, args=grpo_args(tmp_path, loss_type=loss_type),
                        train_dataset=ds, processing_class=tok, correction="icepop",
                        correction_options={"low": 0.995, "high": 1.005}, rollout_quant="mxfp4")  # fmt: skip
    captured = {}
    _spy_on_trl(monkeypatch, captured)
    model.train()
    out = tr._generate_and_score_completions([{"prompt": p} for p in ds["prompt"][:2] for _ in range(4)])
    raw = captured["out"]
    assert raw.get("old_per_token_logps") is None and tr.beta == 0  # TRL's ratio is exactly 1, no KL term
    mask = raw["completion_mask"].bool()
    old = tr._trainer_logps(raw)
    w = torch.exp(old - raw["sampling_per_token_logps"])
    keep = mask & (w >= 0.995) & (w <= 1.005)  # icepop by hand
    kept_frac = keep.sum().item() / mask.sum().item()
    assert 0 < kept_frac < 1
    tr.current_gradient_accumulation_steps = 1
    loss = tr._compute_loss(model, out)
    core, _ = grpo_loss(old, old, raw["advantages"], keep, weights=torch.where(keep, w, 0.0), agg="token-mean")
    assert core.abs() > 0 and torch.allclose(loss, core * kept_frac, atol=1e-6, rtol=1e-5), (loss, core, kept_frac)


def test_a_second_train_call_syncs_the_rollout_copy_again(tmp_path, monkeypatch):
    # each train() starts at global_step 0: keyed on the step number, the copy kept the weights of the first run
    import aisrl.integrations.trl as adapter

    syncs, real = [], adapter.sync_weights
    monkeypatch.setattr(adapter, "sync_weights", lambda *a: syncs.append(1) or real(*a))
    model, tok, ds = tiny_setup()
    args = grpo_args(tmp_path)
    args.max_steps = 1
    tr = AISGRPOTrainer(model=model, reward_funcs=reward_w5, args=args, train_dataset=ds, processing_class=tok,
                        correction="tis", rollout_quant="none")  # fmt: skip
    tr.train()
    tr.train()
    assert len(syncs) == 2
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(tr._rollout.state_dict()[name], tiny_setup()[0].state_dict()[name])  # trained weights


def test_a_batch_without_a_scored_token_leaves_the_alpha_ema_alone_and_penalties_are_warned_of(tmp_path):
    from aisrl.rollout import SamplingParams, generate

    model, tok, ds = tiny_setup()

    def unscored(prompts, trainer):  # a sampler that reported no usable log-prob for any token
        ids = [tok(p)["input_ids"] for p in prompts]
        r = generate(model, ids, SamplingParams(6, 1.0), pad_id=tok.pad_token_id, eos_id=list(trainer.eos_token_ids))
        m = r.completion_mask
        return {"prompt_ids": ids, "completion_ids": [r.completion_ids[i][m[i]].tolist() for i in range(len(ids))],
                "logprobs": [[float("nan")] * int(m[i].sum()) for i in range(len(ids))]}

    kw = {"reward_funcs": reward_w5, "train_dataset": ds, "processing_class": tok}
    tr = AISGRPOTrainer(model=model, correction="ais", correction_options={"ema": 0.9}, rollout_func=unscored,
                        args=grpo_args(tmp_path), **kw)  # fmt: skip
    tr._aisrl["prev_alpha"] = 0.8
    tr.model.train()
    tr._generate_and_score_completions([{"prompt": p} for p in ds["prompt"][:2] for _ in range(4)])
    assert tr._metrics["train"]["aisrl/num_tokens"][-1] == 0 and tr._aisrl["prev_alpha"] == 0.8  # before: 0.72
    # the sampler's log-probs include a repetition penalty that TRL's do not: warned of, as top_k is
    with pytest.warns(UserWarning, match="repetition_penalty.*every importance ratio is biased"):
        AISGRPOTrainer(model=model, correction="tis", rollout_func=unscored,
                       args=grpo_args(tmp_path, repetition_penalty=1.2), **kw)  # fmt: skip


# Found by mutation testing: each case below failed a plausible slip that the tests above let pass.


def _bare(name, options, training=True):
    """An AISGRPOTrainer without TRL's __init__: just what _generate_and_score_completions reads."""
    tr = object.__new__(AISGRPOTrainer)
    tr._aisrl = {"name": name, "options": dict(options), "prev_alpha": None}
    tr.model = types.SimpleNamespace(training=training)
    tr._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    return tr


def _run(monkeypatch, tr, out):
    monkeypatch.setattr(trl.GRPOTrainer, "_generate_and_score_completions", lambda self, inputs: dict(out))
    return tr._generate_and_score_completions(None)


def test_a_veto_with_correction_none_drops_a_short_vetoed_sequence(monkeypatch):
    # sequence 0: 2 tokens then padding, its first token's ratio exp(-1) = 0.37 < veto 0.8; sequence 1: ratios 1
    old = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -1.0, -1.0]])
    rollout = torch.tensor([[0.0, -1.0, 0.0], [-1.0, -1.0, -1.0]])
    out = {"completion_mask": torch.tensor([[1, 1, 0], [1, 1, 1]]), "sampling_per_token_logps": rollout,
           "old_per_token_logps": old, "advantages": torch.tensor([1.0, 2.0])}
    res = _run(monkeypatch, _bare("none", {"veto": 0.8}), out)
    assert torch.equal(res["advantages"], torch.tensor([0.0, 2.0]))  # the vetoed (short) sequence only


def _ais_batch(shift):
    old = torch.full((2, 4), -1.0)
    rollout = old - torch.tensor([[0.5, -0.5, 0.2, -0.2], [0.1, 0.3, -0.4, 0.0]]) * shift
    return {"completion_mask": torch.ones(2, 4, dtype=torch.long), "sampling_per_token_logps": rollout,
            "old_per_token_logps": old, "advantages": torch.tensor([1.0, -1.0])}


def test_evaluation_batches_leave_the_alpha_ema_alone(monkeypatch):
    tr = _bare("ais", {"ema": 0.9}, training=False)
    _run(monkeypatch, tr, _ais_batch(1.0))
    assert tr._aisrl["prev_alpha"] is None  # an evaluation batch: the EMA state is untouched
    tr.model.training = True
    _run(monkeypatch, tr, _ais_batch(1.0))
    assert tr._aisrl["prev_alpha"] == pytest.approx(tr._metrics["train"]["aisrl/alpha"][-1])


def test_the_ais_ema_smooths_alpha_across_batches(monkeypatch):
    tr = _bare("ais", {"ema": 0.9})
    _run(monkeypatch, tr, _ais_batch(1.0))
    _run(monkeypatch, tr, _ais_batch(3.0))
    a1, a2 = tr._metrics["train"]["aisrl/alpha"]
    b2 = tr._metrics["train"]["aisrl/alpha_batch"][-1]
    assert b2 != pytest.approx(a1)
    assert a2 == pytest.approx(0.9 * a1 + 0.1 * b2)


def test_tool_tokens_get_no_advantage(monkeypatch):
    old = torch.full((1, 3), -1.0)
    out = {"completion_mask": torch.ones(1, 3, dtype=torch.long), "tool_mask": torch.tensor([[1, 0, 1]]),
           "sampling_per_token_logps": old.clone(), "old_per_token_logps": old, "advantages": torch.tensor([1.0])}
    res = _run(monkeypatch, _bare("tis", {"cap": 2.0}), out)
    assert torch.equal(res["advantages"], torch.tensor([[1.0, 0.0, 1.0]]))  # weights 1, the tool token out


def test_two_batches_of_one_step_draw_different_seeds(monkeypatch):
    import aisrl.integrations.trl as at
    seen, temps = [], []

    def fake_generate(model, prompts, params, seeds, pad_id, eos_id):
        seen.append(list(seeds))
        temps.append(params.temperature)
        n = len(prompts)
        return types.SimpleNamespace(completion_mask=torch.ones(n, 1, dtype=torch.bool),
                                     completion_ids=torch.full((n, 1), 5), rollout_logp=torch.full((n, 1), -0.5))

    monkeypatch.setattr(at, "generate", fake_generate)
    tr = _bare("ais", {})
    tr._rollout, tr._synced_step, tr._generations = object(), 0, Counter()
    tr.state = types.SimpleNamespace(global_step=0)
    tr.args = types.SimpleNamespace(seed=42)
    tr.accelerator = types.SimpleNamespace(process_index=0)
    tr._tokenizer = types.SimpleNamespace(pad_token_id=0)
    tr.eos_token_ids, tr.max_completion_length, tr.temperature = [2], 4, 0.7
    for _ in range(2):  # steps_per_generation = 2: two generation batches at global_step 0
        tr._generate_single_turn([[3, 4]], None, None, 1)
    assert seen[0] != seen[1]
    assert temps == [0.7, 0.7]  # the GRPOConfig temperature, which TRL's trainer log-probs apply


def test_a_zero_completion_length_is_refused_for_a_rollout_copy():
    from aisrl.integrations.trl import _check_rollout_copy_settings
    with pytest.raises(ValueError, match="max_completion_length"):
        _check_rollout_copy_settings(torch.nn.Linear(1, 1), types.SimpleNamespace(max_completion_length=0), {})
