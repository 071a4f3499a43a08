"""Branches: continue a run from one of its checkpoints under other sampling seeds, or other settings.

Why: when a low-precision run fails late (held-out accuracy falls while the rollout/trainer mismatch grows),
the run alone cannot say what caused it. Was the state its weights had reached already fragile, or did the
rollouts after that point break it? And was it bad luck in the samples? A branch answers such questions by
experiment. It copies the run's checkpoint at `step` into a new run folder and trains on from there. The
prompts are those of the run; salt k adds k to the run's `sample_salt`, which shifts the sampling seeds (salt 0
replays the run's own continuation exactly, as a resume does, a branch's too). Optionally, any setting changes
too. For two runs of one seed, say a full-precision run A and an FP8 run B (each trained with a checkpoint at
step 80 kept: checkpoint_every=20, or keep_checkpoints=0), four sets of branches separate the causes:

    aisrl branch run=runs/x/reference/seed11 step=80 "salts=[1,2,3]"                   # A's state, A's rollouts
    aisrl branch run=runs/x/fp8_e4m3_w8a8/ais/seed11 step=80 "salts=[1,2,3]"          # B's state, B's rollouts
    aisrl branch run=runs/x/fp8_e4m3_w8a8/ais/seed11 step=80 rollout.quant=none       # B's state, full precision
    aisrl branch run=runs/x/reference/seed11 step=80 rollout.quant=fp8_e4m3_w8a8 correction.name=ais

If B's state falls under full-precision rollouts too, the state was fragile before the branch point; if A's state
falls only under FP8 rollouts, the rollouts break it. Several salts per arm matter: late in training one
continuation of a state is a single draw, and draws of one state can end 20 points apart.

Each branch is an ordinary run folder (`out/salt<k>`: config.json, the run's start.json, metrics.jsonl,
checkpoints), so it resumes when interrupted. The base settings are the run's recorded config.json; a run trained
before runs recorded their config needs its preset and overrides instead. `out/branches.json` holds, per branch,
the held-out greedy accuracy at the branch point and at the end, its training accuracy and the mismatch (k3 KL)
over the branch's steps. A branch *falls* when its final held-out accuracy is `fall` or more below the accuracy at
the branch point; a branch whose settings give another held-out set (seed=, eval_problems=, the task's) reports
no change; a later call with other salts adds its branches to the file. A branch the trainer refuses (a setting its
checkpoint cannot take) leaves no copy behind, only its train.log. A branch that started resumes without the run's
checkpoint (a run still training drops it after `keep_checkpoints` newer ones), and the run and its branches folder
can move together. The branch's TensorBoard log holds the run's steps before the branch point too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from aisrl.checkpoint import OtherModelError, atomic_write_text, latest_step, read_record, saved_weights
from aisrl.runs import finite_values, measured_value, run_rows


@dataclass
class BranchConfig:
    run: str = ""
    """The run folder to branch from; its checkpoints/ must hold `step`."""
    step: int = 0
    """The checkpoint every branch starts from (a step the run saved and kept: see its checkpoints/ folder; a run
    keeps its latest `keep_checkpoints`, 2 by default)."""
    salts: list[int] = field(default_factory=lambda: [1, 2, 3])
    """One branch per salt, each drawing other samples from the same state: a branch's sample_salt is the run's plus
    its salt, so 0 replays the run's own continuation."""
    out: str = ""
    """Folder of the branches; default RUN/branches/step<step>, followed by the training overrides if any."""
    preset: str = ""
    """Only for a run without config.json (trained before runs recorded their config), or whose config.json names
    keys this version no longer has: the preset it was trained from. Pass the overrides it was trained with too."""
    jobs: int = 1
    """Branches at a time: 1 = in this process; N > 1 = N `aisrl train` subprocesses sharing the cores."""
    fall: float = 0.08
    """A branch falls when its final held-out greedy accuracy is this much below that at the branch point (0.08:
    8 points, about 3.5 standard errors of a 500-problem evaluation near 45%)."""
    train: list[str] = field(default_factory=list)
    """Training overrides for every branch, e.g. [rollout.quant=none] or [max_steps=150] (bare key=value arguments
    of `aisrl branch`); sample_salt and output_dir are set per branch."""


def _out(cfg: BranchConfig) -> Path:
    """`out`, or a folder under the run named by the branch point and the overrides; a name past what a file system
    takes (255 bytes: a long rollout.keep list, say) keeps its start and ends in a hash of the whole."""
    if cfg.out:
        return Path(cfg.out)
    name = f"step{cfg.step}" + "".join(f"_{o.replace('/', '-')}" for o in cfg.train)
    if len(name.encode()) > 240:
        name = name.encode()[:160].decode(errors="ignore") + "_" + hashlib.sha256(name.encode()).hexdigest()[:16]
    return Path(cfg.run) / "branches" / name


