"""`aisrl` command line: train, eval, compare (the study), branch (continuations), mismatch (the doctor), bench."""

from __future__ import annotations

import argparse
import sys

from aisrl.config import override_key


def _bench_estimator(args) -> int:
    from aisrl.bench.estimator import EstimatorBenchConfig, main
    from aisrl.config import apply_overrides

    cfg = apply_overrides(EstimatorBenchConfig(), args.overrides)
    out = args.out or "runs/estimator/estimator.json"
    main(cfg, out)
    print(f"results: {out}")
    return 0


def _mismatch(args) -> int:
    from aisrl.config import apply_overrides
    from aisrl.doctor import DoctorConfig, main

    keys = [override_key(k) for k in args.overrides]
    if args.preset or {"preset", "start"} & set(keys):  # what these set, given anyway (even at its default), is ignored
        given = [k for k in ("model", "task", "max_new_tokens", "temperature")
                 if k in keys or getattr(args, k, None) is not None]  # fmt: skip
        what = f"the preset ({args.preset!r})" if args.preset else "the preset or run (preset=, start=)"
        if given:
            raise ValueError(f"with a preset or start, {given} come from {what}; drop them, or diagnose the model "
                             "without preset and start")  # fmt: skip
    default = DoctorConfig()
    cfg = DoctorConfig(model=args.model or default.model, task=args.task or default.task, preset=args.preset or "")
    if args.formats is not None:  # --formats "" is no format, not the defaults
        cfg.formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    apply_overrides(cfg, args.overrides)
    main(cfg, args.out)
    return 0


def _train_config(args, log=print, check: bool = True):
    """TrainConfig from `[PRESET] [key=value ...]`. A run's record (`runs/x/config.json`) as the preset is that run:
    its output_dir is the folder the file is in, wherever the record says it trained (a copied or moved run would
    otherwise be continued, or scored, in its old place), unless `output_dir=` is typed."""
    from pathlib import Path

    from aisrl.train_config import DEFAULT_PRESET, load_config

    preset, overrides = _preset_and_overrides(args)
    cfg = load_config(preset or DEFAULT_PRESET, overrides, check=check)
    typed = any(override_key(o) == "output_dir" for o in overrides)
    if preset and Path(preset).name == "config.json" and not typed:
        here = Path(preset).parent
        if Path(cfg.output_dir).resolve() != here.resolve():
            log(f"aisrl: note: {preset} records output_dir={cfg.output_dir!r}; the run is the folder the file is in, "
                f"{str(here)!r} (pass output_dir=... to choose another)")  # fmt: skip
            cfg.output_dir = str(here)
    return cfg


def _train(args) -> int:
    from aisrl.trainer import train

    cfg = _train_config(args)
    s = train(cfg)
    if not s:  # a non-zero rank under torchrun: rank 0 reports
        return 0
    held = [f"{a:.1%} at step {step}" for step, a in s["eval_accuracy"]]
    if s.get("eval_accuracy_start") is not None:
        held.insert(0, f"{s['eval_accuracy_start']:.1%} at the start")
    first, last = (("-" if s[k] is None else f"{s[k]:.3f}") for k in ("reward_first_fifth", "reward_last_fifth"))
    print(f"reward: first fifth {first} -> last fifth {last}; "
          f"held-out greedy accuracy {', '.join(held) or 'not measured'}")  # fmt: skip
    print(f"report: {s['report']}  metrics: {cfg.output_dir}/metrics.jsonl  summary: {cfg.output_dir}/summary.json")
    return 0


