"""Estimator-quality benchmark (docs/ais.md section 3): writes benchmarks/results/estimator_N{N}.json (tabular policy;
estimator_{policy}_L{L}_N{N}.json otherwise; `_seed{S}` added for a seed other than 0) and its section of
BENCHMARKS.md (`estimator` for the default settings and seed). A run with settings other than those of a published
section (PUBLISHED) also gets a hash of them in its names, so that a smoke run does not replace published figures.

    python benchmarks/estimator.py [key=value ...]     # e.g. seed=1 groups=4 group_size=4
    python benchmarks/estimator.py policy=markov length=24 groups=32 group_size=8 batches=240 instances=8 \
        "strengths=[0.05,0.1,0.2,0.35]" "methods=[none,tis,prefix_tis,suffix_tis,seq_tis,icepop,ais]" \
        "horizons=[1,10,100]"                          # the published markov section (BENCHMARKS.md)
"""

import sys
from dataclasses import asdict, replace
from pathlib import Path

from aisrl.bench.cli import command
from aisrl.bench.estimator import EstimatorBenchConfig, horizon_markdown, main, markdown
from aisrl.bench.report import settings_tag, update_section
from aisrl.config import apply_overrides

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = EstimatorBenchConfig()
PUBLISHED = [  # the settings of BENCHMARKS.md's sections (any seed), which README.md and docs/ais.md cite
    DEFAULT,
    replace(DEFAULT, groups=4, group_size=4),
    replace(DEFAULT, groups=16, group_size=16),
    replace(DEFAULT, policy="markov", length=24, groups=32, group_size=8, batches=240, instances=8,
            strengths=[0.05, 0.1, 0.2, 0.35], methods=["none", "tis", "prefix_tis", "suffix_tis", "seq_tis", "icepop",
            "ais"], horizons=[1, 10, 100]),
]  # fmt: skip


def changed(cfg: EstimatorBenchConfig) -> dict:
    """The settings of `cfg` other than its seed that differ from the defaults."""
    return {k: v for k, v in asdict(cfg).items() if k != "seed" and v != asdict(DEFAULT)[k]}


def names(cfg: EstimatorBenchConfig) -> tuple[str, str, str]:
    """(name of the results, BENCHMARKS.md section, its title) of a run: the policy, length (markov) and batch size,
    `_seed{S}` for a seed other than 0, and for settings that are not those of a PUBLISHED section, a stable hash of
    the ones that differ from the defaults."""
    n = cfg.groups * cfg.group_size
    digest = settings_tag(changed(cfg), [changed(p) for p in PUBLISHED])
    tag = f"N{n}" if cfg.policy == "tabular" else f"{cfg.policy}_L{cfg.length}_N{n}"
    tag += (f"_seed{cfg.seed}" if cfg.seed else "") + (f"_{digest}" if digest else "")
    title = f"### Batch N = {n}" if cfg.policy == "tabular" else f"### {cfg.policy} policy, L = {cfg.length}, N = {n}"
    title += (f", seed {cfg.seed}" if cfg.seed else "") + (f", other settings ({digest})" if digest else "")
    return tag, "estimator" if cfg == DEFAULT else f"estimator_{tag}", title


if __name__ == "__main__":
    cfg = apply_overrides(EstimatorBenchConfig(), sys.argv[1:])
    tag, section, title = names(cfg)
    result = main(cfg, str(ROOT / f"benchmarks/results/estimator_{tag}.json"))
    m = result["machine"]
    c = result["config"]
    body = (
        f"Command: `{command(__file__)}` ({result['seconds']:.0f} s on {m['cpus']} CPUs, {m['processor']}, "
        f"torch {m['torch']}).\n\n"
        f"V={c['vocab']}, L={c['length']}, batch N={c['groups']}x{c['group_size']}, cap C={c['cap']}, "
        f"{c['batches']} batches x {c['instances']} random instances per point. Relative gradient MSE "
        f"E|g_hat - g|^2 / |g|^2 (lower is better; bold = best non-oracle).\n\n" + markdown(result)
    )
    if cfg.policy != "tabular" or any(h != 1 for h in cfg.horizons):  # a horizon asked for is shown
        body += "\n\n" + horizon_markdown(result)
    update_section(ROOT / "BENCHMARKS.md", section, f"{title}\n\n" + body)
