"""Reports of the comparison study (aisrl.compare): markdown tables, the figure, and the BENCHMARKS.md section.

Kept apart from the study itself so that running and aggregating a study reads on its own; everything here
is a function of the aggregate dict `aisrl.compare.aggregate` returns.
"""

from __future__ import annotations

import math
import shlex
import statistics
import sys
from pathlib import Path

from aisrl.compare import CompareConfig
from aisrl.runs import finite_values, smooth


def _pm(ms, scale: float = 100.0, digits: int = 1) -> str:
    m, s = ms  # mean and standard deviation over seeds (no spread for one seed)
    return "-" if m is None else f"{m * scale:.{digits}f}" + ("" if s is None else f" ± {s * scale:.{digits}f}")


def _is_reference(g: dict) -> bool:
    return g.get("reference", g["format"] == "none")  # studies aggregated before reference_format: format 'none'


def _rollout(g: dict) -> str:
    """The table's rollout column (and the figure's label) for a group."""
    if not _is_reference(g):
        return g.get("label") or g["format"]
    return g.get("label") or ("full precision" if g["format"] == "none" else f"{g['format']} (reference)")


def _arrow(g: dict, key: str, digits: int = 3) -> str:
    a, b = g[f"{key}_early"][0], g[f"{key}_late"][0]
    return "-" if a is None or b is None else f"{a:.{digits}g} → {b:.{digits}g}"


def table(result: dict) -> str:
    """Markdown table: one row per group, the reference first."""
    head = ("| rollout | correction | seeds | held-out start % | final % | best % | collapses | falls "
            "| train-prompt start % "
            "| final % | reward (last fifth) | Δ reward vs reference (paired) "
            "| alpha early → late | k3 KL early → late | ESS/N early → late | rollout share | s/step |")  # fmt: skip
    lines = [head, "|" + "---|" * 17]
    for g in result["groups"].values():
        n = len(g["runs"])
        if not n:
            continue
        lines.append(
            f"| {_rollout(g)} | {g['method']} | {n} "
            f"| {_pm(g['eval_start'])} | {_pm(g['eval_final'])} | {_pm(g['eval_best'])} | {g['collapses']}/{n} "
            f"| {g.get('falls', 0)}/{n} "
            f"| {_pm(g['fit_start'])} | {_pm(g['fit_final'])} | {_pm(g['reward_last_fifth'], 1, 3)} "
            f"| {_delta(g, 'reward_vs_reference')}{_pairs(g, n)} "
            f"| {_arrow(g, 'alpha')} | {_arrow(g, 'k3_kl', 2)} "
            f"| {_arrow(g, 'ess')} | {_pm((g['time_share']['time_rollout'], None), digits=0)}% "
            f"| {_pm((g['seconds_per_step'][0], None), 1, 2)} |"
        )
    missing = [f"{_rollout(g)} {g['method']}: {g['missing']}" for g in result["groups"].values() if g["missing"]]
    if missing:
        lines.append(f"\nSeeds not finished, left out of every cell: {'; '.join(missing)}.")
    if result.get("mixed_starts"):
        lines.append(f"\nSeeds {result['mixed_starts']} hold runs that started from different weights: they are left "
                     "out of the paired differences.")  # fmt: skip
    return "\n".join(lines)


def _delta(g: dict, key: str) -> str:
    """A paired difference from the reference; '-' in the reference's own row (0 against itself says nothing)."""
    return "-" if _is_reference(g) else _pm(g.get(key, (None, None)), 1, 3)


def _pairs(g: dict, n: int, of: str = "reward") -> str:
    """How many seeds the paired difference of `of` (reward: training reward; policy: the final model's) rests on,
    where fewer than the `n` runs its row counts."""
    key = "paired_seeds" if of == "reward" else f"{of}_paired_seeds"
    if key not in g:  # a result aggregated before the pairs were recorded: how many is unknown, not 0
        return ""
    paired = not _is_reference(g) and g.get(f"{of}_vs_reference", (None,))[0] is not None
    return f" ({len(g[key])} pairs)" if paired and len(g[key]) != n else ""


def final_table(result: dict) -> str:
    """Markdown table of the final models' scores (aisrl.final_eval); empty if no run was scored."""
    head = (
        "| rollout | correction | seeds | final model's reward (full precision, train prompts) "
        "| Δ vs reference (paired) | its rollout copy's reward | held-out sampled accuracy % |"
    )
    lines = [head, "|" + "---|" * 7]
    for g in result["groups"].values():
        if g.get("policy_reward", (None,))[0] is None:
            continue
        scored = len(finite_values([r.get("policy_reward") for r in g["runs"].values()]))  # runs with a score
        delta = _delta(g, "policy_vs_reference") + _pairs(g, scored, "policy")
        lines.append(f"| {_rollout(g)} | {g['method']} | {scored} "
                     f"| {_pm(g['policy_reward'], 1, 3)} | {delta} "
                     f"| {_pm(g['sampler_reward'], 1, 3)} | {_pm(g['held_accuracy'])} |")  # fmt: skip
    return "\n".join(lines) if len(lines) > 2 else ""


