"""Pool `aisrl branch` results into one table per arm: did the continuations of a state fall? (issue 5)

    python benchmarks/branch_table.py runs/branches [tag=NAME]

Expects ROOT/seed<k>/<arm>/branches.json, one `aisrl branch` result per seed and arm. An arm is a pair of a
state and the rollouts it was continued with, e.g. `fp8_state-fp32_rollouts` (the FP8 run's checkpoint,
continued with full-precision rollouts). For every arm it prints the change in held-out greedy accuracy from the
branch point to the end, per seed and pooled, and how many branches fell (aisrl.branch: by `fall` or more).
Branches of one state share that state, so they are not independent draws. The per-seed means are the
independent units, and the pooled standard error is taken over them. Writes
benchmarks/results/branches_<tag>.json.
"""

import json
import statistics
import sys
from pathlib import Path

from aisrl.bench.cli import command, options
from aisrl.bench.report import write_json

ROOT = Path(__file__).resolve().parent.parent


def collect(root: Path) -> dict[str, dict[int, list[dict]]]:
    """{arm: {seed: [branch summaries]}} for every ROOT/seed<k>/<arm>/branches.json."""
    out: dict[str, dict[int, list[dict]]] = {}
    for path in sorted(root.glob("seed*/*/branches.json")):
        seed = path.parent.parent.name.removeprefix("seed")
        if not seed.isdigit():
            continue
        res = json.loads(path.read_text())
        out.setdefault(path.parent.name, {})[int(seed)] = list(res["branches"].values())
    return out


def arm_summary(by_seed: dict[int, list[dict]]) -> dict:
    """Per-seed mean change and falls, and their pool: mean over seeds with its standard error."""
    seeds = {}
    for seed, branches in sorted(by_seed.items()):
        changes = [b["eval_change"] for b in branches if b["eval_change"] is not None]
        k3 = [b["k3_kl_max"] for b in branches if b.get("k3_kl_max") is not None]
        if changes:
            fell = sum(bool(b["fell"]) for b in branches)
            seeds[seed] = {"changes": changes, "mean": statistics.fmean(changes), "fell": fell,
                           "k3_kl_max": max(k3, default=None)}  # fmt: skip
    means = [s["mean"] for s in seeds.values()]
    return {
        "seeds": seeds,
        "mean_change": statistics.fmean(means) if means else None,
        "se": statistics.stdev(means) / len(means) ** 0.5 if len(means) > 1 else None,
        "fell": sum(s["fell"] for s in seeds.values()),
        "branches": sum(len(s["changes"]) for s in seeds.values()),
    }


def table(result: dict[str, dict]) -> str:
    seeds = sorted({k for arm in result.values() for k in arm["seeds"]})
    head = "| arm | " + " | ".join(f"seed {k}" for k in seeds) + " | mean over seeds (SE) | fell |"
    lines = [head, "|" + "---|" * (len(seeds) + 3)]
    for name, arm in result.items():
        cells = []
        for k in seeds:
            s = arm["seeds"].get(k)
            cells.append("-" if s is None else " ".join(f"{100 * c:+.0f}" for c in s["changes"]))
        se = "" if arm["se"] is None else f" ({100 * arm['se']:.1f})"
        mean = "-" if arm["mean_change"] is None else f"{100 * arm['mean_change']:+.1f}{se}"  # no branch scored
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {mean} | {arm['fell']}/{arm['branches']} |")
    return "\n".join(lines)


def main(argv: list[str]) -> dict:
    usage = "python benchmarks/branch_table.py ROOT [tag=NAME]"
    dirs, opts = options(argv, ("tag",), positional=True, usage=usage)
    if len(dirs) != 1:
        raise SystemExit(f"usage: {usage} (got {argv})")
    arms = collect(Path(dirs[0]))
    if not arms:
        raise SystemExit(f"no ROOT/seed<k>/<arm>/branches.json under {dirs[0]}; run `aisrl branch ... out=...` first")
    result = {name: arm_summary(by_seed) for name, by_seed in sorted(arms.items())}
    print("Held-out greedy accuracy at the end minus at the branch point, in points, per branch:\n")
    print(table(result))
    write_json(ROOT / "benchmarks" / "results" / f"branches_{opts.get('tag', 'study')}.json",
               {"command": command(__file__, argv), "arms": result})  # fmt: skip
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
