"""Can the trainer's gradient hold its low-precision copy close? Pull-only steps on the lab model (issue 5).

    OMP_NUM_THREADS=2 python benchmarks/copy_pull.py [preset=lab_columns] [quant=mxfp4_w4a4] [start=RUN:STEP]
        [variants=ste,to_copy,grid] [lrs=2e-4,1e-3] [steps=30] [every=5] [held=4] [tag=NAME]

Within a method and seed, the MXFP4 runs of `lab_columns` that end with more rollout/trainer mismatch end worse
(docs/ais.md section 5). Whether the mismatch is a cause needs a run that keeps the copy close to the trainer while
the full-precision weights stay what is optimised. This script asks the step before: does any gradient on the
full-precision weights reduce the mismatch of the real copy synced from them? From a state (the warm start, or a
checkpoint with `start`), it takes `steps` AdamW steps (the trainer's: no weight decay, gradients clipped at 1) of a
penalty alone, no policy gradient, resyncing the fake-quantised copy after each, for each variant:
- `ste`: (1/2) mean_t (log pi_t - log mu_q,t)^2 on the copy's own samples, mu_q the trainer run in the rollout format
  with straight-through gradients (aisrl.qarl.alignment), differentiated through both log-probs;
- `to_copy`: the same with mu_q held fixed: the trainer distilled towards its copy's outputs, the copy following
  only through the resync;
- `grid`: (1/2) mean |W - q(W)|^2 over the quantised layers' weights (q: the rollout format's weight rounding),
  which pulls each weight to the value its copy stores (activation rounding is untouched).
Every `every` steps it measures, on `held` fixed batches of the copy's samples (32 prompts x 8, the trainer's batch),
the k3 KL of the copy against the trainer, the samples' mean reward, and the trainer's mean negative log-likelihood
of the sampled tokens (a mismatch can also vanish because both policies became near-deterministic). Writes
benchmarks/results/copy_pull_<preset>_<quant>[_<hash>][_<tag>].json and its section of BENCHMARKS.md, the hash
naming settings other than the defaults (a start, a smoke run), so that they never replace the published figures.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from aisrl.bench.cli import command, number, numbers, options
from aisrl.bench.report import machine, settings_tag, update_section, write_json
from aisrl.build import build, make_policy, problem_sets, rollout_model, task_rewards
from aisrl.checkpoint import checkpoint_dir
from aisrl.diagnostics import k3_per_token
from aisrl.policy import CausalPolicy
from aisrl.qarl import AlignedLinear, align_, alignment, set_alignment
from aisrl.quant import WEIGHT_FORMATS, quant_config
from aisrl.train_config import TrainConfig, load_config

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("ste", "to_copy", "grid")
DEFAULTS = {"start": "", "variants": list(VARIANTS), "lrs": [2e-4, 1e-3], "steps": 30, "every": 5, "held": 4}
"""The published run's settings (BENCHMARKS.md: `copy_pull.py steps=30`, when 20 was the default)."""


@dataclass
class Probe:
    """A state of the lab model (its aligned layers switched off), its synced low-precision copy, and what is
    measured on them; `rewards` gives the task's reward of each completion of a batch, given its problems."""

    cfg: TrainConfig
    model: torch.nn.Module
    rollout: torch.nn.Module
    sync: Callable
    policy: CausalPolicy
    encode: Callable
    pool: list
    rewards: Callable

    def load(self, start: str) -> Probe:
        """The weights of checkpoint `start` (RUN:STEP), synced into the copy."""
        run, step = start.rsplit(":", 1)
        self.model.load_state_dict(load_file(checkpoint_dir(Path(run), int(step)) / "model.safetensors"))
        self.sync(self.model.state_dict())
        return self

    def batch(self, seed: int):
        """(rollout, problems): the copy's samples of a batch of the trainer's shape, fixed by `seed`."""
        B, G = self.cfg.prompts_per_step, self.cfg.group_size
        problems = [p for p in random.Random(seed).sample(self.pool, B) for _ in range(G)]
        seeds = [seed * 4096 + i for i in range(B * G)]
        return self.policy.sample(self.rollout, [self.encode(p) for p in problems], seeds, 0), problems

    def measure(self, held: int) -> dict:
        """On `held` fixed batches of the copy's samples: its k3 KL against the trainer, the trainer's mean negative
        log-likelihood of the sampled tokens, and the samples' mean reward."""
        k3, nll, reward = [], [], []
        for h in range(held):
            r, problems = self.batch(10_000 + h)
            with torch.no_grad():
                logp = self.policy.score(self.model, r, 0)[r.completion_mask]
            d = logp - r.rollout_logp[r.completion_mask]
            k3.append(k3_per_token(d.double()).mean().item())
            nll.append(-logp.mean().item())
            reward += self.rewards(r, problems)
        return {"k3": statistics.fmean(k3), "nll": statistics.fmean(nll), "reward": statistics.fmean(reward)}


def setup(preset: str, quant: str, start: str, overrides: tuple[str, ...] = ()) -> Probe:
    """The preset's warm start, or the weights of checkpoint `start` (RUN:STEP), with a copy in `quant`. The prompts
    are the preset's training pool whatever the run, so every state is measured on the same batches."""
    cfg = load_config(preset, [f"rollout.quant={quant}", *overrides])
    model, tok, task, encode = build(cfg)
    model.train()
    pool, held = problem_sets(cfg, task)
    rollout, sync = rollout_model(cfg, model, torch.device("cpu"), pool + held, encode)
    set_alignment(align_(model, quant_config(quant)), False)

    def rewards(r, problems) -> list[float]:
        return [s[0] for s in task_rewards(task, tok, r, problems)]

    probe = Probe(cfg, model, rollout, sync, make_policy(cfg, tok, model), encode, pool, rewards)
    return probe.load(start) if start else probe