def _compare(args) -> int:
    """`[PRESET] [key=value ...]`: keys of CompareConfig configure the study, any other key trains every run."""
    from aisrl.compare import CompareConfig, run_study
    from aisrl.compare_report import final_table, table
    from aisrl.config import apply_overrides

    cfg = CompareConfig(preset=_preset_and_overrides(args)[0] or "lab")
    own, train = _study_args(args, CompareConfig)
    apply_overrides(cfg, own)
    cfg.train += train
    result = run_study(cfg)
    print(table(result))
    if scored := final_table(result):  # the final models' scores, where they were scored
        print(f"\n{scored}")
    print(f"results: {cfg.out}/compare.json  figure: {cfg.out}/compare.png")
    return 0


def _study_args(args, config_cls) -> tuple[list[str], list[str]]:
    """Split `[PRESET] key=value ...` into the study's own keys (fields of config_cls) and training overrides."""
    import dataclasses
    import difflib

    from aisrl.train_config import TrainConfig

    items = _preset_and_overrides(args)[1]
    own = {f.name for f in dataclasses.fields(config_cls)}
    training = {f.name for f in dataclasses.fields(TrainConfig)}
    for item in items:  # a misspelt study key would otherwise be refused as a training key, the study's unnamed
        key = override_key(item)
        close = difflib.get_close_matches(key, own | training, n=1)
        if key not in own and key.split(".")[0] not in training and close:
            raise ValueError(f"unknown key {key!r}: neither a key of the study nor a training key; did you mean "
                             f"{close[0]!r}? The study's keys: {sorted(own)}; `aisrl train --help` lists the "
                             "training keys")  # fmt: skip
    return [o for o in items if override_key(o) in own], [o for o in items if override_key(o) not in own]


def _branch(args) -> int:
    """`[PRESET] run=DIR step=N [salts=[...]] [key=value ...]`: continue a run from a checkpoint, once per salt."""
    from aisrl.branch import BranchConfig, run_branches, table
    from aisrl.config import apply_overrides

    cfg = BranchConfig()
    own, train = _study_args(args, BranchConfig)
    apply_overrides(cfg, own)
    cfg.train += train  # bare training keys add to a train=[...] list, as in compare
    cfg.preset = _preset_and_overrides(args)[0] or cfg.preset
    result = run_branches(cfg)
    print(table(result))
    return 0


def _run_config(args, log=print):
    """The settings a finished run is scored with: its recorded config.json, with the overrides typed, when its
    output_dir has one (a run trained with seed=3 is scored on seed 3's held-out problems); else the preset's."""
    import dataclasses
    from pathlib import Path

    from aisrl.checkpoint import config_changes
    from aisrl.train_config import load_config, refuse_unread

    cfg = _train_config(args, log, check=False)  # typed keys are checked against the settings the run is scored with
    recorded = Path(cfg.output_dir) / "config.json"
    preset, overrides = _preset_and_overrides(args)
    if not recorded.is_file():
        refuse_unread(cfg, overrides)
        return cfg
    try:
        run_cfg = load_config(str(recorded), overrides, check=False)
    except ValueError as e:
        if not preset:  # the default preset's task and model would score the run as if it were another
            raise ValueError(f"{recorded} does not load ({e}); to score the run with a preset's settings, pass "
                             f"the one it was trained with: aisrl eval PRESET output_dir={cfg.output_dir}") from e
        log(f"aisrl: note: {recorded} does not load ({e}); scoring with the settings of preset {preset!r}")
        refuse_unread(cfg, overrides)
        return cfg
    refuse_unread(run_cfg, overrides)
    run_cfg.output_dir = cfg.output_dir  # the folder the record was read from (it may have moved since)
    if preset:
        changes = config_changes(dataclasses.asdict(run_cfg), dataclasses.asdict(cfg))
        if changes:
            log(f"aisrl: note: scoring with the settings the run recorded ({recorded}), not those of preset "
                f"{preset!r}; they differ in {'; '.join(changes)} (run's value -> preset's)")  # fmt: skip
    return run_cfg


