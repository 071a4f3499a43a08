"""The low-precision copy's mismatch at trained checkpoints, measured the same way for every run (issue 5).

    OMP_NUM_THREADS=2 python benchmarks/checkpoint_mismatch.py runs/ref runs/mxall
        [kinds=reference,mxfp4_w4a4/none,mxfp4_w4a4/tis,mxfp4_w4a4/ais] [steps=80,100] [quant=mxfp4_w4a4]
        [preset=lab_columns] [held=4] [tag=NAME] [overwrite=false]

A run's logged k3 KL is measured on its own batches, by its own copy, so it mixes where training went with what
was sampled. This script measures every checkpoint on the same footing: the weights of RUN at each of `steps`,
their copy in `quant`, and `held` fixed batches of the preset's training prompts sampled by that copy
(benchmarks/copy_pull.py, class Probe), giving the k3 KL of the copy against the weights, the weights' negative
log-likelihood of the samples and the samples' reward; the warm start is measured too. Full-precision runs
(`reference`) never used a low-precision copy, so their figure says where full-precision training moves the copy's
mismatch by itself: if it rises as much there as in the low-precision runs, the late mismatch of those runs is where
training goes, not drift caused by their rollouts. Per kind: the mean over its seeds, the paired difference from the
reference run of each seed (same prompts, same warm start) and from every other kind, and over the reference runs
the correlation across seeds between the measured k3 and the run's held-out greedy accuracy at its last step. Writes
benchmarks/results/checkpoint_mismatch_<quant>[_<tag>].json and its section of BENCHMARKS.md; a file of that name
holding other kinds is kept (tag= writes beside it, overwrite=true replaces it).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from aisrl.bench.cli import command, flag, number, numbers, options, study_folders
from aisrl.bench.report import machine, settings_tag, update_section, write_json
from aisrl.bench.seeds import check_starts, collect, correlation, summary
from aisrl.checkpoint import checkpoint_dir
from aisrl.runs import per_step, run_rows

sys.path.insert(0, str(Path(__file__).resolve().parent))
from copy_pull import setup  # noqa: E402  (a sibling script, not a package)

ROOT = Path(__file__).resolve().parent.parent
KEYS = ("k3", "nll", "reward")
DEFAULTS = {"steps": [80, 100], "preset": "lab_columns", "held": 4, "quant": "mxfp4_w4a4"}  # the published ones


def paired(a: dict[int, dict], b: dict[int, dict]) -> dict | None:
    """Paired k3 differences a - b over the seeds both have (paired_seeds.summary, plus the median, which one
    run far off its copy does not move); None under two seeds."""
    diffs = [a[s]["k3"] - b[s]["k3"] for s in sorted(set(a) & set(b))]
    return {**summary(diffs), "median": statistics.median(diffs)} if len(diffs) > 1 else None


def _r(c: dict) -> str:
    """A correlation as text: r and its permutation p, or why it is undefined."""
    return "undefined (no spread)" if c["r"] is None else f"r {c['r']:+.2f} (permutation p {c['p']:.2g})"


def section(out: dict) -> str:
    w = out["warm_start"]
    lines = [f"### The {out['quant']} copy's mismatch at trained checkpoints ({out['preset']})\n",
             f"`{out['command']}` ({out['seconds'] / 60:.0f} min; {out['machine'].get('cpu', '?')}, "
             f"{out['machine'].get('cpus', '?')} cores). Each run's weights at steps {out['steps']} (averaged), their "
             f"copy, {out['held']} fixed batches of the preset's training prompts sampled by it. Warm start: k3 "
             f"{w['k3']:.4f}, NLL {w['nll']:.3f}, copy's reward {w['reward']:.3f}.\n",
             "| runs | seeds | k3 mean | k3 median | k3 - full precision: mean (SE), median, higher on | NLL | "
             "copy reward |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for kind, row in out["kinds"].items():
        if not row.get("seeds"):
            continue
        k3s = [r["k3"] for r in out["runs"][kind].values()]
        d = row.get("k3_minus_reference")
        vs = f"{d['mean']:+.4f} ({d['se']:.4f}), {d['median']:+.4f}, {d['positive']}/{d['n']}" if d else "-"
        lines.append(f"| {kind} | {row['seeds']} | {row['k3_mean']:.4f} | {statistics.median(k3s):.4f} | {vs} | "
                     f"{row['nll_mean']:.3f} | {row['reward_mean']:.3f} |")  # fmt: skip
    if out.get("pairs"):
        lines.append("\n| pair (same seeds) | k3 difference: mean (SE), median, first higher on |\n|---|---|")
        for name, d in out["pairs"].items():
            lines.append(f"| {name} | {d['mean']:+.4f} ({d['se']:.4f}), {d['median']:+.4f}, {d['positive']}/{d['n']} |")
    if "reference_k3_vs_accuracy" in out:
        c = out["reference_k3_vs_accuracy"]
        lines.append(f"\nFull-precision runs, measured k3 against their held-out greedy accuracy across seeds: "
                     f"{_r(c)}.")  # fmt: skip
    return "\n".join(lines)


def finished_runs(dirs: list[Path], kinds: list[str], steps: list[int]) -> dict[str, dict[int, Path]]:
    """{kind: {seed: run folder}} of the runs finished at the last of `steps` (first folder wins); an error naming a
    folder that does not exist, a kind without one finished run, or a run that kept no checkpoint at one of `steps`
    (a run keeps its last `keep_checkpoints`, 2 by default), before anything is measured."""
    final = max(steps)
    dirs = study_folders(dirs)
    found = {}
    for kind in kinds:
        found[kind] = {}
        collect(dirs, kind, final, "reward", found[kind])  # the reward exists exactly when the run finished
    empty = [k for k, where in found.items() if not where]
    if empty:
        raise SystemExit(f"no run of {empty} finished to step {final} under {[str(d) for d in dirs]}; kinds are "
                         "'reference' and FORMAT/METHOD folders there")  # fmt: skip
    for i, a in enumerate(kinds):  # paired by seed: runs of one seed must share their warm start
        for b in kinds[i + 1 :]:
            check_starts(found[a], found[b])
    lacking = [f"{run}: step {s}" for where in found.values() for run in where.values() for s in steps
               if not (checkpoint_dir(run, s) / "model.safetensors").is_file()]  # fmt: skip
    if lacking:
        raise SystemExit(f"no checkpoint kept at {len(lacking)} of the steps asked ({'; '.join(lacking[:4])}"
                         f"{'; ...' if len(lacking) > 4 else ''}): pass steps= that every run kept (see their "
                         "checkpoints/ folders), or train with checkpoint_every=20 keep_checkpoints=0")  # fmt: skip
    return found


def name_of(quant: str, tag: str, steps: list[int], preset: str, held: int) -> str:
    """The results' name: a hash of the measuring settings is added where they are not the published defaults."""
    changed = {k: v for k, v in (("steps", steps), ("preset", preset), ("held", held)) if v != DEFAULTS[k]}
    digest = settings_tag(changed, [{}])
    return f"checkpoint_mismatch_{quant}" + (f"_{tag}" if tag else "") + (f"_{digest}" if digest else "")