def recorded_base(run: Path, preset: str = "") -> str:
    """What a branch's settings start from: the run's recorded config.json, or `preset` where the run has none or
    recorded keys this version of aisrl no longer knows."""
    from aisrl.train_config import load_config

    recorded = run / "config.json"
    if not recorded.is_file():
        if not preset:
            raise ValueError(f"{run} has no config.json (it was trained before runs recorded their settings); pass "
                             "preset=NAME and the overrides it was trained with")  # fmt: skip
        return preset
    try:
        load_config(str(recorded), [])
    except ValueError as e:
        if not preset:
            raise ValueError(f"{recorded} does not load ({e}): written by another version of aisrl, or damaged; "
                             "pass preset=NAME and the overrides the run was trained with (its config.json shows "
                             "them, if it is readable) to branch from it") from e  # fmt: skip
        return preset
    if preset:
        raise ValueError(f"{run} records its config; drop preset={preset!r} (a branch starts from the recorded "
                         "settings; change them with key=value)")  # fmt: skip
    return str(recorded)


def branch_configs(cfg: BranchConfig) -> list[tuple[int, object, list[str]]]:
    """(salt, TrainConfig, `aisrl train` arguments) of every branch; checks the run, the step and the settings
    before anything runs."""
    from aisrl.config import check_once, override_key
    from aisrl.train_checks import MAX_SALT, validate
    from aisrl.train_config import load_config

    check_once(cfg.train, " in the training keys (train=[...] and bare keys)")
    run = Path(cfg.run)
    if not cfg.run or not run.is_dir():
        raise ValueError(f"run={cfg.run!r} is not a run folder; pass run=DIR, a folder `aisrl train` wrote")
    if any(not (_out(cfg) / f"salt{s}" / "checkpoints" / "latest").is_file() for s in cfg.salts):  # a new branch
        saved_weights(run, cfg.step, resumable=True)  # copies the checkpoint; the error lists the saved ones
    if cfg.jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {cfg.jobs}")
    if not 0 < cfg.fall <= 1:
        raise ValueError(f"fall must be an accuracy drop in (0, 1] (0.08 = 8 points), got {cfg.fall}")
    if not cfg.salts or len(set(cfg.salts)) != len(cfg.salts):
        raise ValueError(f"salts must be distinct and at least one, got {cfg.salts}")
    if not all(0 <= s < MAX_SALT for s in cfg.salts):  # each is a branch's sample_salt
        raise ValueError(f"salts must each be in [0, {MAX_SALT}), got {cfg.salts}")
    for key in ("sample_salt", "output_dir"):
        if any(override_key(o) == key for o in cfg.train):
            raise ValueError(f"{key} is set per branch; use salts=[...] and out=... instead of {key}=...")
    base = recorded_base(run, cfg.preset)
    own = load_config(base, []).sample_salt  # the run's own draws: a branch of a branch replays it at salt 0
    if own + max(cfg.salts) >= MAX_SALT:
        raise ValueError(f"the run's sample_salt {own} plus salt {max(cfg.salts)} is past {MAX_SALT - 1}; use "
                         "smaller salts")  # fmt: skip
    out = []
    for salt in cfg.salts:
        dst = _out(cfg) / f"salt{salt}"
        drawn = own + salt
        if (dst / "checkpoints" / "latest").is_file() and (dst / "config.json").is_file():  # started: resumed as
            drawn = read_record(dst / "config.json").get("sample_salt", drawn)  # it began (salts once replaced it)
        args = [base, *cfg.train, f"sample_salt={drawn}", f"output_dir={dst}"]
        tc = load_config(args[0], args[1:])
        validate(tc, output="out")
        if tc.max_steps <= cfg.step:
            raise ValueError(f"max_steps={tc.max_steps} leaves nothing to train after step {cfg.step}; "
                             "raise it with max_steps=...")  # fmt: skip
        _check_branch_point(run, cfg.step, Path(tc.output_dir))
        out.append((salt, tc, args))
    return out


def _branch_point(run: Path, step: int, dst: Path) -> dict:
    """branch.json: the run (its path, and its path from the branch, which holds when both move together) and step."""
    return {"run": str(run.resolve()), "step": step, "run_from_branch": os.path.relpath(run.resolve(), dst.resolve())}


def _check_branch_point(run: Path, step: int, dst: Path) -> None:
    """Refuse to resume a branch folder that was started from another run or step (its branch.json says which)."""
    record = dst / "branch.json"
    if not record.is_file():
        return
    was = read_record(record)
    paths = [Path(was.get("run", ""))] + ([dst / was["run_from_branch"]] if "run_from_branch" in was else [])
    if was.get("step") != step or not any(p.resolve() == run.resolve() for p in paths):
        raise ValueError(f"{dst} was branched from {was.get('run')} at step {was.get('step')}, not {run.resolve()} "
                         f"at step {step}; use another out=, or delete {dst} to branch again")  # fmt: skip


