"""The task interface: a problem, the answer format, and the reward every task shares (format credit plus the task's
own check), with the train/held-out split by a hash of what a problem is a case of. aisrl.tasks has the overview."""

from __future__ import annotations

import hashlib
import inspect
import random
import re
from dataclasses import dataclass, field
from fractions import Fraction

FORMAT_RE = re.compile(r"^\s*<reasoning>(.*?)</reasoning>\s*<answer>(.*?)</answer>\s*$", re.S)
FORMAT_POINTS, CORRECT_POINTS = 0.5, 1.0
INSTRUCTION = "Answer in the format <reasoning>...</reasoning><answer>...</answer>."


@dataclass
class Problem:
    question: str
    """The prompt text (without the format instruction)."""
    answer: str
    """The reference answer."""
    solution: str = ""
    """A worked reasoning trace (for supervised warm starts); empty when unknown."""
    meta: dict = field(default_factory=dict)


def extract_answer(completion: str) -> str | None:
    """The text of the answer block if the completion has the required format, else None."""
    m = FORMAT_RE.match(completion)
    tags = ("<reasoning>", "</reasoning>", "<answer>", "</answer>")  # a stray one means text outside the blocks
    if not m or any(tag in m.group(1) + m.group(2) for tag in tags):
        return None  # exactly one reasoning block and one answer block
    return m.group(2).strip()


_REQUIRED = inspect.Parameter.empty


def _split_of(text: str) -> str:
    return "test" if int(hashlib.sha256(text.encode()).hexdigest(), 16) % 8 == 0 else "train"


class Task:
    """A task: `problems(split, n, seed)` and `check(answer, problem) -> bool`.

    `lenient = True` also credits a completion without the answer format whose last number is a correct
    answer (correctness points only): the one setting where a small instruct model has signal."""

    name = "task"
    lenient = False
    problems_version = 1
    """Raised when a task's problem sets change (its generator or its split), so that cached warm starts trained on
    the old ones are not reused, and cached final scores are redone."""
    scorer_version = 1
    """Raised when check() judges some answers otherwise, so that cached final scores are redone."""

    @classmethod
    def accepts(cls, **options) -> dict:
        """The options the task's constructor takes, each with its default (`_REQUIRED` when it has none)."""
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
        return {p.name: p.default for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}

    def generate(self, rng: random.Random) -> Problem:
        raise NotImplementedError

    def split_key(self, problem: Problem) -> str:
        """What decides a problem's split (and, unless distinct_key says otherwise, its distinctness): its text, unless
        several texts state one problem."""
        return problem.question

    def distinct_key(self, problem: Problem) -> str:
        """What makes two problems of one split different (split_key, unless a task splits coarser than that)."""
        return self.split_key(problem)

    def check(self, answer: str, problem: Problem) -> bool:
        raise NotImplementedError

    def problems(self, split: str, n: int, seed: int = 0) -> list[Problem]:
        """n distinct problems of `split` ('train' or 'test'), deterministic in seed."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        rng, out, seen = random.Random(seed), [], set()
        if n <= 0:
            return out
        last_new = 0
        for i in range(200 * n + 1000):
            if i - last_new > 100 * len(out) + 10_000:  # so long without a new problem: the task has no more (a
                break  # collector of k problems waits about 2k draws for the last; n = 1e5 took a minute to say so)
            p = self.generate(rng)
            key = self.distinct_key(p)
            if key in seen or _split_of(self.split_key(p)) != split:
                continue
            seen.add(key)
            out.append(p)
            last_new = i
            if len(out) == n:
                return out
        raise ValueError(f"task {self.name!r} could not produce {n} distinct {split} problems (it has about "
                         f"{len(out)} under these options): ask for fewer (training: train_problems, "
                         "eval_problems, lab.sft_examples for the lab's warm start; aisrl mismatch: prompts) or widen "
                         "the task (a larger max_operand; for sudoku4 a hole count nearer 8, ...)")  # fmt: skip

    def reward(self, completion: str, problem: Problem) -> tuple[float, bool]:
        """(format + correctness reward, correct?)."""
        answer = extract_answer(completion)
        if answer is None:
            numbers = [x.replace(",", "") for x in re.findall(_NUMBER, completion)] if self.lenient else []
            correct = bool(numbers) and self.check(numbers[-1], problem)
            return (CORRECT_POINTS if correct else 0.0), correct
        correct = self.check(answer, problem)
        return FORMAT_POINTS + (CORRECT_POINTS if correct else 0.0), correct


_NUMBER = r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
"""A number, its commas only as thousands separators (`1,000`; `7,1` is not the number 71), not begun inside
another (`.5` is no 5)."""
def _plain_number(s: str) -> Fraction | None:
    """The value of `s` if it is one plain number (thousands commas, `$...$` allowed), else None."""
    s = s.strip().strip("$").strip()
    return Fraction(s.replace(",", "")) if len(s) < 1000 and re.fullmatch(_NUMBER, s) else None


def _int_or_none(s: str) -> int | None:
    """The integer `s` writes (thousands commas allowed), or None: also past 1400 characters, which no
    task's answer has and which Python refuses to convert (a looping completion must not stop the run)."""
    s = s.strip()
    if not re.fullmatch(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)", s) or len(s) > 1400:
        return None
    return int(s.replace(",", ""))
