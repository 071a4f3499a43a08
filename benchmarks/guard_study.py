"""Full runs with and without `correction.guard`, paired seed by seed (issue 5, docs/ais.md section 5).

    python benchmarks/guard_study.py GUARDED UNGUARDED [group=fp8_e4m3_w8a8/ais] [tag=NAME]

GUARDED and UNGUARDED are `aisrl compare` output folders of one recipe, one with `correction.guard=F` and one
without. A guarded run is the unguarded run of its seed, step for step, until the guard first trips
(aisrl.update.MismatchGuard restores the weights and drops that batch; nothing before it differs). So only the
seeds whose guarded run tripped need an unguarded run; for a seed whose guarded run never tripped, the guarded
run is its own twin. Where both runs exist the script checks that claim: the training rewards must agree up to
the first trip and the final weights must agree when there was none.

Per seed it prints the trip steps, the final held-out greedy accuracy of both, whether each fell (from its best
evaluation to its last by `fall` or more, as in `aisrl compare`), and the final-model scores when both have
them; then guard minus no guard over all seeds (those without a trip count as zero) and over the seeds that
tripped, and the falls of each arm. Writes
benchmarks/results/guard_<tag>.json.
"""

import sys
from pathlib import Path

from aisrl.bench.cli import command, number, options
from aisrl.bench.report import write_json
from aisrl.bench.seeds import collect, score, summary
from aisrl.checkpoint import checkpoint_dir, file_sha256, same_start
from aisrl.runs import per_step, run_rows, seed_runs, summarize_run

ROOT = Path(__file__).resolve().parent.parent
SCORES = ("greedy_accuracy", "held_accuracy", "policy_reward")


def runs_of(folder: Path, group: str, steps: int) -> dict[int, Path]:
    """{seed: run folder} of the finished runs of `group` in an `aisrl compare` output folder."""
    where: dict[int, Path] = {}
    collect([folder], group, steps, "reward", where)  # the last-fifth reward exists exactly when the run finished
    return where


def _weights(run: Path, steps: int) -> str | None:
    """SHA-256 of the run's weights at step `steps` (its checkpoint's), None where that checkpoint is gone."""
    weights = checkpoint_dir(run, steps) / "model.safetensors"
    return file_sha256(weights) if weights.is_file() else None


def twin_check(guarded: Path, unguarded: Path, trips: list[int], steps: int) -> str:
    """'ok' if the two runs agree where they must (rewards up to the first trip; final weights if none), else why."""
    a, b = per_step(run_rows(guarded))[:steps], per_step(run_rows(unguarded))[:steps]
    first_diff = next((r["step"] for r, s in zip(a, b, strict=False) if r.get("reward") != s.get("reward")), None)
    if trips and first_diff is not None and first_diff <= trips[0]:
        return f"rewards differ at step {first_diff}, before the first trip ({trips[0]})"
    wa, wb = (_weights(r, steps) for r in (guarded, unguarded)) if not trips else (None, None)
    if not trips and (first_diff is not None or (wa is not None and wb is not None and wa != wb)):
        return f"no trip, yet the runs differ (first reward difference at step {first_diff})"
    return "ok"


def seed_row(seed: int, guarded: Path, unguarded: Path | None, steps: int, fall: float) -> dict:
    rows = per_step(run_rows(guarded))[:steps]
    trips = [r["step"] for r in rows if r.get("guard_rollback", 0) > 0]
    if unguarded is None and trips:
        return {"seed": seed, "trips": trips, "twin": "missing: the guard tripped, run this seed unguarded"}
    twin = unguarded or guarded  # no trip and no unguarded run: the guarded run is the unguarded one
    if unguarded is not None and not same_start(guarded, unguarded):
        raise ValueError(f"{guarded} and {unguarded} started from different weights (start.json); not a pair")
    out = {"seed": seed, "trips": trips,
           "twin": twin_check(guarded, unguarded, trips, steps) if unguarded else "itself (no trip)"}  # fmt: skip
    for arm, run in (("guard", guarded), ("none", twin)):
        out[f"fell_{arm}"] = summarize_run(per_step(run_rows(run))[:steps], 0.5, fall)["fell"]
        for metric in SCORES:
            out[f"{metric}_{arm}"] = score(run, steps, metric)
    return out


