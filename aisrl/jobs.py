"""Training runs as concurrent `aisrl train` subprocesses, for a study (aisrl.compare) or a set of branches
(aisrl.branch): each process gets its share of the cores and appends its output to its run folder's train.log, and
stopping the parent stops them all.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


class RunsFailed(RuntimeError):
    """Some of the `aisrl train` processes of a study or branch set exited with an error (each logged its own)."""


def train_subprocesses(runs: list[tuple[str, list[str], Path]], jobs: int, log) -> None:
    """`jobs` concurrent `aisrl train ARGS...` processes, each limited to its share of the cores this process may use.
    `runs` holds (label, train arguments, run folder); each process appends to the folder's train.log. If this
    process stops (an error, Ctrl-C, SIGTERM), it stops the ones it started: left running, they would race a rerun's
    processes for the same folders."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // max(1, min(jobs, len(runs))))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    pending, active, failed = list(runs), {}, []
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main_thread else None
    try:
        _train_loop(pending, active, failed, jobs, env, log)
    finally:
        for proc in active.values():
            proc.terminate()
        for label, proc in active.items():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            log(f"stopped {label}")
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    if failed:
        raise RunsFailed(f"{len(failed)} runs failed ({', '.join(failed)}); each one's train.log says why; fix "
                         "and re-run the same command to resume them")  # fmt: skip


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # so that the `finally` above stops the children


def _train_loop(pending: list, active: dict, failed: list, jobs: int, env: dict, log) -> None:
    """Start runs while fewer than `jobs` are active and collect those that end, until none is left."""
    while pending or active:
        while pending and len(active) < jobs:
            label, args, folder = pending.pop(0)
            folder.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "aisrl.cli", "train", *args]
            with open(folder / "train.log", "a") as logf:  # the child keeps its own handle
                active[label] = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
            log(f"started {label}")
        time.sleep(1)
        for label, proc in list(active.items()):
            if proc.poll() is None:
                continue
            del active[label]
            if proc.returncode != 0:
                failed.append(label)
                log(f"{label} failed (exit {proc.returncode}), see its train.log")
