"""Replay guard rules over the k3 series of finished runs: which runs would trip, when, and did they fall (issue 5).

    python benchmarks/guard_replay.py FOLDER [FOLDER ...] [group=nvfp4_w4a4/tis] [factor=4] [window=10]
        [drift=2] [anchor=20] [drift_window=10] [steps=100] [fall=0.08] [tag=NAME]

Training with a guard costs a run per seed; replaying a rule over the rollout/trainer k3 KL that every run logs
costs nothing, and says which runs a rule would act on before any is trained. Two rules:

- jump, what `correction.guard=F` does (aisrl.update.MismatchGuard, replayed with its own code): a step's k3
  above `factor` times the median of the last `window` steps. A tripped step restores the weights, so the next
  step has no update to undo and a jump there only moves the baseline. Over an unguarded run the first trip is
  exact (the guarded run is the same run up to there); later ones are what the rule sees on that run's path, not
  on the guarded one's. Over a guarded run the replay must find the trips it logged (`guard_rollback`): the
  `logged` column checks it ("off" for a run trained without the guard).
- drift, a candidate not in the trainer (docs/ais.md section 5, "What to try next", item 1): the median k3 of
  the last `drift_window` steps above `drift` times the median of the run's first `anchor` steps. A trailing
  baseline follows a slow climb; an anchored one does not.

Per run: the jump trips, the first drift flag, and whether the run fell (held-out greedy accuracy from its best
evaluation to its last by `fall` or more, as in `aisrl compare`). Then how many runs each rule flags among those
that fell and those that did not. FOLDER is an `aisrl compare` output folder; runs are its FORMAT/METHOD/seedN
folders matching `group` (a glob; all groups by default), finished to `steps`. Writes
benchmarks/results/guard_replay_<tag>.json.
"""

import math
import statistics
import sys
from pathlib import Path

from aisrl.bench.cli import command, number, options, study_folders
from aisrl.bench.report import write_json
from aisrl.runs import finite_values, measured_value, per_step, run_rows, seed_runs, summarize_run
from aisrl.update import MismatchGuard

ROOT = Path(__file__).resolve().parent.parent
OPTIONS = {"group": "*/*", "factor": "4", "window": "10", "drift": "2", "anchor": "20", "drift_window": "10",
           "steps": "100", "fall": "0.08", "tag": "study"}  # fmt: skip


def jump_trips(k3: list[float], factor: float, window: int, skipped: list[bool] | None = None) -> list[int]:
    """Steps (1-based) at which `correction.guard=factor` trips on this k3 series; skipped[i]: step i + 1 updated
    nothing (the trainer then forgets its undo copy, so a jump at the next step only moves the baseline)."""
    guard = MismatchGuard(factor, window)
    trips = []
    for step, value in enumerate(k3, 1):
        if guard.tripped(value):
            trips.append(step)
            guard.saved = None  # restored: nothing to undo at the next step
        else:
            guard.saved = (None, None)  # this step's update can be undone at the next
        if skipped and skipped[step - 1]:
            guard.forget()
    return trips


def first_drift(k3: list[float], ratio: float, anchor: int, window: int) -> int | None:
    """First step whose trailing `window`-step median k3 exceeds `ratio` times the median of steps 1..anchor."""
    base = _median(k3[:anchor])
    return next((t for t in range(anchor + window, len(k3) + 1)
                 if _median(k3[t - window : t]) > ratio * base), None)  # fmt: skip


def _or_nan(x) -> float:
    return math.nan if x is None else x


def _median(xs: list[float]) -> float:
    """The median of the finite values (a step without a measured k3 is left out; NaN if none is finite)."""
    finite = finite_values(xs)
    return statistics.median(finite) if finite else math.nan


def run_row(name: str, rows: list[dict], opts: dict) -> dict:
    k3 = [_or_nan(measured_value(r, "k3_kl")) for r in rows]  # (steps,): NaN where a row is missing or measured nothing
    skipped = [r.get("update_skipped", 0.0) == 1.0 for r in rows]
    summary = summarize_run(rows, 0.5, opts["fall"])  # best and last held-out greedy accuracy, as `aisrl compare`
    best_step = next((s for s, acc in summary["eval_curve"] if acc == summary["eval_best"]), 0)  # 0: the start
    guarded = any("guard_rollback" in r for r in rows)  # a run trained with the guard off logs no rollbacks
    return {"run": name, "fell": summary["fell"], "trips": jump_trips(k3, opts["factor"], opts["window"], skipped),
            "logged_trips": [r["step"] for r in rows if r.get("guard_rollback", 0) > 0] if guarded else None,
            "drift": first_drift(k3, opts["drift"], opts["anchor"], opts["drift_window"]),
            "best_eval": summary["eval_best"], "best_step": best_step, "last_eval": summary["eval_final"],
            "k3_anchor": _median(k3[: opts["anchor"]])}  # fmt: skip


