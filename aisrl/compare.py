"""The comparison study: the same GRPO recipe with high-precision rollouts and with low-precision rollouts
under each mismatch correction, over several seeds (docs/ais.md section 5; BENCHMARKS.md section 6).

    aisrl compare lab "methods=[none,tis,icepop,seq_mask,ais]" "formats=[fp8_e4m3_w8a8,mxfp4]" "seeds=[0,1,2]"

Every run is an ordinary `aisrl train` run in its own directory, `out/<format>/<method>/seed<k>`, plus one
reference per seed in `out/reference/seed<k>` (high-precision rollouts, no correction: at the trainer's own precision
on a CPU, BF16 GEMMs on a GPU; `reference_format`). Runs share the
preset, every override and, per seed, the prompt order and sampling seeds (the trainer derives both from
(seed, step)), so the only difference between two runs of a seed is the rollout precision and the
correction. A run that finished is skipped and an interrupted one resumes from its checkpoint, so a study
can be stopped and restarted, or run piecewise (`only=[mxfp4/ais]`) and aggregated later (`jobs=0`).

Each run records its config (`config.json`, aisrl.checkpoint.record_config). A re-run of a study whose
overrides differ from those its finished runs were trained with stops with the keys that differ, instead of
skipping those runs and aggregating results of another experiment; start such a study in a new `out`.

Aggregation (per format and method, mean and sample standard deviation over seeds):
- held-out greedy accuracy at the start, at the end and at its best (a fixed held-out set per seed);
- collapses: runs whose training accuracy (the share of correct samples, hundreds per step) over the last
  fifth of steps is below `collapse_fraction` of its best 10-step mean (a crash that does not recover). Not
  the reward: format credit puts a floor under it (0.5 of the lab's 1.5), so a run that lost every correct
  answer would keep more than half its best reward; not the held-out accuracy on 80 problems either, whose
  noise alone halves a 10% score;
- falls: runs whose final held-out greedy accuracy is `fall` or more below their best evaluation (a late loss
  a collapse misses; diagnose one with `aisrl branch`);
- training reward curves, alpha and the three AIS diagnostics, and the rollout/trainer mismatch (k3 KL,
  sequence ESS/N) early (first fifth of steps) and late (last fifth): the non-stationarity check;
- the share of step time spent in rollout, log-prob recompute, correction, update and weight sync;
- each final model scored with many samples (aisrl.final_eval): the full-precision trained policy's reward,
  the same through its low-precision rollout copy, and held-out accuracy, paired with the reference.
It writes `out/compare.json` and `out/compare.png`, and with `publish=true` also the JSON and figure under
benchmarks/results/ and a table in BENCHMARKS.md. One run's numbers come from aisrl.runs (summarize_run), the
subprocesses of `jobs` > 1 from aisrl.jobs, the tables and figure from aisrl.compare_report.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from aisrl.checkpoint import latest_step
from aisrl.config import override_key
from aisrl.jobs import train_subprocesses
from aisrl.report import TIMES
from aisrl.runs import finished, finished_rows, finite_values, last_fifth, mean_std, summarize_run

REFERENCE = "reference"
RECIPES = {
    "qarl": ["rollout.align=true", "loss=tbpo", "correction.name=none", "correction.mask_errors=true"],
    "calibrated": ["correction.calibrate_every=1"],
    "calibrated_pooled": ["correction.calibrate_every=1", "correction.calibrate_rule=pooled"],
    "calibrated_mix": ["correction.calibrate_every=1", "correction.calibrate_rule=mix"],
    "solrl": ["rollout.pool=16", "correction.name=none"],
}
"""Methods that are more than a correction: training overrides (QaRL alignment + TBPO + error-token masking;
Sol-RL: 16 low-precision candidates per prompt, the extremes kept and trained on-policy; calibrated: the
importance-weighting end point chosen at every step by its distance to a full-precision batch's gradient over the
last 8 steps, aisrl.calibrate; calibrated_pooled the end point, and calibrated_mix the mixture of end points, whose
gradient difference from full precision, averaged over the last 8 steps, is least; experiments, since they sample
every batch at full precision too)."""
FINALS = ("policy_reward", "sampler_reward", "held_reward", "held_accuracy")
"""Scores of each run's final model (aisrl.final_eval), aggregated like the rest."""


