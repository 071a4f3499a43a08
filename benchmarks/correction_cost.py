"""Cost of the correction next to the loss it multiplies, on (N=512, T=1024) tensors.

    python benchmarks/correction_cost.py [N] [T]

Times (median of repeats, after a warm-up) `correct(name, ...)` for none / tis / ais with its full
metric set, and one `grpo_loss` forward, and forward+backward, on the same tensors. Writes
benchmarks/results/correction_cost.json and the `correction_cost` section of BENCHMARKS.md; other sizes (a smoke
run, say) write correction_cost_N{N}_T{T}.json and a section of that name, leaving the published figures alone.
"""

import statistics
import sys
import time
from pathlib import Path

import torch

from aisrl.bench.cli import command
from aisrl.bench.report import machine, update_section, write_json
from aisrl.correction import correct
from aisrl.losses import grpo_loss

ROOT = Path(__file__).resolve().parent.parent


def timed(fn, repeats=7):
    fn()  # warm-up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


SIZE = (512, 1024)  # (N, T) of the published section


def name(n: int, t: int) -> str:
    """The results' name (and BENCHMARKS.md section) of a run at N=n, T=t."""
    return "correction_cost" if (n, t) == SIZE else f"correction_cost_N{n}_T{t}"


def main(n=SIZE[0], t=SIZE[1]):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(n, t, generator=g) * 4
    roll = old + 0.15 * torch.randn(n, t, generator=g)
    lengths = torch.randint(t // 4, t + 1, (n,), generator=g)
    mask = torch.arange(t)[None] < lengths[:, None]  # (N, T) right-padded
    logp = (old + 0.01 * torch.randn(n, t, generator=g)).requires_grad_(True)
    adv = torch.randn(n, generator=g)
    res = correct("ais", old, roll, mask)

    def fwd_bwd():
        loss, _ = grpo_loss(logp, old, adv, mask, weights=res.weights)
        loss.backward()
        logp.grad = None

    times = {f"correct({name!r})": timed(lambda name=name: correct(name, old, roll, mask)) for name in
             ("none", "tis", "ais")}  # fmt: skip
    times["grpo_loss forward"] = timed(lambda: grpo_loss(logp, old, adv, mask, weights=res.weights))
    times["grpo_loss forward+backward"] = timed(fwd_bwd)
    return {"N": n, "T": t, "seconds": times, "machine": machine()}


if __name__ == "__main__":
    if len(sys.argv) > 3 or not all(a.isdigit() and int(a) > 0 for a in sys.argv[1:]):
        sys.exit("usage: python benchmarks/correction_cost.py [N [T]] (sequences and tokens per sequence)")
    args = [int(a) for a in sys.argv[1:3]]
    out = main(*args)
    results = name(out["N"], out["T"])
    write_json(ROOT / f"benchmarks/results/{results}.json", out)
    ref = out["seconds"]["grpo_loss forward"]
    m = out["machine"]
    rows = [f"| `{k}` | {v * 1e3:.1f} | {v / ref:.2f}x |" for k, v in out["seconds"].items()]
    body = (
        f"Command: `{command(__file__)}` on {m['cpus']} CPUs ({m['processor']}), "
        f"torch {m['torch']}, {m['torch_threads']} threads; N={out['N']}, T={out['T']} "
        f"(~{out['N'] * out['T'] / 1e6:.2f}M token positions), median of 7.\n\n"
        "| operation | ms | vs grpo_loss forward |\n|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    print(body)
    update_section(ROOT / "BENCHMARKS.md", results, body)