def main(argv: list[str]) -> dict:
    usage = ("python benchmarks/guard_study.py GUARDED UNGUARDED [group=FORMAT/METHOD] [tag=NAME] [steps=100] "
             "[fall=0.08]")
    dirs, opts = options(argv, ("group", "tag", "steps", "fall"), positional=True, usage=usage)
    if len(dirs) != 2:
        raise SystemExit(f"usage: {usage} (got {argv})")
    dirs = [Path(d) for d in dirs]
    group, steps = opts.get("group", "fp8_e4m3_w8a8/ais"), number(opts, "steps", 100, low=1)
    fall = number(opts, "fall", 0.08, float)
    if not 0 < fall <= 1:
        raise SystemExit(f"fall={fall}: a drop of held-out accuracy in (0, 1], e.g. 0.08 for 8 points")
    guarded, unguarded = runs_of(dirs[0], group, steps), runs_of(dirs[1], group, steps)
    if not guarded:
        raise SystemExit(f"no finished run of {group} under {dirs[0]}")
    unfinished = [str(run) for seed, run in seed_runs(dirs[0] / group) if seed not in guarded]  # said, not dropped
    seeds = [seed_row(k, guarded[k], unguarded.get(k), steps, fall) for k in sorted(guarded)]
    bad = [s for s in seeds if s["twin"] not in ("ok", "itself (no trip)")]
    paired = [s for s in seeds if s not in bad]
    result = {"command": command(__file__, argv), "group": group, "steps": steps,
              "seeds": seeds, "unpaired": [s["seed"] for s in bad], "unfinished": unfinished,
              "tripped": sum(bool(s["trips"]) for s in paired), "trips": sum(len(s["trips"]) for s in paired),
              "falls": {arm: sum(s[f"fell_{arm}"] for s in paired) for arm in ("guard", "none")},
              "guard_minus_none": {}}  # fmt: skip
    print("| seed | trips | twin | greedy % guard | no guard | fell guard | no guard |\n|---|---|---|---|---|---|---|")
    for s in seeds:
        if s in bad:
            print(f"| {s['seed']} | {s['trips']} | {s['twin']} | | | | |")
            continue
        g, n = s["greedy_accuracy_guard"], s["greedy_accuracy_none"]
        fell = " | ".join("yes" if s[f"fell_{arm}"] else "-" for arm in ("guard", "none"))
        g, n = ("-" if x is None else f"{100 * x:.1f}" for x in (g, n))  # None: no evaluation at `steps`
        print(f"| {s['seed']} | {', '.join(map(str, s['trips'])) or '-'} | {s['twin']} | {g} | {n} | {fell} |")
    for subset, chosen in (("all", paired), ("tripped", [s for s in paired if s["trips"]])):
        result["guard_minus_none"][subset] = {}
        for metric in SCORES:
            diffs = [s[f"{metric}_guard"] - s[f"{metric}_none"] for s in chosen
                     if s[f"{metric}_guard"] is not None and s[f"{metric}_none"] is not None]  # fmt: skip
            result["guard_minus_none"][subset][metric] = summ = summary(diffs)
            if summ["n"] > 1:
                print(f"guard - no guard, {metric}, {subset} seeds: {summ['mean']:+.4f} (SE {summ['se']:.4f}; "
                      f"guard higher on {summ['positive']}/{summ['n']}, {summ['ties']} tied)")  # fmt: skip
            elif summ["n"] == 1:  # no standard error from one seed, but its difference is still a result
                print(f"guard - no guard, {metric}, {subset} seeds: {summ['mean']:+.4f} (one seed)")
    print(
        f"falls: guard {result['falls']['guard']}/{len(paired)}, no guard {result['falls']['none']}/{len(paired)};"
        f" {result['tripped']} guarded runs tripped ({result['trips']} trips); unpaired seeds {result['unpaired']}"
    )
    if unfinished:
        print(f"left out {len(unfinished)} guarded runs not finished to step {steps}: {unfinished}")
    write_json(ROOT / "benchmarks" / "results" / f"guard_{opts.get('tag', 'study')}.json", result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
