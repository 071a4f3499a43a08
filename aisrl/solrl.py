"""Sol-RL's selection: explore cheaply at low precision, train on the few samples that teach the most.

Sol-RL (FP4 explore, high-precision train) samples a large candidate pool per prompt with a cheap rollout
format, keeps the most informative samples, and trains on them at high precision. Here: K candidates per
prompt from the quantised rollout copy; per prompt the G/2 lowest-reward and G - G/2 highest-reward
candidates are kept (the extremes carry the largest group-normalised advantages, the strongest contrast);
they are then rescored at training precision (the old log-probs of the PPO ratio) and trained on as
on-policy samples, the G kept forming the group whose rewards normalise the advantages (the pool's mean would
give the rare high reward of a mostly failed pool a larger advantage; the kept group is what the update sees,
as in GRPO over G samples): no correction weights (correction.name=none), while the rollout/trainer mismatch
metrics are still logged from the low-precision log-probs. The selection itself biases the gradient
towards the extremes; that is the method's bet, measured in the comparison study, not corrected here.
Extra cost: K / G times the rollout work, reported as time_rollout.
"""

from __future__ import annotations

import math

import torch


def select_extremes(rewards: torch.Tensor, pool: int, keep: int) -> torch.Tensor:
    """Indices into `rewards` ((B * pool,), grouped by prompt) of the keep // 2 lowest and keep - keep // 2
    highest rewards of each prompt's pool, in prompt order (a stable sort: among equal rewards the low end takes
    earlier candidates, the high end later ones). A NaN or infinite reward (a candidate that could not be scored; the
    advantages give it 0) is taken only when fewer than `keep` candidates of its pool were scored."""
    if pool < 2:
        raise ValueError(f"pool is the candidates sampled per prompt, at least 2 (keep >= 2 of them); got {pool}")
    if rewards.dim() != 1 or rewards.numel() % pool:
        raise ValueError(f"rewards must be (B * pool,) with pool={pool}; got shape {tuple(rewards.shape)}")
    if not 2 <= keep <= pool:
        raise ValueError(f"keep must be in [2, pool={pool}], got {keep}")
    r = rewards.view(-1, pool)  # (B, K)
    low, high = keep // 2, keep - keep // 2
    rows = []
    for values in r.tolist():  # ascending and stable, with unscored (NaN, inf) candidates after the lowest `low`
        unscored = [i for i, v in enumerate(values) if not math.isfinite(v)]
        scored = sorted((i for i, v in enumerate(values) if math.isfinite(v)), key=values.__getitem__)
        cut = min(low, len(scored))  # so they are extremes only when too few candidates were scored
        rows.append(scored[:cut] + unscored + scored[cut:])
    order = torch.tensor(rows, dtype=torch.long).view(-1, pool)  # (B, K)
    chosen = torch.cat([order[:, :low], order[:, pool - high :]], dim=1)  # (B, keep)
    return (chosen + torch.arange(r.shape[0])[:, None] * pool).reshape(-1)
