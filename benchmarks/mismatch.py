"""Mismatch tables per rollout format (issues 3, 4, 7): SmolLM2-135M-Instruct by default, or the model a
training preset trains (the causal lab model, the diffusion lab model). Writes
benchmarks/results/mismatch_<subject>.json, runs/mismatch_<subject>/logratio_hist.png and the
`mismatch` (SmolLM2) or `mismatch_<preset>` section of BENCHMARKS.md. Settings other than those of a published
section (PUBLISHED; a smoke run, say) add a hash of them to these names, leaving the published figures alone.

    python benchmarks/mismatch.py [prompts=16 max_new_tokens=64 ...]
    python benchmarks/mismatch.py preset=diffusion_lab prompts=64
"""

import sys
from dataclasses import asdict
from pathlib import Path

from aisrl.bench.cli import command
from aisrl.bench.report import machine, machine_line, settings_tag, update_section, write_json
from aisrl.config import apply_overrides
from aisrl.doctor import DoctorConfig, main, table

ROOT = Path(__file__).resolve().parent.parent
FORMATS = ["bf16", "bf16_w16a16", "fp8_e4m3_tensor", "fp8_e4m3", "fp8_e4m3_block", "fp8_e4m3_tensor_w8a8",
           "fp8_e4m3_w8a8", "fp8_e4m3_block_w8a8", "fp8_e4m3_w8a8_kv", "fp8_e5m2", "fp8_e5m2_w8a8", "int8_w8a8", "int4",
           "mxfp4", "nvfp4"]  # fmt: skip
LAB_FORMATS = FORMATS + ["mxfp4_w4a4", "nvfp4_w4a4"]  # the harsh settings of the comparison study
PUBLISHED = [{}, {"preset": "lab", "prompts": 64}, {"preset": "diffusion_lab", "prompts": 64},
             {"preset": "lab_columns", "prompts": 256}]  # BENCHMARKS.md's sections: the settings off the defaults


def default_formats(preset: str) -> list[str]:
    """The formats a run measures unless `formats=` is given: FORMATS for a model, LAB_FORMATS for a training preset,
    without the KV-cache presets for a diffusion model's (no cache: the doctor refuses them)."""
    if not preset:
        return FORMATS
    from aisrl.quant import quant_config
    from aisrl.train_config import load_config

    diffusion = load_config(preset).model.kind == "diffusion"
    return [f for f in LAB_FORMATS if not (diffusion and quant_config(f).kv_cache)]


def tagged(cfg: DoctorConfig, subject: str) -> str:
    """`subject`, with a hash of the settings where they are not those of a PUBLISHED section."""
    default = DoctorConfig(model="smollm2", formats=default_formats(cfg.preset))
    changed = {k: v for k, v in asdict(cfg).items() if v != asdict(default)[k]}
    digest = settings_tag(changed, PUBLISHED)
    return f"{subject}_{digest}" if digest else subject


if __name__ == "__main__":
    cfg = apply_overrides(DoctorConfig(model="smollm2", formats=FORMATS), sys.argv[1:])
    if cfg.preset and cfg.formats == FORMATS and not any(a.startswith("formats=") for a in sys.argv[1:]):
        cfg.formats = default_formats(cfg.preset)
    if cfg.start:
        sys.exit("start=RUN:STEP examines a run's checkpoint: use `aisrl mismatch start=...` (or benchmarks/"
                 "mixed_precision.py); this script publishes the figures of a preset's or a model's initial weights")
    subject = tagged(cfg, Path(cfg.preset).stem if cfg.preset else Path(cfg.model).name)
    result = main(cfg, ROOT / f"runs/mismatch_{subject}")
    slim = {f: {k: v for k, v in r.items() if k != "log_ratios"} for f, r in result.items()}
    cmd = command(__file__)
    write_json(ROOT / f"benchmarks/results/mismatch_{subject}.json",
               {"config": cfg.__dict__, "formats": slim, "machine": machine(), "command": cmd})  # fmt: skip
    if cfg.preset:
        what = (f"the `{cfg.preset}` training preset's model, {cfg.prompts} of its training prompts, its sampling "
                f"settings (one completion each), seed {cfg.seed}")  # fmt: skip
        alias = f"aisrl mismatch --preset {cfg.preset} --formats ..."
    else:
        what = (f"{cfg.prompts} arithmetic prompts x {cfg.max_new_tokens} sampled tokens at temperature "
                f"{cfg.temperature}, seed {cfg.seed}")  # fmt: skip
        alias = f"aisrl mismatch --model {cfg.model} --formats ..."
    body = (
        f"Command: `{cmd}` (= `{alias}`), {what}; {machine_line()}, FP32 trainer vs fake-quantised rollout copy "
        "(lm_head kept in full precision). `sync_seconds`: one `sync_weights` of the full model.\n\n" + table(slim)
    )
    default = not cfg.preset and subject == "smollm2"  # the headline section keeps its first name
    update_section(ROOT / "BENCHMARKS.md", "mismatch" + ("" if default else f"_{subject}"), body)
