"""The comparison study: the same GRPO recipe with high-precision rollouts and with low-precision rollouts
under each mismatch correction, over several seeds (DESIGN.md section 8; issue 5).

    aisrl compare lab methods=[none,tis,icepop,seq_mask,ais] formats=[fp8_e4m3_w8a8,mxfp4] seeds=[0,1,2]

Every run is an ordinary `aisrl train` run in its own directory, `out/<format>/<method>/seed<k>`, plus one
reference per seed in `out/reference/seed<k>` (full-precision rollouts, no correction). Runs share the
preset, every override and, per seed, the prompt order and sampling seeds (the trainer derives both from
(seed, step)), so the only difference between two runs of a seed is the rollout precision and the
correction. A run that finished is skipped and an interrupted one resumes from its checkpoint, so a study
can be stopped and restarted, or run piecewise (`only=[mxfp4/ais]`) and aggregated later (`jobs=0`).

Aggregation (per format and method, mean and sample standard deviation over seeds):
- held-out greedy accuracy at the start, at the end and at its best (a fixed held-out set per seed);
- collapses: runs whose training reward over the last fifth of steps is below `collapse_fraction` of the
  best 10-step mean reward of the run (a crash that does not recover; the reward averages hundreds of
  samples per step, unlike a held-out accuracy on 80 problems whose noise alone halves a 10% score);
- training reward curves, alpha and the three AIS diagnostics, and the rollout/trainer mismatch (k3 KL,
  sequence ESS/N) early (first fifth of steps) and late (last fifth): the non-stationarity check;
- the share of step time spent in rollout, log-prob recompute, correction, update and weight sync.
It writes `out/compare.json` and `out/compare.png`, and with `publish=true` also the JSON and figure under
benchmarks/results/ and a table in BENCHMARKS.md.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REFERENCE = "reference"
RECIPES = {
    "qarl": ["rollout.align=true", "loss=tbpo", "correction.name=none", "correction.mask_errors=true"],
    "solrl": ["rollout.pool=16", "correction.name=none"],
}
"""Methods that are more than a correction: training overrides (QaRL alignment + TBPO + error-token masking;
Sol-RL: 16 low-precision candidates per prompt, the extremes kept and trained on-policy)."""
DIAGNOSTICS = ("weight_reliability", "divergence_severity", "variance_amplification")
TIMES = ("time_rollout", "time_logprob", "time_correction", "time_train", "time_sync")


@dataclass
class CompareConfig:
    preset: str = "lab"
    """Training preset every run starts from (a name in aisrl/presets or a YAML file)."""
    methods: list[str] = field(default_factory=lambda: ["none", "tis", "icepop", "seq_mask", "ais"])
    """Methods of the low-precision runs: names of aisrl.correction.CORRECTIONS, or of RECIPES (qarl, solrl)."""
    formats: list[str] = field(default_factory=lambda: ["fp8_e4m3_w8a8", "mxfp4"])
    """Low-precision rollout formats (presets of aisrl.quant.PRESETS)."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """Training seeds (prompt order, sampling); the warm-start model is the same for all."""
    reference: bool = True
    """Also run full-precision rollouts without correction, once per seed."""
    train: list[str] = field(default_factory=list)
    """Training overrides applied to every run, e.g. [max_steps=60,lr=1e-3] (bare key=value arguments of
    the command line that are not compare keys land here too)."""
    only: list[str] = field(default_factory=list)
    """Run only these groups, each 'format/method' or 'reference' (empty = all); aggregation covers all."""
    jobs: int = 1
    """Runs at a time: 1 = in this process; N > 1 = N subprocesses sharing the cores; 0 = aggregate only."""
    out: str = "runs/compare"
    """Study directory (one sub-directory per run; compare.json and compare.png at the top)."""
    collapse_fraction: float = 0.5
    """A run collapsed if its last-fifth training reward is below this fraction of its best 10-step mean."""
    publish: bool = False
    """Also write benchmarks/results/compare.{json,png} and the table of BENCHMARKS.md."""


@dataclass(frozen=True)
class Run:
    fmt: str
    """Rollout format ('none' for the reference)."""
    method: str
    seed: int

    @property
    def group(self) -> str:
        return REFERENCE if self.fmt == "none" else f"{self.fmt}/{self.method}"

    def path(self, out: str | Path) -> Path:
        return Path(out) / self.group / f"seed{self.seed}"

    def overrides(self, cfg: CompareConfig) -> list[str]:
        method = RECIPES.get(self.method, [f"correction.name={self.method}"])
        return [*cfg.train, f"seed={self.seed}", f"rollout.quant={self.fmt}", *method,
                f"output_dir={self.path(cfg.out)}"]  # fmt: skip


def plan(cfg: CompareConfig) -> list[Run]:
    """Every run of the study, reference first; validates the names before anything runs."""
    from aisrl.correction import CORRECTIONS
    from aisrl.quant import quant_config

    for m in cfg.methods:
        if m not in CORRECTIONS and m not in RECIPES:
            raise ValueError(f"unknown method {m!r}; choose from {sorted(CORRECTIONS) + sorted(RECIPES)}")
    for f in cfg.formats:
        quant_config(f)  # raises with the list of presets
    if not cfg.seeds or not (cfg.methods or cfg.reference):
        raise ValueError("nothing to compare: give at least one seed and one method (or reference=true)")
    runs = [Run("none", "none", s) for s in cfg.seeds] if cfg.reference else []
    runs += [Run(f, m, s) for f in cfg.formats for m in cfg.methods for s in cfg.seeds]
    groups = {r.group for r in runs}
    for g in cfg.only:
        if g not in groups:
            raise ValueError(f"only={g!r} is not a group of this study; choose from {sorted(groups)}")
    return runs


def _rows(path: Path) -> list[dict]:
    f = path / "metrics.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []


def _done(run: Run, cfg: CompareConfig, max_steps: int) -> bool:
    rows = _rows(run.path(cfg.out))
    return bool(rows) and rows[-1]["step"] >= max_steps and (run.path(cfg.out) / "summary.json").exists()


def run_study(cfg: CompareConfig, log=print) -> dict:
    """Run what is missing (resuming interrupted runs), then aggregate; returns the aggregate dict."""
    from aisrl.train_config import load_config

    runs = plan(cfg)
    base = load_config(cfg.preset, cfg.train)  # validates the shared overrides once
    todo = [r for r in runs if (not cfg.only or r.group in cfg.only) and not _done(r, cfg, base.max_steps)]
    if cfg.jobs > 0 and todo:
        log(f"compare: {len(todo)} of {len(runs)} runs to do, {cfg.jobs} at a time, in {cfg.out}")
        if base.model.name == "lab":  # build the cached warm start once, before runs race to build it
            from aisrl.trainer import build

            build(base)  # the causal or the diffusion lab model, as the preset says
        (_run_here if cfg.jobs == 1 else _run_subprocesses)(todo, cfg, log)
    result = aggregate(cfg, runs, base.max_steps)
    from aisrl.bench.report import write_json

    write_json(Path(cfg.out) / "compare.json", result)
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
    """`jobs` concurrent `aisrl train` processes, each limited to its share of the cores."""
    threads = max(1, (os.cpu_count() or 1) // cfg.jobs)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    pending, active, failed = list(todo), {}, []
    while pending or active:
        while pending and len(active) < cfg.jobs:
            run = pending.pop(0)
            run.path(cfg.out).mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "aisrl.cli", "train", cfg.preset, *run.overrides(cfg)]
            with open(run.path(cfg.out) / "train.log", "a") as logf:  # the child keeps its own handle
                active[run] = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
            log(f"compare: started {run.group} seed {run.seed}")
        time.sleep(1)
        for run, proc in list(active.items()):
            if proc.poll() is None:
                continue
            del active[run]
            if proc.returncode != 0:
                failed.append(run)
                log(f"compare: {run.group} seed {run.seed} failed (exit {proc.returncode}), see its train.log")
    if failed:
        raise RuntimeError(f"{len(failed)} runs failed; fix and re-run the same command to resume them")


def _mean_std(xs: list[float]) -> tuple[float | None, float | None]:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _fifths(vals: list) -> tuple[float | None, float | None]:
    """Means of the first and the last fifth of a per-step series (None values skipped)."""
    n = max(1, len(vals) // 5)
    return _mean_std(vals[:n])[0], _mean_std(vals[-n:])[0]


def _accuracies(rows: list[dict], name: str) -> dict:
    """Greedy accuracy `name` ('eval': held-out, 'fit': training prompts) at the start, the end and its best."""
    evals = [r[f"{name}_accuracy"] for r in rows if f"{name}_accuracy" in r]
    start = rows[0].get(f"{name}_accuracy_start") if rows else None
    best = max([a for a in [start, *evals] if a is not None], default=None)
    return {f"{name}_start": start, f"{name}_final": evals[-1] if evals else None, f"{name}_best": best}


def summarize_run(rows: list[dict], collapse_fraction: float) -> dict:
    """One run's numbers: held-out accuracy (start, final, best, collapsed), reward, mismatch, time shares."""
    times = {k: _mean_std([r.get(k) for r in rows])[0] or 0.0 for k in TIMES}
    total = sum(times.values()) or 1.0
    out = {
        "steps": len(rows),
        **_accuracies(rows, "eval"),
        **_accuracies(rows, "fit"),
        "reward": [r["reward"] for r in rows],
        "eval_curve": [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r],
        "seconds_per_step": total,
        "time_share": {k: v / total for k, v in times.items()},
    }
    smooth = _smooth(out["reward"], 10)
    peak = max(smooth[9:] or smooth, default=0.0)  # full 10-step windows only (an early partial one is noise)
    late = _fifths(out["reward"])[1]
    out["collapsed"] = bool(late is not None and peak > 0 and late < collapse_fraction * peak)
    for key in ("alpha", *DIAGNOSTICS, "k3_kl", "ess"):
        out[key] = [r.get(key) for r in rows]
        out[f"{key}_early"], out[f"{key}_late"] = _fifths(out[key])
    out["alpha_kl_corr"] = _corr(out["alpha"], out["k3_kl"])  # does alpha move with the mismatch?
    return out


