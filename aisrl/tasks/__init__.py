"""Tasks with verifiable rewards: a problem generator (or file) plus a reward function.

Completions must look like `<reasoning>...</reasoning><answer>...</answer>`. The reward has two parts, as in
d1 (Zhao et al. 2025) and the AIS paper's GRPO setup:

    format      0.5  if the completion is exactly one reasoning block followed by one answer block
    correctness 1.0  if the answer is right (checked by the task: integer equality, expression
                     evaluation, puzzle validity, or math-verify for free-form math)

so rewards lie in {0, 0.5, 1.0, 1.5}; `accuracy` counts correctness only. Procedural tasks are generated
from a seed and never download anything. Train and held-out problems never overlap: a problem's split is
decided by a hash of its text, or of what it is a case of (`Task.split_key`: Countdown's numbers in any order,
Sudoku4's solution grid), 1 in 8 held out, so the two splits are disjoint by construction.
"""

from __future__ import annotations

from aisrl.config import check_like_default
from aisrl.tasks.base import (
    _REQUIRED,
    CORRECT_POINTS,
    FORMAT_POINTS,
    FORMAT_RE,
    INSTRUCTION,
    Problem,
    Task,
    _split_of,
    extract_answer,
)
from aisrl.tasks.data import MAX_GYM_ANSWER, JsonlMath, ReasoningGym, read_rows
from aisrl.tasks.procedural import Arithmetic, Countdown, Sudoku4, column_trace

__all__ = [
    "CORRECT_POINTS", "FORMAT_POINTS", "FORMAT_RE", "INSTRUCTION", "MAX_GYM_ANSWER", "PROCEDURAL", "TASKS",
    "Arithmetic", "Countdown", "JsonlMath", "Problem", "ReasoningGym", "Sudoku4", "Task", "check_task",
    "column_trace", "extract_answer", "make_task", "read_rows", "_split_of",
]

TASKS = {
    "arithmetic": Arithmetic,
    "countdown": Countdown,
    "sudoku4": Sudoku4,
    "jsonl": JsonlMath,
    "dataset": JsonlMath,
    "reasoning_gym": ReasoningGym,
}

PROCEDURAL = (Arithmetic, Countdown, Sudoku4)
"""Tasks built from code alone, at no cost: `check_task` builds them to check their option values."""


def check_task(name: str, **kwargs) -> None:
    """Raise the ValueError `make_task(name, **kwargs)` would for an unknown name, options the task does not take,
    a required option left out, a value of another type than the option's default, or (procedural tasks) a value
    out of its range."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {sorted(TASKS)}")
    accepted = TASKS[name].accepts(**kwargs)  # name -> default (inspect's `empty` when required)
    unknown, missing = sorted(set(kwargs) - set(accepted)), [k for k, d in accepted.items() if d is _REQUIRED]
    if unknown or set(missing) - set(kwargs):
        raise ValueError(f"task {name!r} got options {sorted(kwargs)}; it accepts {list(accepted)}")
    for key, value in kwargs.items():
        check_like_default(f"task {name!r}", key, value, accepted[key])
    if TASKS[name] in PROCEDURAL:
        TASKS[name](**kwargs)  # cheap to build: its own checks of the values run before anything else does


def make_task(name: str, lenient: bool = False, **kwargs) -> Task:
    """The task `name` of TASKS built with its options (`lenient`: see Task)."""
    check_task(name, **kwargs)
    task = TASKS[name](**kwargs)
    task.lenient = lenient
    return task