def start_from_checkpoint(run: Path, step: int, dst: Path) -> bool:
    """Make `dst` a run folder resuming at `step` of `run`: that checkpoint and the metrics up to it. Returns whether
    it did (False: started before)."""
    if (dst / "checkpoints" / "latest").is_file():
        return False  # started before: the trainer resumes it (or says it is done)
    src = saved_weights(run, step, resumable=True).parent  # the trainer resumes its optimizer and generators too
    shutil.copytree(src, dst / "checkpoints" / src.name, dirs_exist_ok=True)
    kept = [r for r in run_rows(run) if r["step"] <= step]
    atomic_write_text(dst / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in kept))
    if (run / "start.json").is_file():  # a branch starts, in the end, from the weights its run started from
        shutil.copyfile(run / "start.json", dst / "start.json")
    atomic_write_text(dst / "branch.json", json.dumps(_branch_point(run, step, dst)))
    atomic_write_text(dst / "checkpoints" / "latest", src.name)
    return True


def held_out_changes(run: Path, base: str, branch) -> list[str]:
    """Why a branch's held-out accuracy cannot be set against the run's at the branch point: the keys whose new
    values give another held-out set (seed, eval_problems, the task's settings), [] when the set is the run's. A run
    without a recorded config (`base` a preset) is taken at its preset's word."""
    import dataclasses

    from aisrl.build import problem_sets, task_of
    from aisrl.checkpoint import config_changes
    from aisrl.train_config import load_config

    if base != str(run / "config.json"):
        return []
    recorded = load_config(base, [])
    try:
        sets = [[(p.question, p.answer) for p in problem_sets(c, task_of(c))[1]] for c in (recorded, branch)]
    except (OSError, ValueError) as e:  # the run's dataset has moved (the branch names where it is now), say
        return [f"the run's held-out set cannot be rebuilt here ({e})"]
    if sets[0] == sets[1]:
        return []
    changes = config_changes(dataclasses.asdict(recorded), dataclasses.asdict(branch), free=())
    keys = ("seed:", "eval_problems:", "task:", "task_options", "dataset:", "lab.")  # what makes the held-out set
    return [c for c in changes if c.startswith(keys)] or ["the held-out problems differ"]


def summarize_branch(rows: list[dict], step: int, fall: float, comparable: bool = True) -> dict:
    """Held-out greedy accuracy at the branch point and the end, and the branch's training accuracy and k3 KL.
    `comparable` False: the branch evaluates on another held-out set than the run's, so no change is reported."""
    evals = {r["step"]: r["eval_accuracy"] for r in rows if "eval_accuracy" in r}
    after = [r for r in rows if r["step"] > step]
    start = evals.get(step)  # None when the run did not evaluate at the branch point
    end = evals[max(evals)] if evals and max(evals) > step else None
    k3 = finite_values([measured_value(r, "k3_kl") for r in after])  # a step that scored no token measured nothing
    change = None if start is None or end is None or not comparable else end - start
    return {
        "steps": len(after),
        "eval_start": start,
        "eval_end": end,
        "eval_change": change,
        "fell": None if change is None else change <= -fall + 1e-9,  # 8 points on 500 problems is 0.08 exactly
        "accuracy": statistics.fmean(r["accuracy"] for r in after) if after else None,
        "k3_kl_mean": statistics.fmean(k3) if k3 else None,
        "k3_kl_max": max(k3) if k3 else None,
    }