def _corr(xs: list, ys: list) -> float | None:
    """Pearson correlation over the steps where both are numbers (None if undefined)."""
    pairs = [(x, y) for x, y in zip(xs, ys, strict=True) if x is not None and y is not None]
    if len(pairs) < 3:
        return None
    try:
        return statistics.correlation(*zip(*pairs, strict=True))
    except statistics.StatisticsError:  # a constant series
        return None


def aggregate(cfg: CompareConfig, runs: list[Run], max_steps: int) -> dict:
    """Per group: the seeds' summaries and their mean/std; groups without finished runs are listed as missing."""
    from aisrl.bench.report import machine

    groups: dict[str, dict] = {}
    for run in runs:
        g = groups.setdefault(run.group, {"format": run.fmt, "method": run.method, "runs": {}, "missing": []})
        rows = _rows(run.path(cfg.out))
        if rows and rows[-1]["step"] >= max_steps:
            g["runs"][str(run.seed)] = summarize_run(rows[:max_steps], cfg.collapse_fraction)
        else:
            g["missing"].append(run.seed)
    for g in groups.values():
        rs = list(g["runs"].values())
        for key in ("eval_start", "eval_final", "eval_best", "fit_start", "fit_final", "seconds_per_step",
                    "alpha_early", "alpha_late", "k3_kl_early", "k3_kl_late", "ess_early", "ess_late",
                    "alpha_kl_corr"):  # fmt: skip
            g[key] = _mean_std([r[key] for r in rs])
        g["reward_last_fifth"] = _mean_std([_last_fifth(r) for r in rs])
        g["collapses"] = sum(r["collapsed"] for r in rs)
        g["time_share"] = {k: _mean_std([r["time_share"][k] for r in rs])[0] for k in TIMES}
    ref = groups.get(REFERENCE, {}).get("runs", {})
    for g in groups.values():  # paired by seed: same prompts and sampling seeds as the reference run
        seeds = [s for s in g["runs"] if s in ref]
        g["reward_vs_reference"] = _mean_std([_last_fifth(g["runs"][s]) - _last_fifth(ref[s]) for s in seeds])
    return {"config": asdict(cfg), "max_steps": max_steps, "machine": machine(), "groups": groups}