def parse(given: dict[str, str]) -> dict:
    """The options with their types; a value that does not parse, or a count below 1, is an error naming it."""
    opts = {**OPTIONS, **given}
    for key, kind in (("factor", float), ("drift", float), ("fall", float), ("window", int), ("anchor", int),
                      ("drift_window", int), ("steps", int)):  # fmt: skip
        opts[key] = number(opts, key, None, kind, low=1 if kind is int else None)
    if not opts["factor"] > 1:  # the trainer's rule: correction.guard is 0 (off) or above 1
        raise SystemExit(f"factor={opts['factor']}: the jump guard's factor is above 1 (correction.guard=F), e.g. 4")
    if not opts["drift"] > 0:
        raise SystemExit(f"drift={opts['drift']}: the drift ratio is above 0, e.g. 2")
    if not 0 < opts["fall"] <= 1:
        raise SystemExit(f"fall={opts['fall']}: a drop of held-out accuracy in (0, 1], e.g. 0.08 for 8 points")
    if opts["anchor"] + opts["drift_window"] > opts["steps"]:  # the drift rule could never fire, yet report 0 flags
        raise SystemExit(f"anchor={opts['anchor']} + drift_window={opts['drift_window']} is longer than "
                         f"steps={opts['steps']}: the drift rule needs both; lower them")  # fmt: skip
    return opts


def main(argv: list[str]) -> dict:
    keys = " ".join(f"[{k}={v}]" for k, v in OPTIONS.items())
    usage = f"python benchmarks/guard_replay.py FOLDER [FOLDER ...] {keys}"
    folders, given = options(argv, OPTIONS, positional=True, usage=usage)
    opts = parse(given)
    if not folders:
        raise SystemExit(f"usage: {usage} (got {argv})")
    folders = study_folders(folders)
    steps = opts["steps"]
    runs, unfinished = [], []
    for folder in folders:
        for group in sorted(p for p in folder.glob(opts["group"]) if p.is_dir()):
            for _, run in seed_runs(group):  # the study's runs, in seed order (not seed07, seed_old, ...)
                rows = per_step(run_rows(run))[:steps] if (run / "metrics.jsonl").exists() else []
                if len(rows) < steps:
                    unfinished.append(str(run))
                    continue
                runs.append(run_row(str(run.relative_to(folder.parent)), rows, opts))
    if not runs:
        raise SystemExit(f"no run finished to step {steps} under {[str(f) for f in folders]} (group={opts['group']})")
    print("| run | fell | jump trips | logged | drift flag | best eval (step) | last eval |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        trips = ", ".join(map(str, r["trips"])) or "-"
        logged = "off" if r["logged_trips"] is None else ", ".join(map(str, r["logged_trips"])) or "-"
        best = f"{100 * r['best_eval']:.1f} ({r['best_step']})" if r["best_eval"] is not None else "-"
        last = f"{100 * r['last_eval']:.1f}" if r["last_eval"] is not None else "-"
        print(f"| {r['run']} | {'yes' if r['fell'] else '-'} | {trips} | {logged} | {r['drift'] or '-'} | {best} | "
              f"{last} |")  # fmt: skip
    fell = [r for r in runs if r["fell"]]
    kept = [r for r in runs if not r["fell"]]
    flagged = {"jump": lambda r: bool(r["trips"]), "drift": lambda r: r["drift"] is not None}
    table = {rule: {"fell": sum(map(test, fell)), "healthy": sum(map(test, kept))} for rule, test in flagged.items()}
    for rule, n in table.items():
        print(f"{rule}: flags {n['fell']} of {len(fell)} runs that fell and {n['healthy']} of {len(kept)} that did not")
    if unfinished:
        print(f"skipped {len(unfinished)} unfinished runs: {unfinished}")
    result = {"command": command(__file__, argv), "options": opts, "runs": runs,
              "falls": len(fell), "flagged": table, "unfinished": unfinished}  # fmt: skip
    write_json(ROOT / "benchmarks" / "results" / f"guard_replay_{opts['tag']}.json", result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
