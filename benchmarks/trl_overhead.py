"""AIS inside TRL: step time of `trl.GRPOTrainer` vs `AISGRPOTrainer` on the same tiny model and batch.

    python benchmarks/trl_overhead.py [steps]

A 4-layer Llama (width 256, 64-token word vocabulary), 32 completions of up to 64 tokens per step, on CPU.
Variants: TRL as shipped (HF generate, no correction); AISGRPOTrainer with correction='none' and a
full-precision aisrl rollout copy (our generator, nothing corrected); with correction='ais' (adds the
trainer-precision old log-prob pass and the correction); and with an FP8 W8A8 rollout copy (adds
fake-quantisation and the weight sync). Median seconds per step over `steps` steps after one warm-up step.
Writes benchmarks/results/trl_overhead.json and the `trl_overhead` section of BENCHMARKS.md.
"""

import os
import statistics
import sys
from pathlib import Path

import torch

from aisrl.bench.report import machine, machine_line, step_timer, update_section, write_json

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
ROOT = Path(__file__).resolve().parent.parent


def setup():
    from datasets import Dataset

    from aisrl.models import tiny_model, word_tokenizer

    tok = word_tokenizer(61)
    model = tiny_model("tiny-llama", vocab_size=64, hidden=256, layers=4)
    g = torch.Generator().manual_seed(0)
    prompts = [" ".join(f"w{i}" for i in torch.randint(0, 61, (8,), generator=g).tolist()) for _ in range(64)]
    return model, tok, Dataset.from_dict({"prompt": prompts})


def reward(prompts, completions, **kwargs):
    return [float(c.count("w5")) for c in completions]


def run(variant: str, steps: int) -> float:
    from trl import GRPOConfig, GRPOTrainer

    from aisrl.integrations.trl import AISGRPOTrainer

    model, tok, ds = setup()
    args = GRPOConfig(output_dir=f"/tmp/aisrl_trl_bench/{variant}", use_cpu=True, bf16=False,
                      gradient_checkpointing=False, per_device_train_batch_size=32, num_generations=8,
                      max_completion_length=64, max_steps=steps + 1, logging_steps=1, report_to="none",
                      save_strategy="no", learning_rate=1e-4, seed=0, disable_tqdm=True)  # fmt: skip
    cb, times = step_timer()
    kw = {"model": model, "reward_funcs": reward, "args": args, "train_dataset": ds, "processing_class": tok,
          "callbacks": [cb]}  # fmt: skip
    if variant == "trl":
        tr = GRPOTrainer(**kw)
    else:
        correction, quant = {"aisrl-none": ("none", "none"), "aisrl-ais": ("ais", "none"),
                             "aisrl-ais-fp8": ("ais", "fp8_e4m3_w8a8")}[variant]  # fmt: skip
        tr = AISGRPOTrainer(**kw, correction=correction, rollout_quant=quant)
    tr.train()
    return statistics.median(times[1:])


def main(steps: int = 5):
    variants = ["trl", "aisrl-none", "aisrl-ais", "aisrl-ais-fp8"]
    res = {v: run(v, steps) for v in variants}
    for v, s in res.items():
        print(f"{v:>14}: {s:.3f} s/step ({s / res['trl']:.2f}x TRL)")
    data = {"seconds_per_step": res, "steps": steps, "machine": machine(),
            "workload": "Llama 4x256, 32 completions x <=64 tokens, 4 prompts x 8 generations"}  # fmt: skip
    write_json(ROOT / "benchmarks/results/trl_overhead.json", data)
    m = machine()
    lines = ["| trainer | s/step | vs TRL |", "|---|---|---|"]
    names = {"trl": "trl.GRPOTrainer (HF generate)", "aisrl-none": "AISGRPOTrainer, none, FP32 copy",
             "aisrl-ais": "AISGRPOTrainer, ais, FP32 copy",
             "aisrl-ais-fp8": "AISGRPOTrainer, ais, FP8 W8A8 copy"}  # fmt: skip
    lines += [f"| {names[v]} | {s:.3f} | {s / res['trl']:.2f}x |" for v, s in res.items()]
    body = (f"Command: `python benchmarks/trl_overhead.py {steps}`  \nMachine: {machine_line(m)}, "
            f"{m['torch_threads']} torch threads. Workload: {data['workload']}; median of "
            f"{steps} steps after a warm-up step.\n\n" + "\n".join(lines))  # fmt: skip
    update_section(ROOT / "BENCHMARKS.md", "trl_overhead", body)


if __name__ == "__main__":
    if len(sys.argv) > 2 or not all(a.isdigit() and int(a) > 0 for a in sys.argv[1:]):
        sys.exit(f"usage: python benchmarks/trl_overhead.py [STEPS] (positive, default 5); got {sys.argv[1:]}")
    main(*(int(a) for a in sys.argv[1:]))
