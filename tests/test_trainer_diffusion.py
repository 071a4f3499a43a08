"""GRPO on a masked-diffusion policy: a real 2-step run through the same trainer, corrections and outputs."""

import json

import pytest
from conftest import overriding, varying_reward

from aisrl.cli import main

TINY = ["model.kind=diffusion", "lab.task=sudoku4", "lab.hidden=32", "lab.layers=1", "lab.sft_steps=0",
        "prompts_per_step=4", "group_size=4", "rollout.max_new_tokens=40", "diffusion.block_length=8",
        "diffusion.steps=5", "eval_problems=4", "train_problems=16", "max_steps=2", "eval_every=2"]  # fmt: skip


@pytest.fixture(autouse=True)
def setup(tmp_path, monkeypatch):
    monkeypatch.setenv("AISRL_CACHE", str(tmp_path / "cache"))
    # an untrained policy never solves a Sudoku: a reward that varies with the text gives real gradients
    monkeypatch.setattr("aisrl.tasks.Sudoku4.reward", varying_reward)


def rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_grpo_steps_with_fp8_rollouts_and_ais(tmp_path):
    out = tmp_path / "fp8"
    assert main(["train", "lab", *TINY, "rollout.quant=fp8_e4m3_w8a8", "correction.name=ais", f"output_dir={out}"]) == 0
    r = rows(out)
    assert [x["step"] for x in r] == [1, 2]
    assert all(x["k3_kl"] > 0 and 0 <= x["alpha"] <= 1 and x["grad_norm"] > 0 for x in r)
    assert "eval_accuracy" in r[-1] and (out / "summary.json").exists()


def test_identical_rollout_and_trainer_give_weights_of_exactly_one(tmp_path):
    out = tmp_path / "fp32"
    assert main(["train", "lab", *TINY, "rollout.quant=none", "correction.name=tis", f"output_dir={out}"]) == 0
    for x in rows(out):
        assert x["k3_kl"] == 0 and x["is_weight_min"] == 1 and x["is_weight_max"] == 1


def test_bad_diffusion_geometry_is_named(tmp_path, capsys):
    assert main(["train", "lab", *overriding(TINY, "diffusion.block_length=7"), f"output_dir={tmp_path}"]) == 2
    assert "multiple of block_length=7" in capsys.readouterr().err
    # settings the diffusion sampler and its d1 log-probs would ignore or misread are refused, naming the key
    assert main(["train", "lab", *TINY, "rollout.top_p=0.9", f"output_dir={tmp_path}"]) == 2
    assert "leave rollout.top_k=0 and rollout.top_p=1" in capsys.readouterr().err
    assert main(["train", "lab", *TINY, "diffusion.p_mask=1.5", f"output_dir={tmp_path}"]) == 2
    assert "diffusion.p_mask is a probability" in capsys.readouterr().err
    assert main(["train", "lab", *TINY, "rollout.temperature=0", f"output_dir={tmp_path}"]) == 2  # before: argmax
    assert "rollout.temperature=0.0: training samples, so it must be > 0" in capsys.readouterr().err
    assert main(["train", "lab", *TINY, "rollout.quant=fp8_e4m3_w8a8_kv", f"output_dir={tmp_path}"]) == 2
    assert "which a diffusion model (bidirectional, no cache) does not have" in capsys.readouterr().err
    for bad in ("3", "-2"):  # the lab's [MASK] id is its tokenizer's (before: 3 sampled the real [MASK], IndexError)
        assert main(["train", "lab", *TINY, f"diffusion.mask_id={bad}", f"output_dir={tmp_path}"]) == 2
        assert f"diffusion.mask_id={bad}: -1 (the model's own [MASK] id" in capsys.readouterr().err


CONFIG_CODE = """
from transformers import PretrainedConfig


class TinyMDMConfig(PretrainedConfig):
    model_type = "tinymdm"

    def __init__(self, vocab_size=64, hidden=32, layers=1, mask_token_id=None, **kwargs):
        self.vocab_size, self.hidden, self.layers, self.mask_token_id = vocab_size, hidden, layers, mask_token_id
        super().__init__(**kwargs)
"""
MODEL_CODE = """
from transformers import PreTrainedModel
from transformers.modeling_outputs import MaskedLMOutput

from aisrl.diffusion import MaskedDiffusionLM

from .configuration_tinymdm import TinyMDMConfig


class TinyMDM(PreTrainedModel):
    config_class = TinyMDMConfig

    def __init__(self, config):
        super().__init__(config)
        self.net = MaskedDiffusionLM(config.vocab_size, config.mask_token_id, config.hidden, config.layers)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, **kwargs):
        return MaskedLMOutput(logits=self.net(input_ids, attention_mask).logits)
"""