@dataclass
class CompareConfig:
    preset: str = "lab"
    """Training preset every run starts from (a name in aisrl/presets or a YAML file)."""
    methods: list[str] = field(default_factory=lambda: ["none", "tis", "icepop", "seq_mask", "ais"])
    """Methods of the low-precision runs: names of aisrl.correction.CORRECTIONS, or of RECIPES (qarl, solrl,
    calibrated, calibrated_pooled, calibrated_mix)."""
    formats: list[str] = field(default_factory=lambda: ["fp8_e4m3_w8a8", "mxfp4"])
    """Low-precision rollout formats (presets of aisrl.quant.PRESETS)."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """Training seeds (prompt order, sampling); the warm-start model is the same for all."""
    reference: bool = True
    """Also run high-precision rollouts without correction, once per seed (the reference every run is paired with)."""
    reference_format: str = "auto"
    """Rollout format of the reference: 'auto' (on a GPU BF16, as practitioners' high-precision rollouts are: the
    static engine's own 'none', else 'bf16_w16a16', BF16 weights and GEMM inputs; on a CPU full precision, 'none'),
    'none', or any preset of aisrl.quant.PRESETS."""
    train: list[str] = field(default_factory=list)
    """Training overrides applied to every run, e.g. [max_steps=60,lr=1e-3] (bare key=value arguments of
    the command line that are not compare keys land here too)."""
    only: list[str] = field(default_factory=list)
    """Run only these groups, each 'format/method' or 'reference' (empty = all); aggregation covers all."""
    jobs: int = 1
    """Runs at a time: 1 = in this process; N > 1 = N subprocesses sharing the cores; 0 = train nothing,
    aggregate (finished runs not yet scored are scored first, unless final_samples=0)."""
    out: str = "runs/compare"
    """Study directory (one sub-directory per run; compare.json and compare.png at the top)."""
    collapse_fraction: float = 0.5
    """A run collapsed if its last-fifth training accuracy is below this fraction of its best 10-step mean."""
    fall: float = 0.08
    """A run fell if its final held-out greedy accuracy is this much below its best evaluation (0.08 = 8 points,
    about 3.5 standard errors on 500 problems; on the lab's 80 it is about 2, so expect some falls from noise)."""
    publish: bool = False
    """Also write benchmarks/results/<section>.{json,png} and the `<section>` table of BENCHMARKS.md."""
    section: str = ""
    """Where publish=true writes (letters, digits, '_'): empty for `compare` (the lab preset) or `compare_<preset>`.
    A second study of one preset needs its own name, or it replaces the first's table."""
    final_samples: int = 4
    """Completions per training prompt when each finished run's final model is scored at full precision
    (aisrl.final_eval: trained-policy reward, its low-precision sampler's, held-out); 0 = skip."""


@dataclass(frozen=True)
class Run:
    fmt: str
    """Rollout format (the reference's: 'none', full precision, unless `reference_format` says otherwise)."""
    method: str
    seed: int
    reference: bool = False
    """The seed's reference run (its method is 'none'), in the group REFERENCE whatever its format."""

    @property
    def group(self) -> str:
        return REFERENCE if self.reference else f"{self.fmt}/{self.method}"

    def path(self, out: str | Path) -> Path:
        return Path(out) / self.group / f"seed{self.seed}"

    def overrides(self, cfg: CompareConfig) -> list[str]:
        method = RECIPES.get(self.method, [f"correction.name={self.method}"])
        given = {override_key(o) for o in cfg.train}  # a recipe key given too has the same value (plan): once, as
        method = [o for o in method if override_key(o) not in given]  # `aisrl train` takes each key
        return [*cfg.train, f"seed={self.seed}", f"rollout.quant={self.fmt}", *method,
                f"output_dir={self.path(cfg.out)}"]  # fmt: skip


SET_PER_RUN = {"seed": "seeds", "output_dir": "out", "rollout.quant": "formats", "correction.name": "methods"}
"""Training keys the study sets for each run, and the study key that chooses them."""


def _study_config(cfg: CompareConfig):
    """The TrainConfig every run shares: the preset with the study's overrides."""
    from aisrl.train_config import load_config

    return load_config(cfg.preset, cfg.train)


def _static_on_gpu(cfg: CompareConfig) -> tuple[bool, bool]:
    """(the study's runs train on a GPU, they sample with the static engine), from the preset and overrides."""
    from aisrl.train_config import resolve_device

    tc = _study_config(cfg)
    gpu = tc.device.startswith("cuda") or resolve_device(tc.device).type == "cuda"  # named: no need to have one here
    return gpu, tc.rollout.engine == "static"


def reference_format(cfg: CompareConfig) -> str:
    """The reference runs' rollout format: `reference_format`, with 'auto' resolved to the format the study's
    reference runs were trained with if any was (so a study started on one machine aggregates on another), else by
    the device its runs train on (the `device` of the preset with the study's overrides)."""
    from aisrl.quant import quant_config

    if cfg.reference_format != "auto":
        if cfg.reference_format != "none":
            quant_config(cfg.reference_format)  # raises with the list of presets
        return cfg.reference_format
    for recorded in sorted((Path(cfg.out) / REFERENCE).glob("seed*/config.json")):
        return json.loads(recorded.read_text())["rollout"]["quant"]
    gpu, static = _static_on_gpu(cfg)
    return "bf16_w16a16" if gpu and not static else "none"  # the static engine's 'none' is BF16 on a GPU


def _recorded_static_on_gpu(cfg: CompareConfig) -> tuple[bool, bool] | None:
    """`_static_on_gpu` as the first reference run that recorded its config trained (its device, and for 'auto' the
    machine of its start.json: a GPU where that machine had one), or None before any did."""
    from aisrl.checkpoint import read_record

    for config in sorted((Path(cfg.out) / REFERENCE).glob("seed*/config.json")):
        run, start = read_record(config), config.with_name("start.json")
        device = str(run.get("device", "auto"))
        machine = read_record(start).get("machine", {}) if start.exists() else {}
        if device == "auto" and not machine:  # a run from before start.json: where it trained is not recorded
            continue
        gpu = device.startswith("cuda") or (device == "auto" and bool(machine.get("cuda")))
        return gpu, run.get("rollout", {}).get("engine") == "static"
    return None


def reference_label(cfg: CompareConfig, fmt: str) -> str:
    """How tables and figures name the reference rollouts: by how its runs trained where any did (a study trained on a
    GPU and aggregated on a CPU keeps its label), else by how they will."""
    if fmt != "none":
        return f"{fmt} (reference)"
    gpu_static = _recorded_static_on_gpu(cfg) or _static_on_gpu(cfg)
    return "BF16 (static engine)" if all(gpu_static) else "full precision"


def _same_setting(a: str, b: str) -> bool:
    """Whether two `key=value` training overrides set the same value (`true` and `True` do)."""
    from aisrl.config import apply_overrides
    from aisrl.train_config import TrainConfig

    return apply_overrides(TrainConfig(), [a]) == apply_overrides(TrainConfig(), [b])


def plan(cfg: CompareConfig) -> list[Run]:
    """Every run of the study, reference first; validates the names before anything runs."""
    from aisrl.config import check_once
    from aisrl.correction import CORRECTIONS
    from aisrl.quant import quant_config

    check_once(cfg.train, " in the training keys (train=[...] and bare keys)")
    for item in cfg.train:
        key = override_key(item)
        if key in SET_PER_RUN:
            raise ValueError(
                f"{key} is set per run by the study; choose it with {SET_PER_RUN[key]}="
                f"{'...' if SET_PER_RUN[key] == 'out' else '[...]'}, not {item!r}"
            )

    for m in cfg.methods:
        if m not in CORRECTIONS and m not in RECIPES:
            raise ValueError(f"unknown method {m!r}; choose from {sorted(CORRECTIONS) + sorted(RECIPES)}")
        recipe = {override_key(r): r for r in RECIPES.get(m, [])}
        given = {item: recipe.get(override_key(item)) for item in cfg.train}  # item -> the recipe's
        clash = [item for item, ours in given.items() if ours is not None and not _same_setting(item, ours)]
        if clash:  # the recipe comes after the study's keys: a user's value would be overridden without a word
            sets = [given[c] for c in clash]
            raise ValueError(f"method {m!r} sets {sets} in each of its runs, which {clash} would not change there; "
                             f"drop {clash}, or leave {m!r} out")  # fmt: skip
    for f in cfg.formats:
        quant_config(f)  # raises with the list of presets
    if not cfg.seeds or not ((cfg.methods and cfg.formats) or cfg.reference):
        raise ValueError("nothing to compare: give at least one seed, and one method and one format (or "
                         "reference=true)")  # fmt: skip
    if cfg.section and not re.fullmatch(r"[A-Za-z0-9_]+", cfg.section):
        raise ValueError(f"section={cfg.section!r} names a file and a BENCHMARKS.md section: use letters, digits "
                         f"and '_' only, e.g. section=compare_mxfp4_keep8")  # fmt: skip
    if not cfg.out.strip():
        raise ValueError("out is empty: name the study's folder, e.g. out=runs/compare")
    if any(len(part.encode()) > 255 for part in Path(cfg.out).parts):
        raise ValueError(f"out={cfg.out[:60]}...: a name in it is past the 255 bytes a file system takes")
    if cfg.jobs < 0:
        raise ValueError(f"jobs must be >= 0 (runs trained at a time; 0 trains nothing and aggregates), got {cfg.jobs}")
    for key, ok, what in (("collapse_fraction", 0 < cfg.collapse_fraction <= 1, "a fraction in (0, 1]"),
                          ("fall", 0 < cfg.fall <= 1, "an accuracy drop in (0, 1] (0.08 = 8 points)"),
                          ("final_samples", cfg.final_samples >= 0, ">= 0 (0 skips the final-model scores)")):
        if not ok:
            raise ValueError(f"{key} must be {what}, got {getattr(cfg, key)}")  # fmt: skip
    for key in ("seeds", "methods", "formats"):
        values = getattr(cfg, key)
        if len(set(values)) != len(values):
            twice = sorted({v for v in values if values.count(v) > 1}, key=str)
            raise ValueError(f"{key} lists {twice} more than once: each would be the same run in the same folder")
    runs = []
    if cfg.reference:
        ref = reference_format(cfg)  # once: it may read the recorded runs' configs
        runs = [Run(ref, "none", s, reference=True) for s in cfg.seeds]
    runs += [Run(f, m, s) for f in cfg.formats for m in cfg.methods for s in cfg.seeds]
    groups = {r.group for r in runs}
    for g in cfg.only:
        if g not in groups:
            raise ValueError(f"only={g!r} is not a group of this study; choose from {sorted(groups)}")
    return runs


def _check_runs(runs: list[Run], cfg: CompareConfig, to_train: list[Run]) -> None:
    """Raise, before anything trains, if a run of `to_train` cannot train with its settings (naming its group), or if
    a run's recorded config (its first start's) differs from what this invocation would train. Only the runs to train
    must be able to train here: a study trained on a GPU aggregates on a CPU."""
    from aisrl.checkpoint import config_changes, same_dataset
    from aisrl.train_checks import validate
    from aisrl.train_config import TrainConfig, load_config, reads_dataset

    for run in runs:
        tc = load_config(cfg.preset, run.overrides(cfg))
        if run in to_train:
            try:
                validate(tc, output="out")
            except ValueError as e:
                raise ValueError(f"{run.group} cannot train with these settings: {e}") from e
        path = run.path(cfg.out) / "config.json"
        if path.exists() and latest_step(run.path(cfg.out)) is not None:  # no checkpoint: nothing to continue
            if run in to_train and reads_dataset(tc):  # a file edited since the run started, before any training
                same_dataset(run.path(cfg.out), tc.dataset)
            changes = config_changes(json.loads(path.read_text()), asdict(tc), defaults=asdict(TrainConfig()))
            if changes:
                raise ValueError(f"{run.path(cfg.out)} was trained with other settings ({'; '.join(changes)}); "
                                 f"re-run with the study's original overrides, or use a new out=")  # fmt: skip


def run_study(cfg: CompareConfig, log=print) -> dict:
    """Run what is missing (resuming interrupted runs), then aggregate; returns the aggregate dict."""
    from aisrl.train_config import load_config

    runs = plan(cfg)
    base = load_config(cfg.preset, cfg.train)  # validates the shared overrides once
    if cfg.publish:  # a published section shows the figure: say so before hours of training, not after
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise ValueError("publish=true draws the study's figure, and matplotlib is not installed: "
                             "pip install 'aisrl[plot]', or leave publish out")  # fmt: skip
    todo = [r for r in runs if (not cfg.only or r.group in cfg.only) and not finished(r.path(cfg.out), base.max_steps)]
    _check_runs(runs, cfg, todo if cfg.jobs > 0 else [])
    if cfg.jobs > 0 and todo:
        log(f"compare: {len(todo)} of {len(runs)} runs to do, {cfg.jobs} at a time, in {cfg.out}")
        if base.model.name == "lab":  # build the cached warm start once, before runs race to build it
            from aisrl.build import build

            build(base)  # the causal or the diffusion lab model, as the preset says
        (_run_here if cfg.jobs == 1 else _run_subprocesses)(todo, cfg, log)
    done = {r: finished_rows(r.path(cfg.out), base.max_steps) for r in runs}  # read once, after training
    if not any(rows is not None for rows in done.values()):  # a mistyped out= must not publish an empty table
        raise ValueError(f"no run of this study has finished under out={cfg.out!r}: check the folder (and max_steps), "
                         "or train the runs (jobs >= 1)")  # fmt: skip
    unscored = set()
    if cfg.final_samples > 0:
        scored = [r for r in runs if (not cfg.only or r.group in cfg.only) and done[r] is not None]
        unscored = _evaluate_finals(cfg, scored, log, base.max_steps)
    result = aggregate(cfg, runs, base.max_steps, done, unscored)
    from aisrl.bench.report import write_json

    if result["mixed_starts"]:
        log(f"compare: WARNING seeds {result['mixed_starts']} hold runs that started from different weights "
            "(start.json differs; a warm start rebuilt on another machine?), so they are left out of the paired "
            "differences. Train the runs of a seed from one warm start (AISRL_CACHE), on one kind of CPU.")  # fmt: skip
    write_json(Path(cfg.out) / "compare.json", result)
    from aisrl.compare_report import plot, publish

    try:
        plot(result, Path(cfg.out) / "compare.png")
    except ImportError:
        log("compare: matplotlib is not installed, no figure (pip install 'aisrl[plot]')")
    if cfg.publish:
        publish(cfg, result)
    return result


def _run_here(todo: list[Run], cfg: CompareConfig, log) -> None:
    from aisrl.train_config import load_config
    from aisrl.trainer import train

    for i, run in enumerate(todo, 1):
        log(f"compare: [{i}/{len(todo)}] {run.group} seed {run.seed}")
        train(load_config(cfg.preset, run.overrides(cfg)), log=lambda _: None)


def _run_subprocesses(todo: list[Run], cfg: CompareConfig, log) -> None:
    runs = [(f"{r.group} seed {r.seed}", [cfg.preset, *r.overrides(cfg)], r.path(cfg.out)) for r in todo]
    train_subprocesses(runs, cfg.jobs, lambda m: log(f"compare: {m}"))


def _evaluate_finals(cfg: CompareConfig, done: list[Run], log, max_steps: int) -> set[Run]:
    """Score the final model of every run in `done` (finished ones; cached per run, so a re-run only scores new
    runs); returns the runs that could not be scored (an earlier cache of theirs does not count either). A run whose
    latest checkpoint is past `max_steps` (continued further) is not scored: its final model is not the study's."""
    from aisrl.final_eval import evaluate_final, supported
    from aisrl.train_config import load_config

    if not supported(load_config(cfg.preset, cfg.train)):
        log("compare: final-model scores need causal runs (not diffusion); skipped")
        return set()
    failed = set()
    for i, run in enumerate(done, 1):
        if (latest := latest_step(run.path(cfg.out))) != max_steps:
            log(f"compare: {run.group} seed {run.seed} went on past step {max_steps} (latest checkpoint: step "
                f"{latest}); its final-model scores stay empty")  # fmt: skip
            failed.add(run)
            continue
        if i == 1 or i % 10 == 0:
            log(f"compare: scoring final models, {i}/{len(done)}")
        try:
            evaluate_final(run.path(cfg.out), load_config(cfg.preset, run.overrides(cfg)), cfg.final_samples)
        except (OSError, ValueError, RuntimeError) as e:  # one broken run must not sink a finished study
            log(f"compare: could not score {run.group} seed {run.seed} ({e}); its final-model scores stay empty")
            failed.add(run)
    return failed


def aggregate(cfg: CompareConfig, runs: list[Run], max_steps: int, done: dict | None = None,
              unscored: set = frozenset()) -> dict:  # fmt: skip
    """Per group: the seeds' summaries and their mean/std; groups without finished runs are listed as missing.
    `done` maps runs to their finished_rows where the caller read them already; `unscored` holds runs whose final
    model this invocation failed to score, whose cached scores (of another setting, say) are left out."""
    from aisrl.bench.report import machine, machine_line
    from aisrl.checkpoint import read_record
    from aisrl.final_eval import cached_scores

    groups: dict[str, dict] = {}
    trained_on: list[dict] = []  # the machines the finished runs started on (start.json), each once
    for run in runs:
        g = groups.setdefault(run.group, {"format": run.fmt, "method": run.method, "reference": run.reference,
                                          "runs": {}, "missing": []})  # fmt: skip
        # finished rows, not rows alone: a run killed saving its last step has them
        rows = done[run] if done is not None else finished_rows(run.path(cfg.out), max_steps)
        if rows is not None:
            kept = [r for r in rows if r["step"] <= max_steps]  # by step: a run may go on past the study's length
            g["runs"][str(run.seed)] = summarize_run(kept, cfg.collapse_fraction, cfg.fall)
            start = run.path(cfg.out) / "start.json"  # the run's initial weights and machine, read once
            record = read_record(start) if start.is_file() else {}
            g["runs"][str(run.seed)]["start"] = record.get("weights")
            where = record.get("machine")
            if where and machine_line(where) not in map(machine_line, trained_on):  # threads aside: one machine
                trained_on.append(where)
            if cfg.final_samples > 0 and run not in unscored:  # only scores of this checkpoint and these settings
                g["runs"][str(run.seed)].update(cached_scores(run.path(cfg.out), cfg.final_samples, max_steps) or {})
        else:
            g["missing"].append(run.seed)
    for g in groups.values():
        rs = list(g["runs"].values())
        for key in ("eval_start", "eval_final", "eval_best", "fit_start", "fit_final", "seconds_per_step",
                    "alpha_early", "alpha_late", "k3_kl_early", "k3_kl_late", "ess_early", "ess_late",
                    "alpha_kl_corr", *FINALS):  # fmt: skip
            g[key] = mean_std([r.get(key) for r in rs])
        g["reward_last_fifth"] = mean_std([last_fifth(r) for r in rs])
        g["collapses"] = sum(r["collapsed"] for r in rs)
        g["falls"] = sum(r.get("fell", False) for r in rs)
        g["time_share"] = {k: mean_std([r["time_share"].get(k) for r in rs])[0] for k in TIMES}
    if REFERENCE in groups:
        groups[REFERENCE]["label"] = reference_label(cfg, groups[REFERENCE]["format"])
    keep = _study_config(cfg).rollout.keep  # mixed-precision rollouts: say which layers stayed in full precision
    for g in groups.values():
        if keep and not g["reference"]:
            g["label"] = f"{g['format']} keeping {', '.join(keep)}"
    ref = groups.get(REFERENCE, {}).get("runs", {})
    mixed = mixed_starts(groups)
    for g in groups.values():  # paired by seed: same prompts, sampling seeds and starting weights as the reference
        # a pair counts where both sides have the number (a final score may be NaN: nothing scorable)
        seeds = [s for s in g["runs"] if s in ref and int(s) not in mixed
                 and len(finite_values([last_fifth(g["runs"][s]), last_fifth(ref[s])])) == 2]  # fmt: skip
        g["paired_seeds"] = sorted(int(s) for s in seeds)
        g["reward_vs_reference"] = mean_std([last_fifth(g["runs"][s]) - last_fifth(ref[s]) for s in seeds])
        scores = {s: [g["runs"][s].get("policy_reward"), ref[s].get("policy_reward")] for s in seeds}
        both = [s for s in seeds if len(finite_values(scores[s])) == 2]
        g["policy_paired_seeds"] = sorted(int(s) for s in both)
        g["policy_vs_reference"] = mean_std([g["runs"][s]["policy_reward"] - ref[s]["policy_reward"] for s in both])
    # `machine`: where the runs started (their timings' machine, unless one moved) if recorded, else this one
    here = machine()
    return {"config": asdict(cfg), "max_steps": max_steps, "machine": trained_on[0] if trained_on else here,
            "trained_on": trained_on, "aggregated_on": here, "groups": groups, "mixed_starts": mixed}  # fmt: skip


def mixed_starts(groups: dict[str, dict]) -> list[int]:
    """Seeds whose runs started from different weights (start.json): their pairs are not like for like. This
    happens when a study grows on another machine, where the lab model's cached warm start is rebuilt."""
    starts: dict[int, set] = {}
    for g in groups.values():
        for seed, r in g["runs"].items():
            if r.get("start"):
                starts.setdefault(int(seed), set()).add(r["start"])
    return sorted(seed for seed, s in starts.items() if len(s) > 1)


