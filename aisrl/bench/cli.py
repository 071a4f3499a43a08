"""The command lines of the benchmark scripts (benchmarks/*.py): their `key=value` options, checked before anything
runs, and the command a result records."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path


def options(argv: list[str], keys: Iterable[str], positional: bool = False,
            usage: str = "") -> tuple[list[str], dict[str, str]]:  # fmt: skip
    """(arguments without '=', {key: value} of the `key=value` ones). A key not among `keys`, a key given twice, or
    an argument without '=' where there is none to give (`positional` false) is an error naming it and the valid
    keys: a misspelt option would otherwise run with its default and be recorded as if it had been set."""
    keys = list(keys)
    pos = [a for a in argv if "=" not in a]
    names = [a.split("=", 1)[0] for a in argv if "=" in a]
    unknown = sorted(set(names) - set(keys))
    twice = sorted({k for k in names if names.count(k) > 1})
    problem = (f"unknown keys {unknown}" if unknown else f"keys given twice {twice}" if twice
               else f"arguments without '=' {pos}" if pos and not positional else "")  # fmt: skip
    if problem:
        usage = f"\nusage: {usage}" if usage else ""
        raise SystemExit(f"{problem}; the options are key=value with keys {keys}{usage}")
    return pos, dict(a.split("=", 1) for a in argv if "=" in a)


def flag(kw: Mapping[str, str], key: str, default: bool) -> bool:
    """An on/off option: 1/true/yes or 0/false/no (any case), `default` when absent; anything else is an error naming
    the key (a `hf=true` read as off would drop a measurement without a word)."""
    text = kw.get(key)
    if text is None:
        return default
    if text.lower() in ("1", "true", "yes", "0", "false", "no"):
        return text.lower() in ("1", "true", "yes")
    raise SystemExit(f"{key}={text!r}: give 1/true/yes or 0/false/no")


def number(kw: Mapping[str, str], key: str, default: float | None, kind: type = int, low: float | None = None):
    """Option `key` read as `kind` (int or float), `default` when absent. Text that is not a `kind` (`steps=ten`,
    `steps=2.5`), a NaN or infinity, or a value below `low` is an error naming the key and what to give, not a
    traceback from deep in the run."""
    text = kw.get(key)
    return default if text is None else _read(key, text, kind, low)


def numbers(kw: Mapping[str, str], key: str, default: list, kind: type = int, low: float | None = None) -> list:
    """Option `key` as a comma-separated list of `kind` (`seeds=0,1,2`), `default` when absent; an empty list or an
    entry that is not a `kind` at least `low` is an error naming the key."""
    text = kw.get(key)
    if text is None:
        return list(default)
    parts = [t.strip() for t in text.split(",")]
    if not any(parts):
        raise SystemExit(f"{key}={text!r}: give one or more {kind.__name__}s separated by commas, e.g. {key}=1,2")
    return [_read(key, t, kind, low, whole=text) for t in parts]


def choice(kw: Mapping[str, str], key: str, default: str, choices: Iterable[str]) -> str:
    """Option `key`, one of `choices` (`default` when absent); anything else is an error listing them."""
    text, choices = kw.get(key, default), list(choices)
    if text not in choices:
        raise SystemExit(f"{key}={text!r}: choose from {sorted(choices)}")
    return text


def study_folders(paths: Iterable[str | Path]) -> list[Path]:
    """The folders given, each of which must exist: one missing is an error naming it, not an empty study."""
    folders = [Path(p) for p in paths]
    missing = [str(f) for f in folders if not f.is_dir()]
    if missing or not folders:
        raise SystemExit(f"no such folder: {missing} (pass `aisrl compare` output folders)")
    return folders


def _read(key: str, text: str, kind: type, low: float | None, whole: str | None = None):
    """`text` as a finite `kind` at least `low`, or an error naming `key` (and the whole list it came from)."""
    shown = f"{key}={text!r}" if whole is None else f"{key}={whole!r} (entry {text!r})"
    try:
        value = kind(text)
    except ValueError:
        raise SystemExit(f"{shown}: give {'an integer' if kind is int else 'a number'}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise SystemExit(f"{shown}: give a finite number")
    if low is not None and value < low:
        raise SystemExit(f"{shown}: give a value of at least {low}")
    return value


def subcommand(argv: list[str], commands: Mapping[str, Iterable[str]]) -> tuple[str, dict[str, str]]:
    """(command, options) of `[COMMAND] [key=value ...]`; `commands` maps each command to its keys, the first being
    the default. The first argument is the command unless it holds '=' (an option of the default); an unknown command
    is an error, not a run of the default."""
    named = bool(argv) and "=" not in argv[0]
    what = argv[0] if named else next(iter(commands))
    if what not in commands:
        raise SystemExit(f"unknown command {what!r}; choose from {list(commands)}")
    return what, options(argv[named:], commands[what])[1]


def command(script: str, argv: list[str] | None = None) -> str:
    """The command line a result records, `python benchmarks/NAME.py ARGS` (`script`: the script's __file__; argv: by
    default this process's arguments), after `OMP_NUM_THREADS=N ` where that is set: the thread count moves timings,
    and through the order of reductions the last bits of some figures."""
    threads = os.environ.get("OMP_NUM_THREADS")
    env = [f"OMP_NUM_THREADS={threads}"] if threads else []
    args = sys.argv[1:] if argv is None else argv  # quoted as a shell needs them: strengths="[0.05, 0.2]" runs again
    return " ".join([*env, "python", f"benchmarks/{Path(script).name}", *(shlex.quote(a) for a in args)])