def remote_code_checkpoint(path):
    """A LLaDA-format directory: config.json with an auto_map into modeling code that ships in the directory."""
    import importlib.util
    import sys

    from aisrl.models import word_tokenizer

    path.mkdir()
    (path / "configuration_tinymdm.py").write_text(CONFIG_CODE)
    (path / "modeling_tinymdm.py").write_text(MODEL_CODE)
    pkg = f"tinymdm_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(pkg, path / "__init__.py", submodule_search_locations=[str(path)])
    (path / "__init__.py").write_text("")
    sys.modules[pkg] = importlib.util.module_from_spec(spec)
    from importlib import import_module

    cfg_cls = import_module(f"{pkg}.configuration_tinymdm").TinyMDMConfig
    model_cls = import_module(f"{pkg}.modeling_tinymdm").TinyMDM
    config = cfg_cls(mask_token_id=63, auto_map={"AutoConfig": "configuration_tinymdm.TinyMDMConfig",
                                                 "AutoModel": "modeling_tinymdm.TinyMDM"})  # fmt: skip
    model_cls(config).save_pretrained(path)
    (path / "__init__.py").unlink()
    word_tokenizer(60).save_pretrained(path)


def test_llada_format_checkpoint_trains_through_the_same_cli(tmp_path):
    ckpt = tmp_path / "tiny-llada"
    remote_code_checkpoint(ckpt)
    from aisrl.diffusion import load_diffusion_model

    assert load_diffusion_model(str(ckpt)).config.mask_token_id == 63
    out = tmp_path / "run"
    args = ["train", f"model.name={ckpt}", "model.kind=diffusion", "task=sudoku4", "rollout.max_new_tokens=8",
            "diffusion.block_length=4", "diffusion.steps=2", "prompts_per_step=2", "group_size=2",
            "eval_problems=2", "train_problems=4", "max_steps=1", "eval_every=1",
            "rollout.quant=fp8_e4m3_w8a8", "correction.name=ais", f"output_dir={out}"]  # fmt: skip
    assert main(args) == 0
    (row,) = rows(out)
    assert row["k3_kl"] > 0 and row["num_tokens"] > 0 and 0 <= row["alpha"] <= 1


def test_diffusion_checkpoint_without_a_mask_id_is_named(tmp_path, capsys):
    ckpt = tmp_path / "tiny-llada"
    remote_code_checkpoint(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["mask_token_id"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    args = [
        "train",
        f"model.name={ckpt}",
        "model.kind=diffusion",
        "task=sudoku4",
        "rollout.max_new_tokens=8",
        "diffusion.block_length=4",
        "diffusion.steps=2",
        "max_steps=1",
        f"output_dir={tmp_path / 'run'}",
    ]
    assert main(args) == 2
    assert "set diffusion.mask_id (LLaDA-8B uses 126336)" in capsys.readouterr().err
    assert main([*args, "diffusion.mask_id=100000"]) == 2  # past the vocabulary (before: an embedding IndexError)
    assert "diffusion.mask_id=100000 is outside" in capsys.readouterr().err


def test_a_long_completion_widens_the_diffusion_lab_model_and_the_default_keeps_its_width(tmp_path):
    # the model was built with 128 positions whatever the completion length: 128 new tokens failed in the warm start
    from aisrl.build import build
    from aisrl.train_config import load_config

    short = build(load_config("lab", [*TINY, f"output_dir={tmp_path / 's'}"]))[0]
    assert short.pos.num_embeddings == 128  # the width every earlier warm start had
    args = [*TINY, "rollout.max_new_tokens=128", "diffusion.block_length=32", "diffusion.steps=8"]
    model, tok, task, encode = build(load_config("lab", [*args, f"output_dir={tmp_path / 'l'}"]))
    longest = max(len(encode(p)) for p in task.problems("train", 16) + task.problems("test", 4, seed=1))
    assert model.pos.num_embeddings >= longest + 128


def test_a_generation_length_shorter_than_the_lab_answers_names_the_key_to_raise(tmp_path):
    from aisrl.build import build
    from aisrl.train_config import load_config

    args = [*TINY, "lab.task=arithmetic", "rollout.max_new_tokens=16", "diffusion.steps=4", f"output_dir={tmp_path}"]
    with pytest.raises(ValueError, match=r"rollout.max_new_tokens=16 \(the diffusion generation length\) is shorter "
                                         r"than the lab task's completions \(\d+ tokens with EOS\): set "
                                         r"rollout.max_new_tokens=24 or more, a multiple of diffusion.block_length=8"):
        build(load_config("lab", args))  # before: 'gen_length=16 ...', a key no config has
