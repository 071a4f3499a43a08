"""Reductions that give the same answer on one process and on many.

Every batch statistic in aisrl (a diagnostic, a loss denominator) is built from sums, maxima and
minima of per-token quantities. When `torch.distributed` is initialised, those are all-reduced
across ranks *before* any ratio is taken, so a statistic computed on a sharded batch equals the one
computed on the whole batch in a single process (AIS property 6, tests/test_dist.py). Each helper
stacks its arguments and issues a single collective, so a metric set costs a handful of
all-reduces, not one per number.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

_LOCAL = False


def is_distributed() -> bool:
    """True when a default process group exists (torchrun / init_process_group was called) and reductions
    are not switched off by `local_only()`."""
    return not _LOCAL and dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def local_only():
    """Statistics of this process's tensors only, even under torch.distributed: for engines (verl) that call
    a loss per micro-batch, where ranks may run different numbers of micro-batches and a collective would hang."""
    global _LOCAL
    prev, _LOCAL = _LOCAL, True
    try:
        yield
    finally:
        _LOCAL = prev


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def _reduce(xs: tuple[torch.Tensor, ...], op) -> tuple[torch.Tensor, ...]:
    if not is_distributed() or not xs:
        return xs
    flat = torch.stack([x.reshape(()).to(torch.float64) for x in xs])  # (k,)
    if op == dist.ReduceOp.MAX:  # gloo's max keeps or drops a NaN by rank; one process's max of a NaN is NaN
        nan = torch.isnan(flat)  # (k,)
        both = torch.cat([flat.masked_fill(nan, -torch.inf), nan.double()])  # (2k,): values, and NaN flags
        dist.all_reduce(both, op=op)
        flat = both[: len(xs)].masked_fill(both[len(xs) :] > 0, torch.nan)
    else:
        dist.all_reduce(flat, op=op)
    return tuple(v.to(x.dtype) for v, x in zip(flat.unbind(0), xs, strict=True))


def all_gather_cpu(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's `t` (a CPU tensor of one shape and dtype on every rank), in rank order; [t] in one process."""
    if not is_distributed():
        return [t]
    out = [torch.empty_like(t) for _ in range(world_size())]
    torch.distributed.all_gather(out, t)
    return out


def rank_rng_states(device: torch.device) -> list[dict]:
    """Every rank's generator states (CPU, and its GPU's), in rank order: each rank draws its own dropout masks."""
    own = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        own["cuda"] = torch.cuda.get_rng_state(device)
    gathered = [all_gather_cpu(v) for v in own.values()]  # per key: one tensor per rank
    return [dict(zip(own, states, strict=True)) for states in zip(*gathered, strict=True)]


def all_sum(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Sum scalars over ranks (identity on one process)."""
    return _reduce(xs, dist.ReduceOp.SUM if is_distributed() else None)


def all_max(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Max of scalars over ranks (identity on one process)."""
    return _reduce(xs, dist.ReduceOp.MAX if is_distributed() else None)


def all_min(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Min of scalars over ranks, as the negated max of negations (gloo has no MIN for all dtypes)."""
    return tuple(-v for v in all_max(*(-x for x in xs)))