def _last_fifth(run: dict) -> float:
    return _fifths(run["reward"])[1]


def _pm(ms, scale: float = 100.0, digits: int = 1) -> str:
    m, s = ms
    return "-" if m is None else f"{m * scale:.{digits}f} ± {s * scale:.{digits}f}"


def _arrow(g: dict, key: str, digits: int = 3) -> str:
    a, b = g[f"{key}_early"][0], g[f"{key}_late"][0]
    return "-" if a is None or b is None else f"{a:.{digits}g} → {b:.{digits}g}"


def table(result: dict) -> str:
    """Markdown table: one row per group, the reference first."""
    head = ("| rollout | correction | seeds | held-out start % | final % | best % | collapses | train-prompt start % "
            "| final % | reward (last fifth) | Δ reward vs full precision (paired) "
            "| alpha early → late | k3 KL early → late | ESS/N early → late | rollout share | s/step |")  # fmt: skip
    lines = [head, "|" + "---|" * 16]
    for g in result["groups"].values():
        n = len(g["runs"])
        if not n:
            continue
        lines.append(
            f"| {'full precision' if g['format'] == 'none' else g['format']} | {g['method']} | {n} "
            f"| {_pm(g['eval_start'])} | {_pm(g['eval_final'])} | {_pm(g['eval_best'])} | {g['collapses']}/{n} "
            f"| {_pm(g['fit_start'])} | {_pm(g['fit_final'])} | {_pm(g['reward_last_fifth'], 1, 3)} "
            f"| {_pm(g.get('reward_vs_reference', (None, None)), 1, 3)} "
            f"| {_arrow(g, 'alpha')} | {_arrow(g, 'k3_kl', 2)} "
            f"| {_arrow(g, 'ess')} | {g['time_share']['time_rollout'] * 100:.0f}% "
            f"| {g['seconds_per_step'][0]:.2f} |"
        )
    return "\n".join(lines)


