"""Run under `torchrun --nproc_per_node=2`: every correction and grpo_loss on an uneven shard per rank.

Rank 0 writes the all-reduced metrics and the DDP-style averaged gradient to the JSON path in argv[1];
tests/test_dist.py compares them with a single process on the whole batch.
"""

import json
import sys

import torch
import torch.distributed as dist

from aisrl.correction import CORRECTIONS, correct
from aisrl.dist import all_max, all_min
from aisrl.losses import AGGREGATIONS, grpo_loss


def make_batch(n=12, t=7):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(n, t, generator=g) * 3
    roll = old + 0.6 * torch.randn(n, t, generator=g)
    mask = torch.rand(n, t, generator=g) > 0.25
    mask[3] = False  # an empty sequence
    theta = old + 0.05 * torch.randn(n, t, generator=g)
    adv = torch.randn(n, generator=g)
    return old, roll, mask, theta, adv


def run(rows=slice(None)):
    """Metrics and gradient of every (correction, aggregation) on batch rows `rows`."""
    old, roll, mask, theta, adv = make_batch()
    theta = theta.clone().requires_grad_(True)
    out = {}
    for name in sorted(CORRECTIONS):
        for opts in ({}, {"normalize": True}):
            res = correct(name, old[rows], roll[rows], mask[rows], **opts)
            key = name + ("+norm" if opts else "")
            out[key] = {k: v.item() for k, v in res.metrics.items()}
            for agg in AGGREGATIONS:
                loss, m = grpo_loss(
                    theta[rows], old[rows], adv[rows], res.mask, weights=res.weights, agg=agg, horizon=7
                )
                (grad,) = torch.autograd.grad(loss, theta)
                out[f"{key}/{agg}"] = {"loss": m["loss"].item(), "grad": grad.tolist()}
    n = len(old)  # a NaN on the first row's rank or on the last row's: the max and min of every rank's are NaN
    a, b = (torch.tensor(float("nan") if i in range(n)[rows] else 1.0) for i in (0, n - 1))
    out["reduce"] = {"max": [v.item() for v in all_max(a, b)], "min": [v.item() for v in all_min(a, b)]}
    return out


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(0, 5) if rank == 0 else slice(5, None)  # uneven shards
    out = run(rows)
    for v in out.values():
        if "grad" in v:  # what DDP does: average gradients over ranks
            g = torch.tensor(v["grad"])
            dist.all_reduce(g)
            v["grad"] = (g / world).tolist()
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()
