"""aisrl.jobs: a stopped study or branch set stops the subprocesses it started, and shares out the cores it may use."""

import pytest


def test_a_stopped_study_stops_the_runs_it_started_and_shares_the_cores_it_may_use(tmp_path, monkeypatch):
    import os
    import subprocess
    import sys

    import aisrl.jobs as jobs

    started, envs, real = [], [], subprocess.Popen

    def popen(cmd, env, **kw):  # a run that would go on for a minute
        envs.append(env)
        started.append(real([sys.executable, "-c", "import time; time.sleep(60)"], **kw))
        return started[-1]

    real_sleep, calls = jobs.time.sleep, []

    def interrupted(seconds):  # the study's first wait is cut short (time.sleep is the module's: waits use it too)
        calls.append(seconds)
        if len(calls) == 1:
            raise KeyboardInterrupt  # Ctrl-C (SIGTERM raises SystemExit through the same path)
        real_sleep(seconds)

    monkeypatch.setattr(jobs.subprocess, "Popen", popen)
    monkeypatch.setattr(jobs.time, "sleep", interrupted)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    runs = [(f"r{i}", [], tmp_path / f"r{i}") for i in range(2)]
    logs = []
    with pytest.raises(KeyboardInterrupt):
        jobs.train_subprocesses(runs, 8, logs.append)
    assert len(started) == 2 and all(p.poll() is not None for p in started)  # before: left running
    assert logs[-2:] == ["stopped r0", "stopped r1"]
    assert {e["OMP_NUM_THREADS"] for e in envs} == {"8"}  # 16 cores over the 2 runs there are, not over jobs=8
