"""What a run is built from (aisrl.build): the task and its problem pools, completions as the task scores them, the
rollout copy and which of its layers stay in full precision."""

import json
import warnings

import pytest
import torch
from conftest import TINY_LAB

from aisrl.build import build
from aisrl.cli import main
from aisrl.tasks import Problem
from aisrl.train_config import load_config

TINY = [*TINY_LAB, "eval_every=2"]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AISRL_CACHE", str(tmp_path / "cache"))


def test_rollout_keep_leaves_those_layers_of_the_rollout_copy_in_full_precision(tmp_path, capsys):
    from aisrl.build import rollout_model
    from aisrl.quant import FakeQuantLinear

    cfg = load_config("lab", [*TINY, "rollout.quant=nvfp4_w4a4", "rollout.keep=[model.layers.0.self_attn.*]"])
    model, _, task, encode = build(cfg)
    rollout, sync = rollout_model(cfg, model, torch.device("cpu"), [], encode)  # an HF copy needs no prompts
    quantised = {n for n, m in rollout.named_modules() if isinstance(m, FakeQuantLinear)}
    assert quantised and not any(n.startswith("model.layers.0.self_attn.") for n in quantised)
    assert any(n.startswith("model.layers.0.mlp.") for n in quantised)
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.add_(0.01)
    sync(model.state_dict())
    assert torch.equal(rollout.model.layers[0].self_attn.o_proj.weight, model.model.layers[0].self_attn.o_proj.weight)
    out = tmp_path / "run"  # a pattern that names no layer stops the run before it writes anything
    assert main(["train", "lab", *TINY, "rollout.keep=[model.layer.0.*]", f"output_dir={out}"]) == 2
    assert "keep pattern 'model.layer.0.*' matches none of this model's" in capsys.readouterr().err
    assert not out.exists()


def test_completions_are_scored_without_the_eos_token():
    from types import SimpleNamespace

    from aisrl.build import completion_texts
    from aisrl.tasks import Arithmetic, Problem

    class HFLike:  # decodes special tokens unless asked not to, like a Hugging Face tokenizer
        def decode(self, ids, skip_special_tokens=False):
            text = "".join(chr(i) for i in ids if i != 0)
            return text if skip_special_tokens else text + "<|im_end|>"

    text = "<reasoning>1+1=2</reasoning><answer>2</answer>"
    ids = torch.tensor([[ord(c) for c in text] + [0]])
    r = SimpleNamespace(completion_ids=ids, completion_mask=torch.ones_like(ids, dtype=torch.bool))
    (decoded,) = completion_texts(HFLike(), r)
    assert Arithmetic().reward(decoded, Problem("1+1", "2")) == (1.5, True)


def test_lenient_reward_reaches_the_lab_task():
    # the lab built its task without it: lenient_reward=true was accepted and ignored
    _, _, task, _ = build(load_config("lab", [*TINY, "lenient_reward=true"]))
    assert task.lenient and task.reward("12 plus 7 gives 19", Problem("12+7", "19")) == (1.0, True)
    assert not build(load_config("lab", TINY))[2].lenient


def test_task_options_and_dataset_reach_the_task():
    pytest.importorskip("reasoning_gym")
    from aisrl.build import task_of

    args = ["model.name=smollm2", "task=reasoning_gym", "dataset=chain_sum", "task_options={'max_terms': 2}"]
    task = task_of(load_config("lab", args))
    assert (task.generator, task.options) == ("chain_sum", {"max_terms": 2})
    task = task_of(load_config("lab", ["model.name=smollm2", "task_options={'max_operand': 7}"]))
    assert task.max_operand == 7
    task = task_of(load_config("lab", ["lab.task=sudoku4", "lab.sudoku_holes=3", "task=countdown"]))
    assert (task.name, task.holes) == ("sudoku4", 3)  # the lab model trains on the lab's own task


