"""Our GRPO step beside TRL's `GRPOTrainer` on SmolLM2-135M-Instruct, same model, batch and lengths (issue 4).

    python benchmarks/trl_step_time.py [steps]

Workload: the `smollm2_arithmetic` preset's: 8 arithmetic prompts x 8 completions of up to 96 tokens at
temperature 0.7, chat template, lenient reward, micro-batches of 16, one optimizer step per batch, FP32 on the
CPU. Variants, all in one process, one after the other:
- `trl`: trl.GRPOTrainer as shipped (HF generate; with one PPO epoch it reuses the training forward for the
  old log-probs, so it does no separate recompute);
- `aisrl fp32`: our trainer with full-precision rollouts, no correction, old log-probs recomputed;
- `aisrl fp32 bypass`: the same with `correction.bypass=true` (the engine's log-probs serve as old log-probs:
  the work TRL does);
- `aisrl fp8 + ais`: the preset as shipped (FP8 W8A8 rollouts, AIS).
Ours sample with the preset's static-cache engine (`rollout.engine=static`) and score micro-batches of rows
of similar length cut to their own width (`aisrl.rollout.length_order`). Mean seconds per optimizer step over
`steps` steps (each step generates its own batch, so completion lengths differ between trainers: the table
lists them). Writes benchmarks/results/trl_step_time.json and the `trl_step_time` section of BENCHMARKS.md.
"""

import json
import os
import shutil
import sys
from pathlib import Path

from aisrl.bench.report import machine, machine_line, step_timer, update_section, write_json

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
ROOT = Path(__file__).resolve().parent.parent
PRESET = "smollm2_arithmetic"
SHARED = ["prompts_per_step=8", "group_size=8", "eval_every=100000", "checkpoint_every=100000", "device=cpu"]
OURS = {
    "aisrl fp32": ["rollout.quant=none", "correction.name=none"],
    "aisrl fp32 bypass": ["rollout.quant=none", "correction.name=none", "correction.bypass=true"],
    "aisrl fp8 + ais": [],
}


def run_trl(steps: int) -> tuple[list[float], list[float]]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from aisrl.build import build
    from aisrl.models import plain_copy
    from aisrl.tasks import INSTRUCTION
    from aisrl.train_config import load_config

    cfg = load_config(PRESET, SHARED)
    model, tok, task, _ = build(cfg)
    model = plain_copy(model)  # the GGUF-loaded model carries quantiser marks that HF's Trainer refuses to train
    problems = task.problems("train", cfg.prompts_per_step * steps, seed=0)
    by_question = {p.question: p for p in problems}
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"{p.question}\n{INSTRUCTION}"}] for p in problems],
                            "question": [p.question for p in problems]})  # fmt: skip

    def reward(prompts, completions, question, **kw):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [task.reward(t, by_question[q])[0] for t, q in zip(texts, question, strict=True)]

    timer, times = step_timer()
    from transformers import TrainerCallback

    class Lengths(TrainerCallback):  # TRL logs each step's mean completion length
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    lengths: list[float] = []

    n = cfg.prompts_per_step * cfg.group_size
    args = GRPOConfig(output_dir="/tmp/aisrl_trl_step", use_cpu=True, bf16=False, gradient_checkpointing=False,
                      per_device_train_batch_size=cfg.micro_batch, gradient_accumulation_steps=n // cfg.micro_batch,
                      num_generations=cfg.group_size, max_completion_length=cfg.rollout.max_new_tokens,
                      temperature=cfg.rollout.temperature, learning_rate=cfg.lr, beta=0.0, max_steps=steps,
                      logging_steps=1, report_to="none", save_strategy="no", seed=0, disable_tqdm=True,
                      shuffle_dataset=False)  # fmt: skip
    GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok,
                callbacks=[timer, Lengths()]).train()  # fmt: skip
    return times, lengths


def run_ours(name: str, steps: int) -> dict:
    from aisrl.train_config import load_config
    from aisrl.trainer import train

    out = ROOT / f"runs/trl_step_time/{name.replace(' ', '_').replace('+', 'plus')}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = load_config(PRESET, [*SHARED, *OURS[name], f"max_steps={steps}", f"output_dir={out}"])
    seconds = train(cfg, log=lambda _: None)["seconds_per_step"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return seconds, [row["completion_len"] for row in rows]


def main(steps: int = 2):
    phases = ["time_rollout", "time_sync", "time_logprob", "time_correction", "time_train"]
    trl_times, trl_lengths = run_trl(steps)
    res = {"trl": {"step": sum(trl_times) / len(trl_times), "steps": trl_times, "completion_len": trl_lengths}}
    for name in OURS:
        sec, lengths = run_ours(name, steps)
        res[name] = {"step": sum(sec[p] for p in phases), **{p[5:]: sec[p] for p in phases}, "completion_len": lengths}
    base = res["trl"]["step"]
    for name, r in res.items():
        print(f"{name:>18}: {r['step']:.1f} s/step ({r['step'] / base:.2f}x TRL)")
    m = machine()
    write_json(ROOT / "benchmarks/results/trl_step_time.json", {"steps": steps, "machine": m, "results": res})
    lines = ["| trainer | s/step | vs TRL | rollout | log-prob recompute | train | mean completion tokens per step |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in res.items():
        split = " | ".join(f"{r[k]:.1f}" if k in r else "-" for k in ("rollout", "logprob", "train"))
        lens = ", ".join(f"{x:.1f}" for x in r["completion_len"])
        lines.append(f"| {name} | {r['step']:.1f} | {r['step'] / base:.2f}x | {split} | {lens} |")
    body = (f"Command: `python benchmarks/trl_step_time.py {steps}`  \nMachine: {machine_line(m)}. "
            f"SmolLM2-135M-Instruct FP32, 8 prompts x 8 completions, <= 96 new tokens, "
            f"micro-batch 16; mean of {steps} optimizer steps per trainer.\n\n" + "\n".join(lines))  # fmt: skip
    update_section(ROOT / "BENCHMARKS.md", "trl_step_time", body)


if __name__ == "__main__":
    if len(sys.argv) > 2 or not all(a.isdigit() and int(a) > 0 for a in sys.argv[1:]):
        sys.exit(f"usage: python benchmarks/trl_step_time.py [STEPS] (positive, default 2); got {sys.argv[1:]}")
    main(*(int(a) for a in sys.argv[1:]))
