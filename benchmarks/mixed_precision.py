"""Mixed-precision rollouts: which linear layers to keep in full precision, and what keeping them buys.

For a training preset's model and each rollout format: rank the quantised layers by the mismatch left when each
alone is kept in full precision (aisrl.doctor.layer_sensitivity, on the samples of the fully quantised copy), then
measure, on completions each mixed copy samples itself, the rollout/trainer mismatch of copies that keep the top
1, 2, 4, ... layers of that ranking, against the share of the quantisable weights (and GEMM FLOPs per token) they
keep. Writes benchmarks/results/mixed_precision_<preset>.json and the `mixed_precision_<preset>` section of
BENCHMARKS.md (`<preset>_<hash>` for settings other than a published section's: a smoke run, another seed).

    python benchmarks/mixed_precision.py [preset=lab_columns "formats=[nvfp4_w4a4,mxfp4_w4a4]" "tops=[1,2,4,8]"]
    python benchmarks/mixed_precision.py preset= model=smollm2 prompts=16
    python benchmarks/mixed_precision.py preset= start=runs/x/nvfp4_w4a4/ais/seed42:100 "formats=[nvfp4_w4a4]"

The single-layer effects need not add up (rounding errors of two layers can cancel), which is why each kept set is
measured, not predicted. A kept set is then trained with `rollout.keep=[...]`.
"""

import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from aisrl.bench.cli import command
from aisrl.bench.report import machine, machine_line, settings_tag, update_section, write_json
from aisrl.config import apply_overrides
from aisrl.doctor import DoctorConfig, diagnose

ROOT = Path(__file__).resolve().parent.parent
SHOWN = ["k3_kl", "ess", "logprob_abs_diff_mean", "ratio_frac_below_half", "chi2_token"]


@dataclass
class MixedConfig:
    preset: str = "lab_columns"
    """Training preset whose model, prompts and sampling settings are examined ('' with `model`)."""
    model: str = ""
    """Examine this model instead (smollm2, tiny-*, a local directory) on the doctor's arithmetic prompts, 64 tokens."""
    formats: list[str] = field(default_factory=lambda: ["nvfp4_w4a4", "mxfp4_w4a4"])
    """Rollout formats (aisrl.quant.PRESETS)."""
    prompts: int = 256
    """Prompts per measurement (one completion each)."""
    tops: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    """Kept sets to measure: the top k layers of each format's ranking, for each k."""
    seed: int = 0
    """Seed of the prompts and samples (the same for every kept set)."""
    start: str = ""
    """RUN:STEP: examine a training run's policy at that checkpoint instead (preset=''), with the run's settings and
    training prompts (aisrl.doctor's `start`): where the mismatch sits after training has moved the policy."""


PUBLISHED = [{},
             {"preset": "", "model": "smollm2", "formats": ["fp8_e4m3_w8a8"], "prompts": 16, "tops": [1, 2, 4, 8, 16]},
             {"preset": "", "formats": ["nvfp4_w4a4"], "tops": [1, 2, 4]}]  # fmt: skip
"""BENCHMARKS.md's sections: their settings off the defaults (a run's `start` names its own)."""


def subject(cfg: MixedConfig) -> str:
    """Name of the results: the preset's, the model's, or the run's (study_format_method_seed_step), with a hash of
    the settings where they are not those of a PUBLISHED section (a smoke run, another seed)."""
    if cfg.start:
        run, _, step = cfg.start.rpartition(":")
        name = "_".join(Path(run).parts[-4:]) + f"_step{step}"
    else:
        name = Path(cfg.preset).stem if cfg.preset else Path(cfg.model).name
    default = asdict(MixedConfig())
    changed = {k: v for k, v in asdict(cfg).items() if v != default[k] and k != "start"}
    digest = settings_tag(changed, PUBLISHED)
    return f"{name}_{digest}" if digest else name


def study(cfg: MixedConfig) -> dict:
    """{format: {"ranking": [...], "sets": [{"keep": [...], metrics...}, ...]}}, the first set keeping nothing."""
    if bool(cfg.preset) + bool(cfg.model) + bool(cfg.start) != 1:
        raise ValueError("give a training preset (preset=...), a model (preset='' model=...) or a run's checkpoint "
                         "(preset='' start=RUN:STEP): one, not several or none")  # fmt: skip
    source = {"preset": cfg.preset} if cfg.preset else {"model": cfg.model} if cfg.model else {"start": cfg.start}
    base = DoctorConfig(**source, formats=cfg.formats, prompts=cfg.prompts, seed=cfg.seed)
    ranked = diagnose(replace(base, per_layer=True))
    out = {}
    for fmt in cfg.formats:
        ranking = ranked[fmt]["per_layer"]
        sets = [{"keep": [], **{k: v for k, v in ranked[fmt].items() if k not in ("per_layer", "log_ratios")}}]
        for k in sorted({min(t, len(ranking) - 1) for t in cfg.tops if t > 0}):
            keep = [row["layer"] for row in ranking[:k]]
            r = diagnose(replace(base, formats=[fmt], keep=keep))[fmt]
            sets.append({"keep": keep, **{m: v for m, v in r.items() if m != "log_ratios"}})
        out[fmt] = {"ranking": ranking, "sets": sets}
    return out


def table(result: dict) -> str:
    head = "| format | layers kept | share of weights kept | " + " | ".join(SHOWN) + " |\n|" + "---|" * (len(SHOWN) + 3)
    rows = []
    for fmt, r in result.items():
        for s in r["sets"]:
            rows.append(f"| {fmt} | {len(s['keep'])} | {s['kept_weights']:.1%} | "
                        + " | ".join(f"{s[m]:.4g}" for m in SHOWN) + " |")  # fmt: skip
    return head + "\n" + "\n".join(rows) + "\n"


if __name__ == "__main__":
    cfg = apply_overrides(MixedConfig(), sys.argv[1:])
    if not cfg.tops or min(cfg.tops) < 1:
        sys.exit(f"tops={cfg.tops}: give the numbers of top layers to keep, each >= 1, e.g. tops=[1,2,4]")
    result = study(cfg)
    name = subject(cfg)
    result_machine = machine()
    write_json(ROOT / f"benchmarks/results/mixed_precision_{name}.json",
               {"config": cfg.__dict__, "machine": result_machine, "formats": result})  # fmt: skip
    cmd = command(__file__)
    top = max(cfg.tops)
    order = "\n".join(f"- {fmt}: " + ", ".join(f"{x['layer']} ({x['removed']:.0%})" for x in r["ranking"][:top])
                      for fmt, r in result.items())  # fmt: skip
    what = (f"the `{cfg.preset}` preset's model, {cfg.prompts} of its training prompts" if cfg.preset else
            f"the policy of `{cfg.start}`, {cfg.prompts} of its training prompts" if cfg.start else
            f"{cfg.model}, {cfg.prompts} arithmetic prompts x 64 sampled tokens")  # fmt: skip
    body = (f"Command: `{cmd}`; {what}, one completion each, seed {cfg.seed}; {machine_line(result_machine)}, "
            "FP32. Each row keeps the top k layers of its format's ranking in full precision and is measured on the "
            "completions that mixed copy samples. The ranking (share of the token mismatch each layer removes when "
            f"kept alone):\n{order}\n\n{table(result)}")  # fmt: skip
    update_section(ROOT / "BENCHMARKS.md", f"mixed_precision_{name}", body)
    print(table(result))