def plot(result: dict, path: Path) -> None:
    """Per format: reward (mean and min-max band over seeds), held-out accuracy, alpha and k3 KL over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = result["groups"]
    formats = sorted({g["format"] for g in groups.values() if not _is_reference(g)}) or ["none"]
    fig, axes = plt.subplots(len(formats), 4, figsize=(18, 3.6 * len(formats)), squeeze=False)
    for row, fmt in zip(axes, formats, strict=True):
        for g in groups.values():
            if not (_is_reference(g) or g["format"] == fmt) or not g["runs"]:
                continue
            label, rs = (_rollout(g) if _is_reference(g) else g["method"]), list(g["runs"].values())
            curves = [smooth(r["reward"], 10) for r in rs]
            steps = range(1, min(map(len, curves)) + 1)
            cols = list(zip(*[c[: len(steps)] for c in curves], strict=True))
            (line,) = row[0].plot(steps, [statistics.fmean(finite_values(c) or [math.nan]) for c in cols], label=label,
                                  ls="--" if _is_reference(g) else "-")  # fmt: skip
            low, high = ([f(finite_values(c), default=math.nan) for c in cols] for f in (min, max))
            row[0].fill_between(steps, low, high, alpha=0.15, color=line.get_color())
            xs, ys = _eval_curve(rs)
            if start := finite_values([r["eval_start"] for r in rs]):  # the warm start's score, where it was taken
                xs, ys = [0, *xs], [statistics.fmean(start), *ys]
            row[1].plot(xs, ys, "o-", ms=3, color=line.get_color(), label=label)
            if finite_values(a := _alpha_curve(rs, len(steps))):
                row[2].plot(steps, a, color=line.get_color(), label=f"{label}: alpha")
            kl = _kl_curve(rs, len(steps))
            if any(k > 0 for k in kl):  # not the full-precision reference's exact zeros (a log scale)
                row[3].plot(steps, smooth(kl, 5), color=line.get_color(), label=label)
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


def _eval_curve(rs: list[dict]) -> tuple[list[int], list[float]]:
    """Mean held-out accuracy over seeds at the steps every seed evaluated at. Seeds of a study extended with
    another max_steps or eval_every evaluate at different steps (the last one always); a mean over whichever seeds
    evaluated at a step would move with the seeds it holds."""
    curves = [dict(r["eval_curve"]) for r in rs]
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    return steps, [statistics.fmean(c[s] for c in curves) for s in steps]


def _alpha_curve(rs: list[dict], n: int) -> list[float]:
    """Per step, the mean alpha of the seeds that have one there (a calibrated method logs none on steps whose
    correction leaves ais out); NaN, a gap in the line, where no seed has."""
    return [statistics.fmean(finite_values([r["alpha"][i] for r in rs]) or [math.nan]) for i in range(n)]


def _kl_curve(rs: list[dict], n: int) -> list[float]:
    """Per step, the mean k3 KL of the seeds that measured one there; NaN, a gap in the line, where none did (a step
    that scored no token logs none: drawn as 0 it pulled the 5-step mean down)."""
    return [statistics.fmean(finite_values([r["k3_kl"][i] for r in rs]) or [math.nan]) for i in range(n)]


def publish(cfg: CompareConfig, result: dict, root: str | Path = ".") -> None:
    """benchmarks/results/<name>.{json,png} and the `<name>` section of BENCHMARKS.md: `cfg.section` if set, else
    `compare` for the lab preset and `compare_<preset>` for any other (so studies of different presets keep their
    own tables)."""
    from aisrl.bench.report import machine_line, update_section, write_json

    root = Path(root)
    from aisrl.train_config import load_config

    stem = Path(cfg.preset).stem
    if load_config(cfg.preset, cfg.train).model.kind == "diffusion" and "diffusion" not in stem:
        stem += "_diffusion"  # `lab model.kind=diffusion` must not overwrite the causal lab's table
    name = cfg.section or ("compare" if stem == "lab" else f"compare_{stem}")
    write_json(root / f"benchmarks/results/{name}.json", result)
    plot(result, root / f"benchmarks/results/{name}.png")
    argv = [a for a in sys.argv[1:] if not a.startswith(("jobs=", "publish=", "only="))]  # the study, not how it ran
    args = " ".join(shlex.quote(a) for a in argv) if argv[:1] == ["compare"] else ""
    command = f"aisrl {args}" if args else f"aisrl compare {cfg.preset} (see benchmarks/results/{name}.json)"
    where = result.get("trained_on")  # several: a study grown on more than one machine
    said = (f"Machine{'s' if len(where) > 1 else ''} the runs started on: {'; '.join(map(machine_line, where))}"
            if where else f"Machine: {machine_line(result['machine'])}")  # a result from before start.json
    body = (f"Command: `{command}`  \n{said}; "
            f"{result['max_steps']} steps per run. Cells are mean ± standard "
            f"deviation over seeds; a collapse is a run whose last-fifth training accuracy is below "
            f"{cfg.collapse_fraction:g} of its best 10-step mean; a fall, a run whose final held-out greedy "
            f"accuracy is {100 * cfg.fall:g} points or more below its best evaluation.\n\n{table(result)}\n\n"
            f"{final_table(result)}\n\n"
            f"![comparison](benchmarks/results/{name}.png)\n")  # fmt: skip
    update_section(root / "BENCHMARKS.md", name, body)
