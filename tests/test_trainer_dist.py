"""`aisrl train` under torchrun (2 gloo processes) gives the per-step metrics of a single process."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_LAB, untimed

import aisrl

TINY = [*TINY_LAB, "max_steps=2", "micro_batch=4", "device=cpu"]  # gloo on the CPU, also on a 1-GPU machine


def _run(cmd, env):
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0, err[-3000:]


@pytest.mark.slow
def test_torchrun_matches_single_process(tmp_path):
    root = str(Path(aisrl.__file__).parents[1])  # the processes import the aisrl under test, not an installed one
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "AISRL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    # give the untrained policy a reward signal that varies with the completion (see test_lora.py), and a correctness
    # that varies with the problem too, so that the held-out evaluation, shared out over the ranks, counts something
    boot = ("import sys, aisrl.tasks as t; t.Arithmetic.reward = lambda self, x, p: (float(len(x) % 3), "
            "(len(x) + len(p.question)) % 2 == 0); "
            "from aisrl.cli import main; sys.exit(main(sys.argv[1:]))")  # fmt: skip
    script = tmp_path / "boot.py"
    script.write_text(boot)
    _run([sys.executable, str(script), "train", "lab", *TINY, f"output_dir={tmp_path / 'one'}"], env)
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), "train",
          "lab", *TINY, f"output_dir={tmp_path / 'two'}"], env)  # fmt: skip
    one = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    two = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in two] == [1, 2]
    assert one[0]["reward"] != one[1]["reward"] or one[0]["k3_kl"] != one[1]["k3_kl"]  # the steps differ
    assert 0 < one[0]["eval_accuracy_start"] < 1 and 0 < one[-1]["fit_accuracy"] < 1
    for a, b in zip(one, two, strict=True):
        for k, v in untimed(a).items():
            if v is None:
                continue
            assert b[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k


@pytest.mark.slow
def test_a_torchrun_resume_is_exact_with_dropout(tmp_path):
    # each rank draws its own dropout masks: a checkpoint that kept rank 0's generator only resumed rank 1 with
    # rank 0's state, and the resumed run left the uninterrupted one at the first step after the checkpoint
    pytest.importorskip("peft")
    root = str(Path(aisrl.__file__).parents[1])  # the processes import the aisrl under test, not an installed one
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "AISRL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    boot = ("import sys, aisrl.tasks as t; t.Arithmetic.reward = lambda self, x, p: (float(len(x) % 3), False); "
            "from aisrl.cli import main; sys.exit(main(sys.argv[1:]))")  # fmt: skip
    script = tmp_path / "boot.py"
    script.write_text(boot)
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), "train",
           "lab", *TINY_LAB, "device=cpu", "micro_batch=4", "lora.r=4", "lora.dropout=0.3",
           "checkpoint_every=1"]  # fmt: skip
    _run([*run, "max_steps=3", f"output_dir={tmp_path / 'full'}"], env)
    _run([*run, "max_steps=2", f"output_dir={tmp_path / 'resumed'}"], env)
    _run([*run, "max_steps=3", f"output_dir={tmp_path / 'resumed'}"], env)
    full, resumed = ([json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                     for d in ("full", "resumed"))  # fmt: skip
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for k, v in untimed(full[2]).items():
        assert resumed[2][k] == v, k