def _eval(args) -> int:
    from aisrl.build import build_trained, cut_short, make_policy, problem_sets
    from aisrl.checkpoint import latest_checkpoint, same_dataset
    from aisrl.train_checks import validate
    from aisrl.train_config import reads_dataset, resolve_device
    from aisrl.trainer import evaluate

    cfg = _run_config(args)
    validate(cfg, output=None)  # an override (eval_problems=0, seed=-1) is named as in training; nothing written
    if reads_dataset(cfg):  # the held-out split comes from the file: scored on the rows the run trained on
        try:
            same_dataset(cfg.output_dir, cfg.dataset)
        except ValueError as e:
            if "dataset" not in {override_key(o) for o in _preset_and_overrides(args)[1]}:
                raise ValueError(f"{e}; or, to score on this file anyway, type it: dataset=PATH") from e
            print(f"aisrl: note: scoring on rows the run did not train on: {e}", file=sys.stderr)
    ckpt = latest_checkpoint(cfg.output_dir)
    if ckpt is None:
        from pathlib import Path

        runs = sorted(str(p.parent.parent) for p in Path(cfg.output_dir).rglob("checkpoints/latest"))
        hint = f"; it holds runs (a study's folder?), each scored on its own: output_dir={runs[0]}" if runs else ""
        raise ValueError(f"no checkpoint in {cfg.output_dir!r}{hint or '; train first or pass output_dir=...'}")
    model, tok, task, encode = build_trained(cfg, ckpt / "model.safetensors")
    model.to(resolve_device(cfg.device))  # full precision, like the evaluations during training
    _, held = problem_sets(cfg, task)
    if warning := cut_short(cfg, tok, held):
        print(warning, file=sys.stderr)
    acc = evaluate(model, tok, task, encode, held, make_policy(cfg, tok, model))
    print(f"{ckpt}: held-out greedy accuracy {acc:.3f} on {len(held)} problems")
    return 0


def _is_override(arg: str) -> bool:
    """Whether a first argument is a `key=value` override rather than a preset: a path to an existing file (a
    branch's folder may hold '=' in its name) is a preset, and so is anything whose part before '=' is not a dotted
    key (`runs/x=1/c.yaml`). A value that names a file (`dataset=d.json`) leaves an override an override."""
    import re

    from aisrl.config import is_file

    key = override_key(arg)  # as apply_overrides reads it: " run =r" is an override, not a preset
    # a key may be misspelt with a dash (`max-steps=3`): still an override, refused as an unknown key by name
    return "=" in arg and not is_file(arg) and re.fullmatch(r"[A-Za-z_][\w.-]*", key) is not None


def _preset_and_overrides(args) -> tuple[str | None, list[str]]:
    """`[PRESET] [key=value ...]`: the preset (None if the first argument is an override) and the overrides."""
    if args.preset and _is_override(args.preset):
        return None, [args.preset, *args.overrides]
    return args.preset, list(args.overrides)


def _refuse_repeated_keys(args) -> None:
    """A key typed twice (`lr=1e-5 ... lr=1e-6`, often a pasted command line) is refused: which one was meant?"""
    from aisrl.config import check_once

    preset = getattr(args, "preset", None)
    items = [*([preset] if preset and _is_override(preset) else []), *(getattr(args, "overrides", None) or [])]
    check_once(items)
    # a setting given both as an argument and as a key: which one was meant? (the key won in some commands, the
    # argument in others)
    keys = {override_key(item): item for item in items if "=" in item}
    if args.func in (_compare, _branch) and preset and not _is_override(preset) and "preset" in keys:
        raise ValueError(f"the preset is given twice, {preset!r} and {keys['preset']}; give one")
    if args.func is _mismatch:
        for name in ("model", "formats", "task", "preset"):
            if getattr(args, name) is not None and name in keys:
                raise ValueError(f"{name} is given twice, --{name} {getattr(args, name)} and {keys[name]}; give one")


