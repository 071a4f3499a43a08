"""Do the `ais` and `tis` training paths differ beyond alpha? (issue 5; docs/ais.md section 5)

    OMP_NUM_THREADS=1 python benchmarks/ais_tis_paths.py [steps=8] [quant=fp8_e4m3_w8a8] [seed=0]

Trains the lab preset three times for a few steps in fresh directories under /tmp: TIS, AIS with alpha
forced to 1 (`aisrl.correction.ais_alpha` patched), and AIS as it is. By construction the first two compute
the same weights, so any difference between them is a difference of code path. Prints reward and grad norm
per step for the three runs; the first two must agree bit for bit.
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from aisrl.bench.cli import number, options

CHILD = """
import sys, torch
if sys.argv[2] == "1":
    import aisrl.correction as corr
    corr.ais_alpha = lambda *a: torch.ones((), dtype=torch.float64)
from aisrl.train_config import load_config
from aisrl.trainer import train
train(load_config("lab", sys.argv[3:]), log=lambda _: None)
"""


def main(steps: int, quant: str, seed: int) -> dict:
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, name, force in (("tis", "tis", "0"), ("ais_alpha1", "ais", "1"), ("ais", "ais", "0")):
            out = Path(tmp) / label
            args = [f"seed={seed}", f"rollout.quant={quant}", f"correction.name={name}", f"output_dir={out}",
                    f"max_steps={steps}", "eval_every=1000", "checkpoint_every=1000"]  # fmt: skip
            done = subprocess.run([sys.executable, "-c", CHILD, label, force, *args], capture_output=True, text=True)
            if done.returncode:  # the training run's own message (a bad format, say), not only its command line
                raise SystemExit(f"the {label} run failed:\n{done.stderr.strip()[-2000:]}")
            runs[label] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for i in range(steps):
        cells = "  ".join(f"{k}: {r[i]['reward']:.6f} {r[i]['grad_norm']:.8f}" for k, r in runs.items())
        print(f"step {i + 1}  {cells}")
    same = all(a["reward"] == b["reward"] and a["grad_norm"] == b["grad_norm"]
               for a, b in zip(runs["tis"], runs["ais_alpha1"], strict=True))  # fmt: skip
    print("tis and ais with alpha = 1 agree bit for bit:", same)
    return {"identical": same, "runs": runs}


if __name__ == "__main__":
    _, kw = options(sys.argv[1:], ("steps", "quant", "seed"))
    main(number(kw, "steps", 8, low=1), kw.get("quant", "fp8_e4m3_w8a8"), number(kw, "seed", 0, low=0))