def test_a_dataset_smaller_than_the_sets_asked_for_is_said_not_silently_shortened(tmp_path):
    from aisrl.build import problem_sets, task_of
    from aisrl.tasks import _split_of

    path = tmp_path / "small.jsonl"
    questions = [f"What is {i} + {i}?" for i in range(40)]
    path.write_text("\n".join(json.dumps({"question": q, "answer": str(2 * i)}) for i, q in enumerate(questions)))
    n_test = sum(_split_of(q) == "test" for q in questions)  # counted by the split rule, not the code under test
    assert 0 < n_test < 40
    args = ["model.name=smollm2", "task=jsonl", f"dataset={path}", "train_problems=500", f"eval_problems={n_test}"]
    cfg = load_config("lab", args)
    with pytest.warns(UserWarning) as caught:
        pool, held = problem_sets(cfg, task_of(cfg))
    (said,) = [str(w.message) for w in caught]  # the held-out set is whole: only the training pool is said
    assert (len(pool), len(held)) == (40 - n_test, n_test)
    assert f"gives {40 - n_test} training problems where train_problems=500" in said
    assert f"set train_problems={40 - n_test}" in said


def test_the_rollout_copy_samples_in_eval_mode_without_gradients():
    from aisrl.build import rollout_model

    cfg = load_config("lab", [*TINY, "rollout.quant=fp8_e4m3_w8a8"])
    model, _, _, encode = build(cfg)
    model.train()  # the trainer trains; its copy must not inherit train mode (dropout in the sampler)
    rollout, _ = rollout_model(cfg, model, torch.device("cpu"), [], encode)
    assert not any(m.training for m in rollout.modules())  # its quantised layers too
    assert not any(p.requires_grad for p in rollout.parameters())
    assert model.training and all(p.requires_grad for p in model.parameters())  # the trainer's model is left alone


def test_completion_texts_keep_only_the_masked_in_tokens():
    from types import SimpleNamespace

    from aisrl.build import completion_texts

    class Chars:
        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(i) for i in ids)

    ids = torch.tensor([[ord("4"), ord("2"), ord("x")], [ord("7"), ord("y"), ord("z")]])
    mask = torch.tensor([[True, True, False], [True, False, False]])  # what follows a row's end is not its text
    assert completion_texts(Chars(), SimpleNamespace(completion_ids=ids, completion_mask=mask)) == ["42", "7"]


def test_the_mask_id_is_the_configured_one_else_the_checkpoints_else_the_tokenizers():
    from types import SimpleNamespace

    from aisrl.build import _mask_id

    model = SimpleNamespace(config=SimpleNamespace(vocab_size=10, mask_token_id=7))
    tok = SimpleNamespace(mask_token_id=8)

    def mask_id(given, model=model):
        return _mask_id(load_config("lab", ["model.name=some/diffusion", "model.kind=diffusion",
                                          f"diffusion.mask_id={given}"]), tok, model)

    assert (mask_id(0), mask_id(9), mask_id(-1)) == (0, 9, 7)  # id 0 is an id; -1 reads the checkpoint first
    assert mask_id(-1, SimpleNamespace(config=SimpleNamespace(vocab_size=10))) == 8  # then the tokenizer
    with pytest.raises(ValueError, match=r"diffusion.mask_id=10 is outside 'some/diffusion''s vocabulary \[0, 10\)"):
        mask_id(10)


def test_a_diffusion_policy_draws_its_scoring_masks_from_the_runs_seed():
    from types import SimpleNamespace

    from aisrl.build import diffusion_params, make_policy
    from aisrl.policy import DiffusionPolicy

    cfg = load_config("diffusion_lab", ["diffusion.mask_id=5", "seed=3", "micro_batch=8"])
    policy = make_policy(cfg, SimpleNamespace(pad_token_id=None, eos_token_id=2))
    assert policy == DiffusionPolicy(diffusion_params(cfg), 5, 0, 2, cfg.diffusion.p_mask, 3, 8)