def _keys_help(cls, note: str) -> str:
    """The epilog of a command's --help: every key of its config dataclass with its default and documentation."""
    import textwrap

    from aisrl.config import field_docs

    lines = [note]
    for key, (default, doc) in field_docs(cls).items():
        lines += [f"  {key}={default!r}", textwrap.fill(doc, 110, initial_indent=" " * 6, subsequent_indent=" " * 6)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aisrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="run a benchmark").add_subparsers(dest="bench", required=True)
    from aisrl.bench.estimator import EstimatorBenchConfig
    from aisrl.doctor import DoctorConfig

    raw = argparse.RawDescriptionHelpFormatter
    est = bench.add_parser(
        "estimator",
        help="exact-gradient MSE of the mismatch corrections on an enumerable policy (docs/ais.md section 3)",
        epilog=_keys_help(EstimatorBenchConfig, "Keys (key=value):"), formatter_class=raw,
    )
    est.add_argument("overrides", nargs="*", help="config overrides key=value, e.g. batches=100 seed=1")
    est.add_argument("--out", help="JSON output path (default runs/estimator/estimator.json)")
    est.set_defaults(func=_bench_estimator)
    mis = sub.add_parser("mismatch", help="the mismatch doctor: rollout-vs-trainer metrics per precision format",
                         epilog=_keys_help(DoctorConfig, "Keys (key=value; model, formats, task, preset also as "
                                                         "options):"), formatter_class=raw)  # fmt: skip
    mis.add_argument("--model", help="smollm2 (the default), a tiny-* model or a local HF directory")
    mis.add_argument("--formats", help="comma-separated presets from aisrl.quant.PRESETS")
    mis.add_argument("--task", help="prompt source (default arithmetic)")
    mis.add_argument("--preset", help="diagnose a training preset's model, prompts and sampling (lab, diffusion_lab)")
    mis.add_argument("--out", default="runs/mismatch", help="output directory (JSON + PNG)")
    mis.add_argument("overrides", nargs="*", help="e.g. prompts=32 max_new_tokens=128 temperature=0.7")
    mis.set_defaults(func=_mismatch)
    from aisrl.branch import BranchConfig
    from aisrl.compare import CompareConfig
    from aisrl.train_config import DEFAULT_PRESET, TrainConfig

    trains = ("Training keys (key=value, dotted for sections; the defaults shown are the dataclass's, which the preset "
              "overrides):")  # fmt: skip
    study = "Keys of the {}; any other key=value is a training key every run gets (aisrl train --help):"
    for name, fn, text, default, keys in (
            ("train", _train, "GRPO with low-precision rollouts (resumes from output_dir)", DEFAULT_PRESET,
             (TrainConfig, trains)),
            ("eval", _eval, "held-out greedy accuracy of the latest checkpoint", DEFAULT_PRESET, (TrainConfig, trains)),
            ("compare", _compare, "study: precisions x corrections x seeds", "lab",
             (CompareConfig, study.format("study"))),
            ("branch", _branch, "continue a run from a checkpoint, per salt", "the run's config",
             (BranchConfig, study.format("branches")))):  # fmt: skip
        p = sub.add_parser(name, help=text, epilog=_keys_help(*keys),
                           formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
        p.add_argument("preset", nargs="?", help=f"preset name (aisrl/presets) or YAML file; default: {default}")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. max_steps=20 correction.name=tis")
        p.set_defaults(func=fn)
    args, extra = parser.parse_known_args(argv)
    if extra and getattr(args, "overrides", None) is not None and all("=" in x for x in extra):
        args.overrides = [*args.overrides, *extra]  # overrides after an option (`mismatch a=1 --model m b=2`)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        _refuse_repeated_keys(args)
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
            PermissionError) as e:  # fmt: skip  (bad config or input, or a path that cannot be used: one line)
        print(f"aisrl: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # runs of a study that failed: each logged its own traceback, say which
        from aisrl.jobs import RunsFailed

        if not isinstance(e, RunsFailed):
            raise
        print(f"aisrl: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