def run_branches(cfg: BranchConfig, log=print) -> dict:
    """Train every branch (resuming any that started before) and write out/branches.json."""
    from aisrl.jobs import train_subprocesses
    from aisrl.trainer import train

    plans = branch_configs(cfg)
    out = _out(cfg)
    if not any(r.get("step") == cfg.step and "eval_accuracy" in r for r in run_rows(Path(cfg.run))):
        log(f"branch: {cfg.run} did not evaluate at step {cfg.step}, so no change of held-out accuracy is reported; "
            "branch from a step it evaluated at to get one")  # fmt: skip
    changed = held_out_changes(Path(cfg.run), plans[0][2][0], plans[0][1])  # the salt leaves the problems alone
    if changed:
        log(f"branch: the branches evaluate on another held-out set than the run's ({'; '.join(changed)}), so no "
            "change of held-out accuracy (and no fall) is reported")  # fmt: skip
    started = []  # the folders this call copies the checkpoint into: taken back if the branches cannot train
    try:
        for _, tc, _ in plans:
            if not (Path(tc.output_dir) / "checkpoints" / "latest").is_file():
                started.append(Path(tc.output_dir))
                start_from_checkpoint(Path(cfg.run), cfg.step, Path(tc.output_dir))
        if cfg.jobs == 1:
            for salt, tc, _ in plans:
                log(f"branch: salt {salt} in {tc.output_dir}")
                train(tc, log=lambda m, salt=salt: log(f"branch salt {salt}: {m}"))
        else:
            runs = [(f"salt {salt}", args, Path(tc.output_dir)) for salt, tc, args in plans]
            train_subprocesses(runs, cfg.jobs, lambda m: log(f"branch: {m}"))
    except Exception as e:  # a setting the trainer refuses (another model's weights, say): take back the copies made
        for dst in started:
            if latest_step(dst) in (None, cfg.step):  # nothing trained past the copied checkpoint (or not copied)
                _take_back(dst)
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        if isinstance(e, OtherModelError):
            which = _model_changes(Path(cfg.run), plans[0][2][0], plans[0][1])
            raise OtherModelError(f"the branches build another model than {cfg.run}'s checkpoint holds{which}: a "
                                  "branch continues the run's weights, so it keeps the settings that shape them "
                                  f"({e})") from e  # fmt: skip
        raise
    results = {str(salt): summarize_branch(run_rows(Path(tc.output_dir)), cfg.step, cfg.fall, not changed)
               for salt, tc, _ in plans}  # fmt: skip
    results = {**_earlier_branches(out / "branches.json", cfg), **results}
    changes = [r["eval_change"] for r in results.values() if r["eval_change"] is not None]
    result = {
        "config": {**asdict(cfg), "salts": sorted(int(k) for k in results)},
        "branches": results,
        "eval_change_mean": statistics.fmean(changes) if changes else None,
        "fell": sum(bool(r["fell"]) for r in results.values()),
        "scored": len(changes),
    }
    atomic_write_text(out / "branches.json", json.dumps(result, indent=1))
    return result


def _take_back(dst: Path) -> None:
    """Remove a branch folder's copy of the checkpoint and records, keeping its train.log (a subprocess's error)."""
    for child in dst.iterdir() if dst.is_dir() else ():
        if child.name != "train.log":
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    if dst.is_dir() and not any(dst.iterdir()):
        dst.rmdir()


def _model_changes(run: Path, base: str, branch) -> str:
    """' (key: old -> new; ...)' for the model.*, lab.* and lora.* keys a branch changes, '' without a record."""
    import dataclasses

    from aisrl.checkpoint import config_changes
    from aisrl.train_config import load_config

    if base != str(run / "config.json"):
        return ""
    changes = config_changes(dataclasses.asdict(load_config(base, [])), dataclasses.asdict(branch), free=())
    keys = [c for c in changes if c.startswith(("model.", "lab.", "lora."))]
    return f" ({'; '.join(keys)})" if keys else ""


def _earlier_branches(path: Path, cfg: BranchConfig) -> dict:
    """The branches an earlier call with the same run, step and settings recorded in `path` (other salts): kept, so
    branches.json holds every branch of the folder."""
    try:
        earlier = read_record(path)
    except (FileNotFoundError, ValueError):  # none yet, or damaged: this call's branches only
        return {}
    same = ("step", "train", "preset", "fall")  # the run: by each branch's branch.json (a path may be spelt otherwise)
    if any(earlier.get("config", {}).get(k) != asdict(cfg)[k] for k in same):
        return {}
    kept = earlier.get("branches", {}).items()
    return {k: v for k, v in kept if _branched_from(Path(cfg.run), cfg.step, path.parent / f"salt{k}")}


def _branched_from(run: Path, step: int, dst: Path) -> bool:
    """Whether the branch folder `dst` exists and was branched from `run` at `step` (its branch.json)."""
    if not (dst / "branch.json").is_file():
        return False
    try:
        _check_branch_point(run, step, dst)
    except ValueError:
        return False
    return True


def table(result: dict) -> str:
    """Markdown table of a branches.json result, one row per branch."""

    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}"

    lines = ["| salt | held-out at branch | at end | change (points) | training accuracy | k3 KL mean / max |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for salt, r in result["branches"].items():
        k3 = "-" if r["k3_kl_mean"] is None else f"{r['k3_kl_mean']:.4f} / {r['k3_kl_max']:.4f}"
        lines.append(f"| {salt} | {pct(r['eval_start'])} | {pct(r['eval_end'])} | {pct(r['eval_change'])} | "
                     f"{pct(r['accuracy'])} | {k3} |")  # fmt: skip
    lines.append(f"\n{result['fell']} of {result['scored']} branches fell by {100 * result['config']['fall']:g} "
                 f"points or more; mean change {pct(result['eval_change_mean'])} points")  # fmt: skip
    return "\n".join(lines)