def _smooth(xs: list[float], w: int) -> list[float]:
    return [statistics.fmean(xs[max(0, i - w + 1) : i + 1]) for i in range(len(xs))]


def plot(result: dict, path: Path) -> None:
    """Per format: reward (mean and min-max band over seeds), held-out accuracy, alpha and k3 KL over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = result["groups"]
    formats = sorted({g["format"] for g in groups.values() if g["format"] != "none"}) or ["none"]
    fig, axes = plt.subplots(len(formats), 4, figsize=(18, 3.6 * len(formats)), squeeze=False)
    for row, fmt in zip(axes, formats, strict=True):
        for g in groups.values():
            if g["format"] not in (fmt, "none") or not g["runs"]:
                continue
            label, rs = ("full precision" if g["format"] == "none" else g["method"]), list(g["runs"].values())
            curves = [_smooth(r["reward"], 10) for r in rs]
            steps = range(1, min(map(len, curves)) + 1)
            cols = list(zip(*[c[: len(steps)] for c in curves], strict=True))
            (line,) = row[0].plot(steps, [statistics.fmean(c) for c in cols], label=label,
                                  ls="--" if g["format"] == "none" else "-")  # fmt: skip
            row[0].fill_between(steps, [min(c) for c in cols], [max(c) for c in cols], alpha=0.15,
                                color=line.get_color())  # fmt: skip
            ev = [r["eval_curve"] for r in rs]
            xs = [s for s, _ in ev[0]]
            ys = [statistics.fmean(e[i][1] for e in ev) for i in range(len(xs))]
            row[1].plot([0, *xs], [statistics.fmean(r["eval_start"] or 0 for r in rs), *ys], "o-", ms=3,
                        color=line.get_color(), label=label)  # fmt: skip
            if any(a is not None for a in rs[0]["alpha"]):
                a = [statistics.fmean(r["alpha"][i - 1] for r in rs) for i in steps]
                row[2].plot(steps, a, color=line.get_color(), label=f"{label}: alpha")
            kl = [statistics.fmean(r["k3_kl"][i - 1] or 0 for r in rs) for i in steps]
            if g["format"] != "none":
                row[3].plot(steps, _smooth(kl, 5), color=line.get_color(), label=label)
        titles = (f"{fmt}: training reward (10-step mean; band: min-max over seeds)", "held-out greedy accuracy",
                  "AIS alpha", "k3 KL(rollout || trainer), 5-step mean")  # fmt: skip
        for ax, title in zip(row, titles, strict=True):
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("step")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        row[3].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def publish(cfg: CompareConfig, result: dict, root: str | Path = ".") -> None:
    """benchmarks/results/<name>.{json,png} and the `<name>` section of BENCHMARKS.md: `compare` for the lab
    preset, `compare_<preset>` for any other (so studies of different presets keep their own tables)."""
    from aisrl.bench.report import update_section, write_json

    root = Path(root)
    from aisrl.train_config import load_config

    stem = Path(cfg.preset).stem
    if load_config(cfg.preset, cfg.train).model.kind == "diffusion" and "diffusion" not in stem:
        stem += "_diffusion"  # `lab model.kind=diffusion` must not overwrite the causal lab's table
    name = "compare" if stem == "lab" else f"compare_{stem}"
    write_json(root / f"benchmarks/results/{name}.json", result)
    plot(result, root / f"benchmarks/results/{name}.png")
    argv = [a for a in sys.argv[1:] if not a.startswith(("jobs=", "publish="))]  # how it ran, not how it was shown
    args = " ".join(shlex.quote(a) for a in argv) if argv[:1] == ["compare"] else ""
    command = f"aisrl {args}" if args else f"aisrl compare {cfg.preset} (see benchmarks/results/{name}.json)"
    body = (f"Command: `{command}`  \nMachine: {result['machine']['processor']}, {result['machine']['cpus']} CPUs, "
            f"torch {result['machine']['torch']}; {result['max_steps']} steps per run.\n\n{table(result)}\n\n"
            f"![comparison](benchmarks/results/{name}.png)\n")  # fmt: skip
    update_section(root / "BENCHMARKS.md", name, body)