def penalty(variant: str, model, policy, r) -> torch.Tensor:
    """The variant's loss on the copy's batch r (the module docstring)."""
    if variant == "grid":
        layers = [m for m in model.modules() if isinstance(m, AlignedLinear)]
        sq = [(m.weight - WEIGHT_FORMATS[m.qcfg.format](m.weight.detach().float(), m.qcfg)).pow(2) for m in layers]
        return 0.5 * sum(s.sum() for s in sq) / sum(s.numel() for s in sq)
    m = r.completion_mask
    logp = policy.score(model, r, 0)  # (N, T)
    with alignment(model, True):
        logp_q = policy.score(model, r, 0)  # (N, T) the copy's log-probs, straight-through to the weights
    if variant == "to_copy":
        logp_q = logp_q.detach()
    return 0.5 * (logp - logp_q)[m].pow(2).mean()


def pull(preset: str, quant: str, start: str, variant: str, lr: float, steps: int, every: int, held: int) -> dict:
    probe = setup(preset, quant, start)
    model = probe.model
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    curve, losses = [{"step": 0, **probe.measure(held)}], []
    for step in range(1, steps + 1):
        loss = penalty(variant, model, probe.policy, probe.batch(step)[0])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), probe.cfg.grad_clip)
        opt.step()
        probe.sync(model.state_dict())
        losses.append(loss.item())
        if step % every == 0 or step == steps:
            since = step - curve[-1]["step"]  # the steps since the last point: a short last window is not padded
            curve.append({"step": step, **probe.measure(held), "penalty": statistics.fmean(losses[-since:])})
        print(f"{variant} lr {lr:g} step {step}: penalty {loss.item():.4g}" + (
            f", held k3 {curve[-1]['k3']:.4g}, reward {curve[-1]['reward']:.3f}, nll {curve[-1]['nll']:.3f}"
            if curve[-1]["step"] == step else ""), flush=True)  # fmt: skip
    return {"variant": variant, "lr": lr, "curve": curve}


def section(out: dict) -> str:
    lines = [f"### Copy pull: pull-only steps, {out['preset']} {out['quant']} from {out['start']}\n",
             f"`{out['command']}` ({out['seconds'] / 60:.0f} min; {out['machine'].get('cpu', '?')}, "
             f"{out['machine'].get('cpus', '?')} cores). k3 KL of the synced copy against the trainer on "
             f"{out['held']} fixed batches of its samples, every {out['every']} steps.\n",
             "| variant | lr | held k3 at steps " + ", ".join(str(c["step"]) for c in out["runs"][0]["curve"])
             + " | copy's reward, first and last | trainer's NLL of the samples, first and last |",
             "|---|---|---|---|---|"]  # fmt: skip
    for run in out["runs"]:
        c = run["curve"]
        k3s = ", ".join(f"{x['k3']:.4f}" for x in c)
        lines.append(f"| {run['variant']} | {run['lr']:g} | {k3s} | {c[0]['reward']:.3f}, {c[-1]['reward']:.3f} | "
                     f"{c[0]['nll']:.3f}, {c[-1]['nll']:.3f} |")  # fmt: skip
    return "\n".join(lines)


def main(preset: str, quant: str, start: str, variants: list[str], lrs: list[float], steps: int, every: int,
         held: int, tag: str = "") -> dict:  # fmt: skip
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise ValueError(f"unknown variant(s) {bad}; choose from {list(VARIANTS)}")
    if steps < 1 or every < 1 or held < 1:
        raise ValueError(f"steps, every and held must be >= 1, got {steps}, {every}, {held}")
    t0 = time.perf_counter()
    runs = [pull(preset, quant, start, v, lr, steps, every, held) for v in variants for lr in lrs]
    out = {"preset": preset, "quant": quant, "start": start or "warm start", "steps": steps, "every": every,
           "held": held, "runs": runs, "seconds": time.perf_counter() - t0, "machine": machine(),
           "command": command(__file__)}  # fmt: skip
    settings = {"start": start, "variants": list(variants), "lrs": list(lrs), "steps": steps, "every": every,
                "held": held}  # fmt: skip
    digest = settings_tag({k: v for k, v in settings.items() if v != DEFAULTS[k]}, [{}])
    name = f"copy_pull_{preset}_{quant}" + (f"_{digest}" if digest else "") + (f"_{tag}" if tag else "")
    write_json(ROOT / "benchmarks" / "results" / f"{name}.json", out)
    update_section(ROOT / "BENCHMARKS.md", name, section(out))
    return out


if __name__ == "__main__":
    _, kw = options(sys.argv[1:], ("preset", "quant", "start", "variants", "lrs", "steps", "every", "held", "tag"))
    d = DEFAULTS
    main(kw.get("preset", "lab_columns"), kw.get("quant", "mxfp4_w4a4"), kw.get("start", d["start"]),
         kw.get("variants", ",".join(d["variants"])).split(","),
         numbers(kw, "lrs", d["lrs"], float, low=0), number(kw, "steps", d["steps"], low=1),
         number(kw, "every", d["every"], low=1), number(kw, "held", d["held"], low=1), kw.get("tag", ""))  # fmt: skip