def test_no_held_out_problem_is_an_error_without_a_warning_about_fewer():
    from aisrl.build import problem_sets

    class Few:  # a dataset with 8 training problems and no test split
        def problems(self, split, n, seed):
            return [Problem(f"q{i}", str(i)) for i in range(8)] if split == "train" else []

    cfg = load_config("lab", [*TINY, "train_problems=8"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an empty split is no "fewer than asked": the error alone says it
        with pytest.raises(ValueError, match="the task gives 8 training and 0 held-out problems"):
            problem_sets(cfg, Few())


@pytest.mark.parametrize("preset", ["lab", "diffusion_lab"])
def test_a_checkpoints_model_is_built_without_training_a_warm_start(tmp_path, monkeypatch, preset):
    """Scoring a checkpoint (eval, the doctor's start=, a study's final scores) replaced a warm start trained for the
    purpose, minutes on an empty cache (found by review): the architecture is built untrained and loaded."""
    from safetensors.torch import save_file

    import aisrl.diffusion_lab
    import aisrl.lab
    from aisrl.build import build_trained

    extra = ["lab.sft_steps=0"] if preset == "lab" else ["lab.hidden=32", "lab.layers=1", "lab.sft_steps=0"]
    cfg = load_config(preset, [*(TINY_LAB if preset == "lab" else []), *extra])
    trained = build(cfg, warm=False)[0]
    state = {k: v + 0.5 for k, v in trained.state_dict().items()}  # weights no build would give
    save_file(state, tmp_path / "model.safetensors")
    for module in (aisrl.lab, aisrl.diffusion_lab):
        monkeypatch.setattr(module, "run_sft", lambda *a, **k: pytest.fail("trained a warm start"))
    model = build_trained(cfg, tmp_path / "model.safetensors")[0]
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, state[k], msg=k)
    assert not (tmp_path / "cache").exists()  # and nothing untrained was cached as a warm start


def test_a_lab_run_whose_answers_cannot_fit_is_warned(tmp_path):
    """A 16-token lab run scored 0% where its warm start scored 11% (found by review): its rollouts and greedy
    evaluations stopped inside the worked answers. The lab's tokenizer gives a token per character and per format
    tag, so an answer's length is its text's, less each tag's characters but one, plus the EOS."""
    from aisrl.build import cut_short, task_of
    from aisrl.lab import CharTokenizer, completion_text
    from aisrl.trainer import train

    cfg = load_config("lab", TINY)
    problems = task_of(cfg).problems("train", 20, seed=0)
    tags = ("<reasoning>", "</reasoning>", "<answer>", "</answer>")
    texts = [completion_text(p) for p in problems]
    assert all(text.count(tag) == 1 for text in texts for tag in tags)
    need = max(len(text) for text in texts) - sum(len(tag) - 1 for tag in tags) + 1
    tok = CharTokenizer()
    cfg.rollout.max_new_tokens = need
    assert cut_short(cfg, tok, problems) is None
    cfg.rollout.max_new_tokens = need - 1
    said = cut_short(cfg, tok, problems)
    assert f"rollout.max_new_tokens={need - 1} is shorter than the lab task's longest worked answer ({need} " in said
    cfg.model.kind = "diffusion"
    assert cut_short(cfg, tok, problems) is None  # the diffusion lab refuses such a length instead
    lines = []
    train(load_config("lab", [*TINY, "max_steps=1", f"output_dir={tmp_path / 'r'}"]), log=lines.append)
    assert any("rollout.max_new_tokens=8 is shorter" in line for line in lines)


def test_a_diffusion_checkpoint_is_not_scored_with_a_generation_length_its_answers_do_not_fit():
    """Building untrained for a checkpoint skipped the diffusion lab's length check (found by review): an eval with
    rollout.max_new_tokens=16 would score every cut-short answer 0. The check comes before any model is returned."""
    cfg = load_config("diffusion_lab", ["lab.hidden=32", "lab.layers=1", "lab.sft_steps=0",
                                        "rollout.max_new_tokens=16"])  # fmt: skip
    for warm in (False, True):
        with pytest.raises(ValueError, match="rollout.max_new_tokens=16 .* is shorter than the lab task's completions"):
            build(cfg, warm=warm)
