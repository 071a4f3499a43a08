"""Paired per-seed comparison of corrections across `aisrl compare` output directories (issue 5).

    python benchmarks/paired_seeds.py runs/compare runs/compare_extra [format=mxfp4_w4a4] [methods=none,tis,ais]

A study grows by runs in several directories (more seeds later). This script pools them and compares each
method's last-fifth training reward with the full-precision run of the same seed (same prompts and sampling
seeds), then compares methods with each other seed by seed. Only finished runs count: a run whose metrics
stop before its last step is skipped. Prints the numbers and writes benchmarks/results/paired_<format>.json.
"""

import json
import statistics
import sys
from pathlib import Path

from aisrl.bench.report import write_json

ROOT = Path(__file__).resolve().parent.parent


def last_fifth_reward(metrics: Path, steps: int) -> float | None:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    if len(rows) < steps:
        return None  # unfinished
    rewards = [r["reward"] for r in rows[:steps]]
    tail = rewards[-max(1, steps // 5) :]
    return sum(tail) / len(tail)


def collect(dirs: list[Path], kind: str, steps: int) -> dict[int, float]:
    """{seed: last-fifth reward} of `kind` ('reference' or 'FORMAT/METHOD') over the directories (first wins)."""
    out = {}
    for d in dirs:
        for run in sorted((d / kind).glob("seed*")):
            seed = int(run.name.removeprefix("seed"))
            if seed not in out and (run / "metrics.jsonl").exists():
                value = last_fifth_reward(run / "metrics.jsonl", steps)
                if value is not None:
                    out[seed] = value
    return out


def summary(values: list[float]) -> dict:
    n = len(values)
    sd = statistics.stdev(values) if n > 1 else float("nan")
    positive = sum(v > 0 for v in values)
    return {"n": n, "mean": statistics.mean(values), "std": sd, "se": sd / n**0.5, "positive": positive}


def main(dirs: list[Path], fmt: str, methods: list[str], steps: int = 100) -> dict:
    ref = collect(dirs, "reference", steps)
    delta = {}
    for m in methods:
        runs = collect(dirs, f"{fmt}/{m}", steps)
        delta[m] = {s: runs[s] - ref[s] for s in sorted(runs) if s in ref}
    result = {"dirs": [str(d) for d in dirs], "format": fmt, "steps": steps, "vs_full_precision": {}, "pairs": {}}
    for m, d in delta.items():
        result["vs_full_precision"][m] = {**summary(list(d.values())), "seeds": sorted(d)}
        s = result["vs_full_precision"][m]
        print(f"{m:>8} - full precision: {s['mean']:+.3f} ± {s['std']:.3f} (SE {s['se']:.3f}, {s['n']} seeds)")
    for i, a in enumerate(methods):
        for b in methods[i + 1 :]:
            common = sorted(set(delta[a]) & set(delta[b]))
            s = summary([delta[b][k] - delta[a][k] for k in common])
            result["pairs"][f"{b}-{a}"] = {**s, "seeds": common}
            print(f"{b:>8} - {a}: {s['mean']:+.3f} ± {s['std']:.3f} (SE {s['se']:.3f}); {b} higher on {s['positive']}"
                  f"/{s['n']} seeds")  # fmt: skip
    write_json(ROOT / f"benchmarks/results/paired_{fmt}.json", result)
    return result


if __name__ == "__main__":
    kw = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
    dirs = [Path(a) for a in sys.argv[1:] if "=" not in a] or [Path("runs/compare")]
    main(dirs, kw.get("format", "mxfp4_w4a4"), kw.get("methods", "none,tis,ais").split(","), int(kw.get("steps", 100)))
