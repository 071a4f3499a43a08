"""Per-step time breakdown of GRPO (issue 4): rollout, weight sync, log-prob recompute, correction, train, and
train split into forward passes, backward passes and optimizer steps.

    python benchmarks/step_time.py lab        # the lab preset, 20 steps
    python benchmarks/step_time.py lab_fp32   # the same with full-precision rollouts (rollout.quant=none)
    python benchmarks/step_time.py smollm2    # SmolLM2-135M, 8 prompts x 8 samples, 2 steps (slow)

Writes benchmarks/results/step_time_<name>.json and the `step_time_<name>` section of BENCHMARKS.md.
"""

import shutil
import sys
import time
from pathlib import Path

from aisrl.bench.cli import command
from aisrl.bench.report import machine, machine_line, update_section, write_json
from aisrl.report import TRAIN_PARTS
from aisrl.train_config import load_config
from aisrl.trainer import train

ROOT = Path(__file__).resolve().parent.parent
RUNS = {
    "lab": ("lab", ["max_steps=20", "eval_every=1000"]),
    "lab_fp32": ("lab", ["max_steps=20", "eval_every=1000", "rollout.quant=none"]),
    "smollm2": ("smollm2_arithmetic", ["max_steps=2", "eval_every=1000", "prompts_per_step=8", "group_size=8"]),
}
PHASES = ["time_rollout", "time_sync", "time_logprob", "time_correction", "time_train"]

if __name__ == "__main__":
    if len(sys.argv) > 2 or (len(sys.argv) == 2 and sys.argv[1] not in RUNS):
        sys.exit(f"usage: python benchmarks/step_time.py [{'|'.join(RUNS)}] (fixed runs, so that figures compare)")
    name = sys.argv[1] if len(sys.argv) > 1 else "lab"
    preset, overrides = RUNS[name]
    out = ROOT / f"runs/step_time_{name}"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    summary = train(load_config(preset, [*overrides, f"output_dir={out}"]))
    wall = time.perf_counter() - t0
    sec = summary["seconds_per_step"]
    step = sum(sec[p] for p in PHASES)
    result = {
        "preset": preset,
        "overrides": overrides,
        "seconds_per_step": sec,
        "step_total": step,
        "ais_overhead_percent": 100 * sec["time_correction"] / step,
        "wall_seconds": wall,
        "machine": machine(),
        "command": command(__file__, [name]),  # the run named, and the thread count it ran with
    }
    write_json(ROOT / f"benchmarks/results/step_time_{name}.json", result)
    rows = "\n".join(f"| {p[5:]} | {sec[p]:.3f} | {100 * sec[p] / step:.1f}% |" for p in PHASES)
    rows += "".join(f"\n| &nbsp;&nbsp;train: {p[5:]} | {sec[p]:.3f} | {100 * sec[p] / step:.1f}% |"
                    for p in TRAIN_PARTS)  # fmt: skip
    body = (
        f"Command: `{result['command']}` (preset `{preset}` with {' '.join(overrides)}; "
        f"{machine_line(result['machine'])}; mean over steps).\n\n"
        f"| phase | seconds/step | share |\n|---|---|---|\n{rows}\n"
        f"| **step** | **{step:.3f}** | AIS (`correct`) overhead: **{result['ais_overhead_percent']:.2f}%** |\n"
    )
    print(body)
    update_section(ROOT / "BENCHMARKS.md", f"step_time_{name}", body)
