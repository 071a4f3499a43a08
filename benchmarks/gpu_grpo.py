"""GRPO step time on a GPU with BF16 and with FP8 rollouts from the static engine, AIS on (issue 9).

    python benchmarks/gpu_grpo.py [shape=qwen3-1.7b] [steps=4] [new=256] [variants=none,fp8_e4m3_w8a8_kv]
                                  [out=benchmarks/results/gpu_grpo.json]
    python benchmarks/gpu_grpo.py publish [out=...]

The trainer is `aisrl.train` unchanged: lab task and lab tokenizer, 16 prompts x 8 samples, full fine-tuning
with FP32 master weights under BF16 autocast, AdamW, AIS. Only the policy is swapped for a randomly
initialised Qwen3-shaped model with a Qwen-sized vocabulary (151936; ids past the lab's characters decode
to nothing), and EOS is disabled, so every completion has exactly `new` tokens and the two variants do the
same work. Rewards are ~0 (an untrained model): this measures time, not learning. Step 1 (compilation,
graph capture) is excluded from the means. Every variant's settings are checked before the first one runs, and
the results go to OUT.partial, renamed over OUT only once every variant has run.
"""

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from aisrl.bench.cli import command, number, subcommand
from aisrl.bench.report import machine, staged_json, update_section
from aisrl.report import TRAIN_PARTS
from aisrl.train_checks import validate
from aisrl.train_config import load_config

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
}  # fmt: skip
TIMES = ("time_rollout", "time_logprob", "time_correction", "time_train", "time_sync")


def vocab_of(shape: str) -> int:
    """The policy's vocabulary: Qwen's for the Qwen shapes, a small one for the tiny shape."""
    return 512 if shape == "tiny" else 151936


def _patch_build(shape: str, vocab: int):
    """Make aisrl.trainer.build return a random Qwen3-shaped policy with the lab's tokenizer and task."""
    import aisrl.trainer as trainer
    from aisrl.lab import CharTokenizer

    original = trainer.build

    def build(cfg):
        from transformers import AutoModelForCausalLM, Qwen3Config

        _, tok, task, encode = original(cfg)  # the lab's tokenizer, task and prompt encoding (no SFT asked)
        tok.eos_token_id = -1  # never sampled: fixed-length completions
        tok.decode = lambda ids, skip_special_tokens=True: CharTokenizer.decode(tok, [i for i in ids if i < len(tok)])
        torch.manual_seed(cfg.seed)
        torch.set_default_device(cfg.device if cfg.device != "auto" else None)  # initialise on the GPU: fast
        config = Qwen3Config(**SHAPES[shape], vocab_size=vocab, max_position_embeddings=4096, pad_token_id=0,
                             bos_token_id=1, eos_token_id=None)  # fmt: skip
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        torch.set_default_device(None)
        return model, tok, task, encode

    trainer.build = build


def overrides(steps, new, quant, out_dir, device) -> list[str]:
    """The lab preset's settings for one variant's run."""
    return [f"device={device}", "precision=bf16" if device == "cuda" else "precision=fp32",
            "rollout.engine=static", f"rollout.quant={quant}", f"rollout.max_new_tokens={new}",
            "prompts_per_step=16", "group_size=8", "micro_batch=16", f"max_steps={steps}", "eval_problems=4",
            f"eval_every={10 * steps}", f"checkpoint_every={10 * steps}", "lab.sft_steps=0",
            "correction.name=ais", f"output_dir={out_dir}"]  # fmt: skip


def run_one(shape, steps, new, quant, out_dir, device):
    """One variant (in its own process: a finished run's GPU memory is not all returned to the next)."""
    from aisrl.trainer import train

    _patch_build(shape, vocab_of(shape))
    shutil.rmtree(out_dir, ignore_errors=True)  # a fresh run, not a resume
    train(load_config("lab", overrides(steps, new, quant, out_dir, device)), log=lambda _: None)


def summarise(metrics_path) -> dict:
    """Mean seconds per phase over steps 2.. (step 1 compiles and captures graphs), rollout tokens/s, alpha, KL."""
    rows = [json.loads(x) for x in Path(metrics_path).read_text().splitlines()][1:]
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in TIMES}
    mean["step"] = sum(mean.values())
    mean.update({k: sum(r.get(k, 0.0) for r in rows) / len(rows) for k in TRAIN_PARTS})  # parts of time_train
    mean["rollout_tok_s"] = sum(r["num_tokens"] for r in rows) / sum(r["time_rollout"] for r in rows)
    mean["alpha"] = sum(r["alpha"] for r in rows) / len(rows)
    mean["k3_kl"] = sum(r["k3_kl"] for r in rows) / len(rows)
    return mean


