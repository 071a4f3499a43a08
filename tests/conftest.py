"""Shared test settings."""

import json
from pathlib import Path

# A lab run small enough for tests: a 1-layer width-32 model, no SFT, 4 prompts x 4 samples, 8 tokens.
TINY_LAB = ["lab.hidden=32", "lab.layers=1", "lab.sft_steps=0", "prompts_per_step=4", "group_size=4",
            "rollout.max_new_tokens=8", "eval_problems=8", "train_problems=64"]  # fmt: skip


def overriding(base: list[str], *items: str) -> list[str]:
    """`base` overrides with `items` in place of the keys they give: the command line refuses a key given twice."""
    keys = {item.split("=", 1)[0] for item in items}
    return [o for o in base if o.split("=", 1)[0] not in keys] + list(items)


def untimed(row: dict) -> dict:
    """A metrics row without its seconds (every time_* key), which differ between two runs of the same steps."""
    return {k: v for k, v in row.items() if not k.startswith("time_")}


def load_benchmark(name: str):
    """A script of benchmarks/ (not a package) imported as a module, for tests of its functions."""
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent.parent / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


def loud_pad(model, pad_id: int = 0):
    """`model` with its first layer's keys for token `pad_id` ~30x the largest of any other token's: an FP8 KV scale
    that took the padding's keys into its amax would round every real key coarsely. Hidden dimension 0 is zeroed in
    every other embedding and carries the pad's whole norm (RMSNorm keeps a token's direction, not its scale)."""
    import torch

    with torch.no_grad():
        embed = model.get_input_embeddings().weight  # (V, hidden)
        embed[:, 0] = 0
        embed[pad_id] = 0
        embed[pad_id, 0] = 1
        k_proj = model.model.layers[0].self_attn.k_proj.weight  # (Hk * D, hidden)
        k_proj[:, 0] = 30 * k_proj.abs().max()
    return model


def write_run(path, rows):
    """A run folder holding `rows` as its metrics.jsonl, as a training run writes them."""
    import json

    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def varying_reward(self, text, problem):
    """A stand-in for Task.reward that varies within a group (by the completion's length), so a step has advantages
    and moves the weights; never correct."""
    return float(len(text) % 3), False


def local_model_and_rows(root: Path, n: int = 40) -> Path:
    """A tiny Llama saved with a word tokenizer (a user's local model, trainable in a second) and a JSONL file."""
    from aisrl.models import save_model, tiny_model, word_tokenizer

    save_model(tiny_model("tiny-llama"), root / "m", word_tokenizer(200))
    data = root / "d.jsonl"
    data.write_text("".join(json.dumps({"question": f"w{i} w{i + 1}?", "answer": str(i)}) + "\n" for i in range(n)))
    return data

