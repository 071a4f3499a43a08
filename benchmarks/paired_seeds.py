"""Paired per-seed comparison of corrections across `aisrl compare` output directories (issue 5).

    python benchmarks/paired_seeds.py runs/compare runs/compare_extra [format=mxfp4_w4a4] [methods=none,tis,ais]
        [metric=reward|greedy_accuracy|policy_reward|sampler_reward|held_accuracy|held_reward] [tag=NAME]

A study grows by runs in several directories (more seeds later). This script pools them and compares each method's score
with the reference run of the same seed (same prompts and sampling seeds; full precision on a CPU; JSON key
`vs_full_precision`), then compares methods with each other seed by seed (over the seeds both finished, with or without
a reference). Runs of one seed that started from different weights (start.json; a warm start rebuilt on another CPU) are
refused. The score is the last-fifth training reward (`reward`, the default), the held-out greedy accuracy the trainer
measured at the last step (`greedy_accuracy`; the run must evaluate at its last step), or one of the final-model scores
`aisrl compare` writes to each run's final_eval.json (aisrl.final_eval). Only finished runs with a finite score count
(a NaN score, where nothing was scorable, leaves its seed out): a run whose metrics
stop before its last step, or that has no current final_eval.json (of its last step's weights as they are, made by this
version of the scorer: aisrl.final_eval.SCORER) when one of its scores is asked for, is skipped. A method written
`METHOD@DIR` is taken from that directory alone, so runs of one method under other training settings (a study with
`rollout.keep`, say, in its own directory) pair with the same method without them: `methods=tis,ais,ais@runs/nv_keep`. A
method written `FORMAT/METHOD` is taken from that rollout format instead of `format=`, so one method under two formats
pairs by seed: `methods=ais,nvfp4_w4a4/ais`. Prints the numbers and writes benchmarks/results/paired_<format>.json
(paired_<format>_<metric>.json for another score; paired_<tag>_<format>... with `tag=`, which keeps the results of
another study apart). A file that holds a comparison of other folders or methods is not replaced (the docs may cite it)
unless `overwrite=true`; an unknown option, a missing folder or a comparison with nothing paired is an error and writes
nothing."""

import json
import sys
from pathlib import Path

from aisrl.bench.cli import choice, command, flag, number, options
from aisrl.bench.report import write_json
from aisrl.bench.seeds import METRICS, check_starts, collect, summary

ROOT = Path(__file__).resolve().parent.parent
def _spread(s: dict) -> str:
    return "one seed, no spread" if s["std"] is None else f"± {s['std']:.3f}, SE {s['se']:.3f}"


def main(
    dirs: list[Path],
    fmt: str,
    methods: list[str],
    steps: int = 100,
    metric: str = "reward",
    tag: str = "",
    overwrite: bool = False,
) -> dict:
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose from {sorted(METRICS)}")
    if len(set(methods)) < len(methods):
        raise ValueError(f"methods={','.join(methods)} names a method twice; name each once")
    missing = [str(d) for d in [*dirs, *(Path(m.partition("@")[2]) for m in methods if "@" in m)] if not d.is_dir()]
    if missing:
        raise ValueError(f"no such study folder: {missing}")
    paths: dict[str, dict[int, Path]] = {k: {} for k in ["reference", *methods]}
    ref = collect(dirs, "reference", steps, metric, paths["reference"])
    runs = {}
    for m in methods:  # METHOD@DIR: that method's runs in that directory only; FORMAT/METHOD: under that format
        name, _, where = m.partition("@")
        kind = name if "/" in name else f"{fmt}/{name}"
        runs[m] = collect([Path(where)] if where else dirs, kind, steps, metric, paths[m])
    for i, a in enumerate(paths):
        for b in list(paths)[i + 1 :]:
            check_starts(paths[a], paths[b])
    delta = {m: {s: runs[m][s] - ref[s] for s in sorted(runs[m]) if s in ref} for m in methods}
    result = {"dirs": [str(d) for d in dirs], "format": fmt, "steps": steps, "metric": metric,
              "vs_full_precision": {}, "pairs": {}, "command": command(__file__)}  # fmt: skip
    for m, d in delta.items():
        result["vs_full_precision"][m] = {**summary(list(d.values())), "seeds": sorted(d)}
        s = result["vs_full_precision"][m]
        if not s["n"]:
            print(f"{m:>8}: no finished run with a {metric} paired with a reference run (full precision on a CPU)")
            continue
        print(f"{m:>8} - reference: {s['mean']:+.3f} ({_spread(s)}; {s['n']} seeds)")
    for i, a in enumerate(methods):
        for b in methods[i + 1 :]:
            common = sorted(set(runs[a]) & set(runs[b]))  # method against method: no reference run needed
            s = summary([runs[b][k] - runs[a][k] for k in common])
            result["pairs"][f"{b}-{a}"] = {**s, "seeds": common}
            if s["n"]:
                p = "n/a, all tied" if s["sign_p"] is None else f"{s['sign_p']:.2g}"
                print(f"{b:>8} - {a}: {s['mean']:+.3f} ({_spread(s)}); {b} higher on {s['positive']}/{s['n']} seeds, "
                      f"{s['ties']} tied (sign test p {p})")  # fmt: skip
    if not any(s["n"] for s in [*result["vs_full_precision"].values(), *result["pairs"].values()]):
        raise ValueError(f"nothing paired in {[str(d) for d in dirs]} (format {fmt}, methods {methods}, metric "
                         f"{metric}): no result written; check the folders, format= and methods=")  # fmt: skip
    name = "_".join([*([tag] if tag else []), fmt, *([] if metric == "reward" else [metric])])
    path = ROOT / f"benchmarks/results/paired_{name}.json"
    old = json.loads(path.read_text()) if path.exists() and not overwrite else result
    was = (old.get("dirs"), sorted(old.get("vs_full_precision", {})), old.get("steps", result["steps"]))
    if was != (result["dirs"], sorted(methods), result["steps"]):
        raise ValueError(f"{path.relative_to(ROOT)} holds a comparison of other folders, methods or steps ({was[0]}, "
                         f"{was[1]}, steps {was[2]}), which the docs may cite: pass tag=NAME to write another file, "
                         "or overwrite=true to replace it")  # fmt: skip
    write_json(path, result)
    return result


KEYS = ("format", "methods", "steps", "metric", "tag", "overwrite")

if __name__ == "__main__":
    dirs, kw = options(sys.argv[1:], KEYS, positional=True)
    dirs = [Path(d) for d in dirs] or [Path("runs/compare")]
    main(
        dirs,
        kw.get("format", "mxfp4_w4a4"),
        kw.get("methods", "none,tis,ais").split(","),
        number(kw, "steps", 100, low=1),
        choice(kw, "metric", "reward", METRICS),
        kw.get("tag", ""),
        flag(kw, "overwrite", False),
    )
