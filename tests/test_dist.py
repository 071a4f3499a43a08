"""AIS property 6 (tests/test_ais.py): two gloo processes give the single-process diagnostics and gradient."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import aisrl

HERE = Path(__file__).parent


@pytest.mark.slow
def test_torchrun_two_processes_match_single_process(tmp_path):
    out = tmp_path / "dist.json"
    # the workers import the aisrl this test imported (a checkout's, not an installed copy), then the caller's path
    root = Path(aisrl.__file__).parents[1]
    path = os.pathsep.join(filter(None, [str(root), str(HERE), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(HERE / "dist_worker.py"), str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        _, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both workers: nothing left behind
        raise
    assert proc.returncode == 0, err[-3000:]
    sharded = json.loads(out.read_text())
    sys.path.insert(0, str(HERE))
    from dist_worker import run

    single = run()
    assert all(v != v for v in single["reduce"]["max"] + single["reduce"]["min"])  # NaN on one process too
    assert sharded.keys() == single.keys()
    for key, ref in single.items():
        for metric, value in ref.items():
            got = torch.tensor(sharded[key][metric], dtype=torch.float64)
            want = torch.tensor(value, dtype=torch.float64)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, equal_nan=True, msg=f"{key}: {metric}")
