"""Estimator-quality benchmark (docs/ais.md section 3): writes benchmarks/results/estimator_N{N}.json (tabular policy;
estimator_{policy}_L{L}_N{N}.json otherwise; `_seed{S}` added for a seed other than 0) and its section of
BENCHMARKS.md (`estimator` for the default batch size and seed).

    python benchmarks/estimator.py [key=value ...]     # e.g. seed=1 groups=4 group_size=4
    python benchmarks/estimator.py policy=markov length=24 groups=32 group_size=8 horizons=[1,10,100]
"""

import sys
from pathlib import Path

from aisrl.bench.estimator import EstimatorBenchConfig, horizon_markdown, main, markdown
from aisrl.bench.report import update_section
from aisrl.config import apply_overrides

ROOT = Path(__file__).resolve().parent.parent

if __name__ == "__main__":
    cfg = apply_overrides(EstimatorBenchConfig(), sys.argv[1:])
    n = cfg.groups * cfg.group_size
    seed = f"_seed{cfg.seed}" if cfg.seed else ""  # another seed's run must not replace the headline figures
    tag = (f"N{n}" if cfg.policy == "tabular" else f"{cfg.policy}_L{cfg.length}_N{n}") + seed
    result = main(cfg, str(ROOT / f"benchmarks/results/estimator_{tag}.json"))
    m = result["machine"]
    c = result["config"]
    cmd = "python benchmarks/estimator.py" + "".join(f" {a}" for a in sys.argv[1:])
    body = (
        f"Command: `{cmd}` ({result['seconds']:.0f} s on {m['cpus']} CPUs, {m['processor']}, "
        f"torch {m['torch']}).\n\n"
        f"V={c['vocab']}, L={c['length']}, batch N={c['groups']}x{c['group_size']}, cap C={c['cap']}, "
        f"{c['batches']} batches x {c['instances']} random instances per point. Relative gradient MSE "
        f"E|g_hat - g|^2 / |g|^2 (lower is better; bold = best non-oracle).\n\n" + markdown(result)
    )
    if cfg.policy != "tabular" or len(cfg.horizons) > 1:
        body += "\n\n" + horizon_markdown(result)
    n = c["groups"] * c["group_size"]
    default = EstimatorBenchConfig()
    if cfg.policy == "tabular":
        section = "estimator" if n == default.groups * default.group_size and not seed else f"estimator_{tag}"
        title = f"### Batch N = {n}" + (f", seed {cfg.seed}" if seed else "")
    else:
        section = f"estimator_{tag}"
        title = f"### {cfg.policy} policy, L = {cfg.length}, batch N = {n}"
    update_section(ROOT / "BENCHMARKS.md", section, f"{title}\n\n" + body)