def run(shape, steps, new, variants, out_path, device="cuda"):
    """Every variant in turn; `out_path` is replaced only once all have run (the progress is in OUT.partial). The runs
    are scratch, in a temporary folder removed at the end: their metrics are summarised into the JSON, and their final
    checkpoints (weights and AdamW state: about 20 GB for qwen3-1.7b) are not kept."""
    if steps < 2:
        raise ValueError("steps must be >= 2: step 1 (compilation, graph capture) is left out of the means")
    if shape not in SHAPES or not variants:
        raise ValueError(f"shape={shape!r}, variants={variants}: give one of {list(SHAPES)} and at least one variant")
    scratch = Path(tempfile.mkdtemp(prefix="gpu_grpo_"))
    dirs = {quant: scratch / f"gpu_grpo_{shape}_{quant}" for quant in variants}
    for quant, out in dirs.items():  # a bad variant fails here, not after the others have run
        try:
            validate(load_config("lab", overrides(steps, new, quant, out, device)))
        except ValueError as e:
            raise ValueError(f"variant {quant!r}: {e}") from e
    data = {"machine": machine(), "shape": shape, "vocab": vocab_of(shape), "new_tokens": new,
            "steps": steps, "runs": {}, "command": command(__file__)}  # fmt: skip
    try:
        with staged_json(out_path) as save:
            for quant, out in dirs.items():
                args = [f"shape={shape}", f"steps={steps}", f"new={new}", f"variant={quant}", f"dir={out}"]
                subprocess.run([sys.executable, __file__, "one", *args, f"device={device}"], check=True)
                data["runs"][quant] = summarise(out / "metrics.jsonl")
                print(quant, data["runs"][quant], flush=True)
                save(data)
                shutil.rmtree(out, ignore_errors=True)  # the next variant needs the disk
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return data


def publish(out_path):
    data = json.loads(Path(out_path).read_text())
    m = data["machine"]
    base = data["runs"].get("none")
    lines = [f"Command: `{data['command']}`; {m['cuda']}, torch {m['torch']}; random-init {data['shape']}-shaped "
             f"policy (vocabulary {data.get('vocab', 151936)}), lab task, 16 prompts x 8 samples x "
             f"{data['new_tokens']} new tokens (no EOS), "
             "FP32 master weights under BF16 autocast, AIS; means over steps 2.."
             f"{data['steps']} (seconds per step).", "",
             "| rollouts | rollout | old log-probs | train (forward / backward / optimizer) | sync | step "
             "| rollout tok/s | step vs BF16 | alpha | k3 KL |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for quant, r in data["runs"].items():
        name = "BF16 (static engine)" if quant == "none" else quant
        parts = " / ".join(f"{r[k]:.2f}" for k in TRAIN_PARTS) if all(k in r for k in TRAIN_PARTS) else "-"
        vs_bf16 = f"{r['step'] / base['step']:.2f}x" if base else "-"  # without a BF16 run: nothing to compare with
        lines.append(f"| {name} | {r['time_rollout']:.2f} | {r['time_logprob']:.2f} | {r['time_train']:.2f} "
                     f"({parts}) | "
                     f"{r['time_sync']:.3f} | {r['step']:.2f} | {r['rollout_tok_s']:.0f} | "
                     f"{vs_bf16} | {r['alpha']:.3f} | {r['k3_kl']:.2e} |")  # fmt: skip
    if data.get("note"):
        lines += ["", f"Note: {data['note']}."]
    update_section(ROOT / "BENCHMARKS.md", "gpu_grpo", "\n".join(lines))


COMMANDS = {"run": ("shape", "steps", "new", "variants", "out", "device"), "publish": ("out",),
            "one": ("shape", "steps", "new", "variant", "dir", "device")}  # one: a variant's run, started by run


def main(argv: list[str]) -> None:
    what, kw = subcommand(argv, COMMANDS)
    out = kw.get("out", str(ROOT / "benchmarks/results/gpu_grpo.json"))
    if what == "publish":
        publish(out)
    elif what == "one":
        run_one(kw["shape"], number(kw, "steps", None, low=1), number(kw, "new", None, low=1),
                kw["variant"], kw["dir"], kw["device"])
    else:
        run(kw.get("shape", "qwen3-1.7b"), number(kw, "steps", 4, low=1), number(kw, "new", 256, low=1),
            kw.get("variants", "none,fp8_e4m3_w8a8_kv").split(","), out, kw.get("device", "cuda"))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