def main(dirs: list[Path], kinds: list[str], steps: list[int], quant: str, preset: str, held: int,
         tag: str = "", overwrite: bool = False) -> dict:  # fmt: skip
    t0 = time.perf_counter()
    found = finished_runs(dirs, kinds, steps)  # before anything is measured: a misspelt kind is an error
    name = name_of(quant, tag, steps, preset, held)
    path = ROOT / "benchmarks" / "results" / f"{name}.json"
    held_kinds = sorted(json.loads(path.read_text()).get("kinds", {})) if path.exists() and not overwrite else None
    if held_kinds is not None and held_kinds != sorted(kinds):  # the name holds the settings, not the kinds
        raise SystemExit(f"{path.relative_to(ROOT)} holds a measurement of other kinds ({held_kinds}), which the docs "
                         "may cite: pass tag=NAME to write this one beside it, or overwrite=true to replace it")
    probe = setup(preset, quant, "")  # one model and copy, each checkpoint's weights loaded into them in turn
    warm = probe.measure(held)
    print("warm start: " + ", ".join(f"{k} {warm[k]:.4f}" for k in KEYS), flush=True)
    final = max(steps)
    runs: dict[str, dict[int, dict]] = {}
    for kind, where in found.items():
        runs[kind] = {}
        for seed, run in sorted(where.items()):
            at = [probe.load(f"{run}:{s}").measure(held) for s in steps]
            runs[kind][seed] = {k: statistics.fmean(a[k] for a in at) for k in KEYS}
            runs[kind][seed]["accuracy"] = per_step(run_rows(run))[final - 1].get("eval_accuracy")
            print(f"{kind} seed {seed}: " + ", ".join(f"{k} {runs[kind][seed][k]:.4f}" for k in KEYS), flush=True)
    out = {"quant": quant, "preset": preset, "steps": steps, "held": held, "warm_start": warm, "runs": runs,
           "kinds": {}, "seconds": time.perf_counter() - t0, "machine": machine(),
           "command": command(__file__)}  # fmt: skip
    ref = runs.get("reference", {})
    for kind, by_seed in runs.items():
        row = {f"{k}_mean": statistics.fmean(r[k] for r in by_seed.values()) for k in KEYS} if by_seed else {}
        if kind != "reference":
            row["k3_minus_reference"] = paired(by_seed, ref)
        out["kinds"][kind] = {"seeds": len(by_seed), **row}
        d = row.get("k3_minus_reference")
        if row:
            extra = f", k3 - reference {d['mean']:+.4f} (SE {d['se']:.4f}, median {d['median']:+.4f})" if d else ""
            print(f"{kind}: {len(by_seed)} seeds, k3 {row['k3_mean']:.4f}{extra}")
    others = [k for k in runs if k != "reference"]
    out["pairs"] = {f"{b} - {a}": p for i, a in enumerate(others) for b in others[i + 1 :]
                    if (p := paired(runs[b], runs[a]))}  # fmt: skip
    scored = {("reference", s): r for s, r in ref.items() if r["accuracy"] is not None}
    if len(scored) >= 4:
        out["reference_k3_vs_accuracy"] = correlation({k: r["k3"] for k, r in scored.items()},
                                                      {k: r["accuracy"] for k, r in scored.items()})  # fmt: skip
        c = out["reference_k3_vs_accuracy"]
        print(f"reference runs: k3 vs held-out greedy accuracy across seeds: {_r(c)}")
    write_json(path, out)
    update_section(ROOT / "BENCHMARKS.md", name, section(out))
    return out


if __name__ == "__main__":
    paths, kw = options(sys.argv[1:], ("kinds", "steps", "quant", "preset", "held", "tag", "overwrite"),
                        positional=True)  # fmt: skip
    kinds = kw.get("kinds", "reference,mxfp4_w4a4/none,mxfp4_w4a4/tis,mxfp4_w4a4/ais").split(",")
    main([Path(p) for p in paths], kinds, numbers(kw, "steps", DEFAULTS["steps"], low=1),
         kw.get("quant", DEFAULTS["quant"]), kw.get("preset", DEFAULTS["preset"]),
         number(kw, "held", DEFAULTS["held"], low=1), kw.get("tag", ""), flag(kw, "overwrite", False))  # fmt: skip
