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


def test_failed_runs_are_named_by_exit_code_and_jobs_bound_how_many_run_at_once(tmp_path, monkeypatch):
    # fake processes that end on their second poll: `b` with an error, `c` killed by a signal (exit -9); at most
    # `jobs` run at once, each on 1 core when there are fewer cores than jobs; logs are appended to, the SIGTERM
    # handler is the caller's again afterwards (cases a reviewer's mutants of aisrl.jobs passed)
    import os
    import signal

    import aisrl.jobs as jobs

    codes, live, peak, envs = {"a": 0, "b": 1, "c": -9, "d": 0}, [], [], []

    class Proc:
        def __init__(self, cmd, stdout, stderr, env):
            self.label, self.returncode, self.polls = cmd[-1], None, 0
            envs.append(env)
            live.append(self)
            peak.append(sum(p.returncode is None for p in live))

        def poll(self):
            self.polls += 1
            if self.polls >= 2:
                self.returncode = codes[self.label]
            return self.returncode

    monkeypatch.setattr(jobs.subprocess, "Popen", Proc)
    monkeypatch.setattr(jobs.time, "sleep", lambda s: None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "train.log").write_text("earlier run\n")
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(jobs.RunsFailed, match=r"2 runs failed \(b, c\)"):
        jobs.train_subprocesses([(k, [k], tmp_path / k) for k in codes], 2, lambda m: None)
    assert max(peak) == 2 and len(live) == 4
    assert {e["OMP_NUM_THREADS"] for e in envs} == {"1"}  # one core over two jobs: 1 each, never 0
    assert (tmp_path / "a" / "train.log").read_text() == "earlier run\n"  # a resumed run's log is kept
    assert signal.getsignal(signal.SIGTERM) is handler
