"""Writing benchmark results: JSON next to a machine description, and a section of BENCHMARKS.md."""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from aisrl.checkpoint import atomic_write_text

try:
    import fcntl
except ImportError:  # not POSIX (Windows): sections are written without a lock
    fcntl = None


def _cpu_model() -> str | None:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), None)


def machine() -> dict:
    """What the numbers were measured on."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the kernels torch picked (AVX2, AVX512...)
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def write_json(path: str | Path, data: dict) -> None:
    """Atomic JSON write (temp file + rename); a NaN or an infinity is written as null (bare NaN is not JSON, and
    strict readers refuse the whole file)."""
    atomic_write_text(path, json.dumps(_finite_or_null(data), indent=1, allow_nan=False))


def _finite_or_null(x):
    """`x` with every non-finite float, however deep in dicts, lists and tuples, replaced by None."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite_or_null(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite_or_null(v) for v in x]
    return x


@contextmanager
def staged_json(path: str | Path) -> Iterator[Callable[[dict], None]]:
    """A save(data) function for a run's results as they grow: each save goes to PATH.partial, which is renamed over
    `path` only when the block ends without an error, so a failed or interrupted run leaves the published file as it
    was (and its progress in PATH.partial)."""
    partial, saved = Path(f"{path}.partial"), []
    partial.unlink(missing_ok=True)  # an earlier, interrupted run's progress is not this run's

    def save(data: dict) -> None:
        write_json(partial, data)
        saved.append(True)

    yield save
    if saved:  # a run that saved nothing leaves the published file as it was
        os.replace(partial, path)


def machine_line(m: dict | None = None) -> str:
    """`machine()` in a few words, for the line under a benchmark's table: what the figures were measured on."""
    m = m or machine()
    where = f"{m['cuda']}, " if m.get("cuda") else ""
    return f"{where}{m.get('cpu') or m['processor']}, {m['cpus']} CPUs, torch {m['torch']}"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `.NAME.lock` beside `path` for the block (not on `path` itself, which a rename
    replaces while others wait on it); without fcntl (not POSIX) there is no lock."""
    if fcntl is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def settings_tag(settings: dict, published: list[dict]) -> str:
    """'' where `settings` (a run's settings that differ from the script's defaults) are those of a published
    section, else a stable 8-digit hash of them: a run with other settings, a smoke run say, then writes under names
    of its own and leaves the published figures alone."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]
    return "" if settings in published else digest


_MARKER = re.compile(r"<!-- (BEGIN|END) \S+ -->")


def update_section(path: str | Path, name: str, body: str) -> None:
    """Replace the text between `<!-- BEGIN name -->` and `<!-- END name -->`, appending if absent. The file is read,
    changed and replaced under a lock, so that benchmarks finishing together keep each other's sections."""
    path = Path(path)
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    if "<!-- BEGIN " in body or "<!-- END " in body:  # a marker inside would unpair this section, or another's
        raise ValueError(f"the body of section {name!r} holds a section marker (<!-- BEGIN/END ... -->); quote it "
                         "differently")  # fmt: skip
    with _locked(path):
        text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
        # markers are whole lines (one quoted in prose is text); the section's must be one pair, in order, holding
        # no other section's marker (interleaved sections: replacing one would delete the other's start)
        lines = text.split("\n")
        starts, ends = ([i for i, line in enumerate(lines) if line.strip() == m] for m in (begin, end))
        inner = starts and ends and any(_MARKER.fullmatch(line.strip()) for line in lines[starts[0] + 1 : ends[0]])
        if len(starts) > 1 or len(starts) != len(ends) or (starts and ends[0] < starts[0]) or inner:
            raise ValueError(f"{path}: the markers of section {name!r} are unpaired, repeated or interleaved with "
                             f"another section's; mend them by hand (one {begin} line, then one {end} line, no other "
                             "section's marker between them), so that no text between them is lost")  # fmt: skip
        block = [begin, body.rstrip(), end]
        if starts:
            lines[starts[0] : ends[0] + 1] = block
            text = "\n".join(lines)
        else:
            text = text.rstrip() + "\n\n" + "\n".join(block) + "\n"
        atomic_write_text(path, text)


def step_timer():
    """(callback, times): a transformers TrainerCallback that appends each optimizer step's wall seconds to
    `times` (for benchmarks of Hugging Face / TRL trainers; transformers is imported here, lazily)."""
    import time

    from transformers import TrainerCallback

    times: list[float] = []
    start = [0.0]

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            start[0] = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            times.append(time.perf_counter() - start[0])

    return StepTimer(), times
