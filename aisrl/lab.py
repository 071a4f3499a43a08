"""The lab: a tiny policy that already succeeds sometimes, so RL has signal within minutes on a CPU.

SmolLM2-135M is too weak and too slow here for multi-seed studies. The lab model is a Llama-style transformer
of about 1.35M parameters with a character tokenizer built locally (the four format tags are single
tokens). It is warm-started by supervised fine-tuning on solver traces of a procedural task
(`<reasoning>23+48=71</reasoning><answer>71</answer>`) for a fixed number of steps, chosen per preset so its
held-out success rate leaves GRPO room to lift it. The result is cached on disk under a hash of the
configuration, so a second run starts instantly.

Why a fixed step count rather than "stop once held-out accuracy enters a band": the SFT is deterministic on one
machine, but another CPU rounds differently, and where a noisy 80-problem check first enters a band moved the
default lab's stop from step 750 on one machine to step 450 on another, a weaker model that GRPO then did not
improve. A fixed count puts every machine at the same stage of training. The band stop stays available
(`LabConfig.target`) for exploring.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from aisrl.tasks import Problem, make_task

SPECIAL = ["<pad>", "<bos>", "<eos>", "<reasoning>", "</reasoning>", "<answer>", "</answer>"]
CHARS = list("0123456789+-*/=()., :?") + [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("UMDS\n")


class CharTokenizer:
    """Characters plus the format tags as single tokens; ids 0, 1, 2 are pad, bos, eos."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def __init__(self):
        self.vocab = SPECIAL + CHARS
        self.index = {t: i for i, t in enumerate(self.vocab)}

    def __len__(self):
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            tag = next((t for t in SPECIAL[3:] if text.startswith(t, i)), None)
            tok = tag or text[i]
            if tok not in self.index:
                raise ValueError(f"character {tok!r} is not in the lab tokenizer's vocabulary")
            ids.append(self.index[tok])
            i += len(tok)
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of the ids; pad/bos/eos are always dropped (the tags are text, not special tokens)."""
        return "".join(self.vocab[i] for i in ids if i > 2)


def prompt_text(p: Problem) -> str:
    return f"{p.question}:"


def completion_text(p: Problem) -> str:
    return f"<reasoning>{p.solution}</reasoning><answer>{p.answer}</answer>"


@dataclass
class LabConfig:
    task: str = "arithmetic"
    """Procedural task of the warm start (arithmetic, countdown, sudoku4)."""
    max_operand: int = 20
    """Arithmetic operands are drawn from 0..max_operand (the lab's difficulty)."""
    ops: str = "+-"
    """Arithmetic operators."""
    trace: str = "flat"
    """Arithmetic solution trace: 'flat' (`23+48=71`) or 'columns' (digit by digit with carries; ops='+')."""
    sudoku_holes: int = 6
    """Empty cells of a 4x4 Sudoku (task=sudoku4)."""
    hidden: int = 192
    """Model width."""
    layers: int = 4
    """Transformer layers."""
    sft_examples: int = 600
    """Solver traces used for the warm start."""
    sft_steps: int = 750
    """SFT steps (batch 64). A fixed count, so the warm start reaches the same stage of training on any CPU."""
    target: tuple[float, float] | None = None
    """Optional early stop: end the SFT at the first held-out check (every 50 steps) whose greedy accuracy is
    inside this band, after at most `sft_steps`. Off by default: where the check first lands in a band depends
    on the CPU's float rounding, so the warm start would differ between machines."""
    lr: float = 3e-3
    """SFT learning rate (AdamW, cosine-free, constant)."""
    seed: int = 0
    """Seed of data, init and training."""


HELD_OUT = 80
"""Held-out problems the warm start's accuracy is measured on (seed lab.seed + 1)."""


def check_lab(cfg: LabConfig) -> None:
    """Raise ValueError, naming the lab.* key, for a lab the warm start could not build."""
    from aisrl.tasks import TASKS

    own = sorted(n for n in TASKS if n not in ("dataset", "jsonl", "reasoning_gym"))  # procedural, no options
    if cfg.task not in own:
        raise ValueError(f"lab.task={cfg.task!r}: the lab trains on a procedural task; choose from {own} (a file or "
                         "reasoning-gym task needs model.name other than lab, with task= and dataset=)")  # fmt: skip
    for key, low in (("max_operand", 1), ("hidden", 1), ("layers", 1), ("sft_examples", 1), ("sft_steps", 0)):
        if getattr(cfg, key) < low:
            raise ValueError(f"lab.{key} must be >= {low}, got {getattr(cfg, key)}")
    if not cfg.lr > 0:
        raise ValueError(f"lab.lr is the warm start's SFT learning rate, > 0; got {cfg.lr}")
    if cfg.hidden % 8:  # 4 attention heads, each with an even number of rotary dimensions
        raise ValueError(f"lab.hidden must be a multiple of 8 (4 attention heads of even width), got {cfg.hidden}")
    if not 0 <= cfg.sudoku_holes <= 16:
        raise ValueError(f"lab.sudoku_holes is the number of blanks of a 4x4 grid, in [0, 16]; got {cfg.sudoku_holes}")
    if cfg.target is not None and not 0 <= cfg.target[0] < cfg.target[1] <= 1:
        raise ValueError(f"lab.target is an accuracy band [low, high], 0 <= low < high <= 1; got {list(cfg.target)}")
    try:
        task = lab_task(cfg)
    except ValueError as e:
        raise ValueError(f"lab.task={cfg.task!r} refuses these lab.* options: {e}") from e
    wanted = (("train", cfg.sft_examples, cfg.seed, f"lab.sft_examples={cfg.sft_examples}"),
              ("test", HELD_OUT, cfg.seed + 1, f"the warm start's {HELD_OUT} held-out"))  # fmt: skip
    for split, n, seed, what in wanted:
        try:
            task.problems(split, n, seed=seed)
        except ValueError:
            fewer = "ask for fewer (lab.sft_examples) or " if split == "train" else ""
            raise ValueError(f"lab.task={cfg.task!r} has too few distinct {split} problems under these lab.* "
                             f"options for {what} problems: {fewer}widen the task (a larger lab.max_operand, more "
                             "lab.ops, more lab.sudoku_holes)") from None  # fmt: skip


TASK_OPTIONS = {"arithmetic": {"max_operand": "max_operand", "ops": "ops", "trace": "trace"},
                "sudoku4": {"sudoku_holes": "holes"}}
"""lab.task -> {the lab.* key it reads: the task's option}; the other lab tasks read none of these keys."""


def lab_task(cfg: LabConfig, lenient: bool = False):
    """The lab's task (`lab.task` with its lab.* options); `lenient`: the run's lenient_reward (aisrl.tasks.Task)."""
    options = {option: getattr(cfg, key) for key, option in TASK_OPTIONS.get(cfg.task, {}).items()}
    return make_task(cfg.task, lenient, **options)


def _cache_dir(cfg, kind: str = "lab") -> Path:
    from aisrl.tasks import TASKS

    fields = asdict(cfg)
    lab = fields.get("lab", fields)
    task = TASKS.get(lab.get("task"))
    version = getattr(task, "problems_version", 1)
    if version != 1:  # the task's problems changed since its first warm starts: a new one (earlier keys stay valid)
        fields["problems_version"] = version
    scorer = getattr(task, "scorer_version", 1)
    if lab.get("target") is not None and scorer != 1:  # the scorer decides where a band-stopped warm start stops
        fields["scorer_version"] = scorer
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
    entry = Path(os.environ.get("AISRL_CACHE", Path.home() / ".cache" / "aisrl")) / kind / key
    if entry.exists() and not entry.is_dir():  # said before the warm start is built
        raise FileExistsError(f"{entry} is in the way of the warm start's cache entry (a file, where a folder goes): "
                              "delete it")  # fmt: skip
    return entry


def greedy_accuracy(model, tok: CharTokenizer, problems: list[Problem], task, max_new_tokens: int = 40) -> float:
    from aisrl.policy import CausalPolicy
    from aisrl.rollout import SamplingParams
    from aisrl.trainer import evaluate

    encode = lambda p: [tok.bos_token_id] + tok.encode(prompt_text(p))  # noqa: E731
    policy = CausalPolicy(SamplingParams(max_new_tokens), tok.pad_token_id, tok.eos_token_id, tokenizer=tok)
    return evaluate(model, tok, task, encode, problems, policy)


def lab_model(cfg: LabConfig | None = None, verbose: bool = True, warm: bool = True):
    """(model, tokenizer, info): the warm-started lab policy, trained once and cached. `warm=False`, for weights
    about to be replaced by a checkpoint's: the cached warm start if there is one, else the untrained model (info {}),
    not a warm start trained only to be overwritten."""
    from aisrl.models import save_model, tiny_model

    cfg = cfg or LabConfig()
    tok = CharTokenizer()
    cache = _cache_dir(cfg)
    if (cache / "info.json").exists():
        from transformers import AutoModelForCausalLM

        model = load_cached(cache, lambda: AutoModelForCausalLM.from_pretrained(cache, local_files_only=True,
                                                                                dtype=torch.float32))  # fmt: skip
        return model.eval(), tok, load_cached(cache, lambda: json.loads((cache / "info.json").read_text()))
    model = tiny_model("tiny-llama", seed=cfg.seed, vocab_size=len(tok), hidden=cfg.hidden, layers=cfg.layers,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    if not warm:
        return model.eval(), tok, {}
    task = lab_task(cfg)
    train = task.problems("train", cfg.sft_examples, seed=cfg.seed)
    held = task.problems("test", HELD_OUT, seed=cfg.seed + 1)
    seqs = [([tok.bos_token_id] + tok.encode(prompt_text(p)), tok.encode(completion_text(p)) + [tok.eos_token_id])
            for p in train]  # fmt: skip
    train_steps = sft_trainer(cfg, model, seqs, lambda batch, gen: _sft_loss(model, batch, tok.pad_token_id))

    # room for the longest worked answer (long column traces exceed the default 40), so a right one is not cut short
    room = max(40, *(len(tok.encode(completion_text(p))) + 1 for p in train + held))

    def accuracy() -> float:
        model.eval()
        return greedy_accuracy(model, tok, held, task, room)

    step, acc = run_sft(cfg, train_steps, accuracy, "lab SFT" if verbose else None)
    info = {"sft_steps": step, "heldout_greedy_accuracy": acc, "params": sum(p.numel() for p in model.parameters()),
            "config": asdict(cfg)}  # fmt: skip
    publish_cache(cache, lambda tmp: (save_model(model, tmp), (tmp / "info.json").write_text(json.dumps(info))))
    return model, tok, info


def sft_trainer(cfg: LabConfig, model, seqs: list, batch_loss):
    """`train_steps(n)` for `run_sft`: n AdamW steps (learning rate `cfg.lr`, no weight decay), each on 64 of `seqs`
    drawn by a generator seeded with `cfg.seed`; `batch_loss(batch, gen)` may draw from the same generator.
    Returns the last step's loss."""
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)

    def train_steps(n: int) -> torch.Tensor:
        model.train()
        for _ in range(n):
            idx = torch.randint(len(seqs), (64,), generator=gen).tolist()
            loss = batch_loss([seqs[i] for i in idx], gen)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return loss.detach()

    return train_steps


def run_sft(cfg: LabConfig, train_steps, accuracy, label: str | None, chunk: int = 50) -> tuple[int, float]:
    """(steps, held-out accuracy) of a warm start: `train_steps(n)` runs n optimiser steps and returns the last
    loss, `accuracy()` scores the held-out problems. Trains `cfg.sft_steps` steps in chunks of `chunk`, printing
    the loss after each chunk when `label` is given; with `cfg.target` set, the held-out accuracy is checked
    before training and after every chunk, and training stops at the first check inside the band."""
    inside = lambda a: cfg.target is not None and cfg.target[0] <= a <= cfg.target[1]  # noqa: E731
    step, acc = 0, accuracy() if cfg.target is not None else None
    while step < cfg.sft_steps and not inside(acc):
        n = min(chunk, cfg.sft_steps - step)
        loss = train_steps(n)
        step += n
        acc = accuracy() if cfg.target is not None else None
        if label:
            print(f"{label} step {step}: loss {loss.item():.3f}"
                  + (f", held-out greedy accuracy {acc:.2f}" if acc is not None else ""), flush=True)  # fmt: skip
    acc = accuracy() if acc is None else acc
    if label:
        print(f"{label}: {step} steps, held-out greedy accuracy {acc:.2f}", flush=True)
    return step, acc


def publish_cache(cache: Path, write) -> None:
    """Write a cache entry into a private temporary directory (unique per call: builders in containers or on machines
    that share the cache may share a process id), put its files on disk, then rename it into place, so that an entry
    holding info.json is complete. First writer wins; what a failed write left is removed. A folder without info.json
    in the way (a partial entry of an earlier version) is moved aside and removed; temporary folders of builders killed
    a day or more ago are removed. Anything else in the way is an error naming it (nothing would ever be cached)."""
    import shutil
    import tempfile
    import time

    from aisrl.checkpoint import _fsync

    cache.parent.mkdir(parents=True, exist_ok=True)
    for old in cache.parent.glob(f".{cache.name}.*"):  # a killed builder's copy of the model, or a stale entry
        try:
            if time.time() - old.stat().st_mtime > 86400:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:  # removed meanwhile by another builder
            pass
    tmp = Path(tempfile.mkdtemp(dir=cache.parent, prefix=f".{cache.name}.tmp"))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's is 0700: others sharing the cache read the entry too
        write(tmp)
        for f in [*tmp.rglob("*"), tmp]:
            _fsync(f)
        if cache.is_dir() and not (cache / "info.json").exists():
            _move_aside(cache)
        try:
            tmp.rename(cache)
        except OSError as e:
            if (cache / "info.json").exists():  # another process published it first
                return
            warnings.warn(f"the warm start could not be cached at {cache} ({e}): something else is in the way; "
                          "delete it, or every run builds the warm start again", stacklevel=2)  # fmt: skip
            return
        _fsync(cache.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after a rename; a leftover otherwise


def _move_aside(cache: Path) -> None:
    """Remove a partial entry at `cache` by first renaming it (atomic) to a private name: a builder that published a
    complete entry there meanwhile gets it back, instead of losing it to a delete that checked too early."""
    import contextlib
    import shutil
    import tempfile

    aside = Path(tempfile.mkdtemp(dir=cache.parent, prefix=f".{cache.name}.stale")) / "entry"
    try:
        cache.rename(aside)
    except OSError:  # gone already, or not ours to move: the rename into place says what is wrong
        shutil.rmtree(aside.parent, ignore_errors=True)
        return
    if (aside / "info.json").exists():  # complete after all: published between the check and the move
        with contextlib.suppress(OSError):  # a third builder published meanwhile: one complete entry is enough
            aside.rename(cache)
    shutil.rmtree(aside.parent, ignore_errors=True)


def load_cached(cache: Path, load):
    """`load()` of a cache entry, and an error naming the entry and what to do when it fails (a file damaged or
    emptied outside aisrl, or by a power loss before entries were synced)."""
    try:
        return load()
    except Exception as e:  # noqa: BLE001 - whatever the loader raised, the fix is the same
        raise RuntimeError(f"the cached warm start {cache} could not be loaded ({type(e).__name__}: {e}); delete "
                           "that folder to have it built again") from e


def _sft_loss(model, batch: list[tuple[list[int], list[int]]], pad: int) -> torch.Tensor:
    """Next-token cross-entropy on completion tokens only (prompt tokens are context)."""
    width = max(len(p) + len(c) for p, c in batch)
    ids = torch.full((len(batch), width), pad)
    labels = torch.full((len(batch), width), -100)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, (p, c) in enumerate(batch):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        labels[i, len(p) : len(p) + len(c)] = torch.tensor(c)
        mask[i, : len(p) + len(c)] = 1  # right padding: causal attention never sees it
    logits = model(input_ids=ids, attention_mask=mask).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
