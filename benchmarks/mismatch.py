"""Mismatch table for SmolLM2-135M-Instruct per rollout format (issue 3): writes
benchmarks/results/mismatch_smollm2.json, runs/mismatch_smollm2/logratio_hist.png and the `mismatch`
section of BENCHMARKS.md.

    python benchmarks/mismatch.py [prompts=16 max_new_tokens=64 ...]
"""

import sys
from pathlib import Path

from aisrl.bench.report import update_section, write_json
from aisrl.config import apply_overrides
from aisrl.doctor import DoctorConfig, main, table

ROOT = Path(__file__).resolve().parent.parent
FORMATS = ["bf16", "fp8_e4m3_tensor", "fp8_e4m3", "fp8_e4m3_block", "fp8_e4m3_tensor_w8a8", "fp8_e4m3_w8a8",
           "fp8_e4m3_block_w8a8", "fp8_e4m3_w8a8_kv", "fp8_e5m2", "fp8_e5m2_w8a8", "int8_w8a8", "int4", "mxfp4",
           "nvfp4"]  # fmt: skip

if __name__ == "__main__":
    cfg = apply_overrides(DoctorConfig(model="smollm2", formats=FORMATS), sys.argv[1:])
    result = main(cfg, ROOT / "runs/mismatch_smollm2")
    slim = {f: {k: v for k, v in r.items() if k != "log_ratios"} for f, r in result.items()}
    write_json(ROOT / "benchmarks/results/mismatch_smollm2.json", {"config": cfg.__dict__, "formats": slim})
    cmd = "python benchmarks/mismatch.py" + "".join(f" {a}" for a in sys.argv[1:])
    body = (
        f"Command: `{cmd}` (= `aisrl mismatch --model smollm2 --formats ...`), {cfg.prompts} arithmetic prompts "
        f"x {cfg.max_new_tokens} sampled tokens at temperature {cfg.temperature}, seed {cfg.seed}; 2 CPUs, FP32 "
        "trainer vs fake-quantised rollout copy (lm_head kept in full precision). `sync_seconds`: one "
        "`sync_weights` of the full model.\n\n" + table(slim)
    )
    update_section(ROOT / "BENCHMARKS.md", "mismatch", body)
