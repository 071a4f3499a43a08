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

import ast
import dataclasses
import functools
import hashlib
import inspect
import json
import operator
import random
import re
import threading
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

from aisrl.config import check_like_default

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
_WORDED_NUMBER = re.compile(rf"(?:[A-Za-z ,.:;'%$£€¥*()]*[ ,.:;'%$£€¥*(])?({_NUMBER})"
                            rf"(?:[ ,.:;'%$£€¥*)][A-Za-z ,.:;'%$£€¥*()]*)?")  # fmt: skip
"""One number among plain words and punctuation: `18 dollars`, `It is 18.`, `$1,000`, `€18`, `**18**`, `18 (apples)`."""
_VALUE_WORDS = re.compile(r"\b(?:not|no|never|minus|negative|plus|hundreds?|thousands?|millions?|billions?|trillions?|"
                          r"k|half|halves|thirds?|quarters?|double|twice|triple|thrice|squared|cubed|square|cube|root|"
                          r"times|percent|dozens?|less|more|fewer|over|under|above|below|than|about|around|almost|"
                          r"nearly|roughly|approximately|divided|multiplied|except)\b", re.IGNORECASE)  # fmt: skip
"""Words that change a number's value or deny it (`5 thousand`, `not 18`, `half of 10`): a worded answer holding one is
not read as its bare number (math-verify reads it, as any other answer)."""
_DENIAL = re.compile(r"\b(?:not|never|isn|aren|wasn|weren|doesn|didn|wrong|incorrect|false|neither|nor)\b"
                     r"|\bat (?:least|most) [-$£€¥]?\d", re.IGNORECASE)  # fmt: skip
"""Words that deny the number a worded answer holds, or make it a bound (`it isn't 18`, `18 is wrong`, `at least 18`):
math-verify would still find the number in them, so such an answer is wrong."""
_RELATION = re.compile(r"=|<|>|≈|≠|≤|≥|\\(?:approx|neq|ne|leq?|geq?|sim|equiv)(?![A-Za-z])")
"""Relation signs, plain or LaTeX: in `19 = 18` math-verify would take one side."""


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


class Arithmetic(Task):
    """a op b with op in + - *, operands 0..max_operand.

    trace='flat' writes the worked solution as one equation (`23+48=71`); trace='columns' (addition only)
    works the digits right to left with the carry, `3+8=11,2+4+1=7`, a procedure a tiny model can learn
    to apply to unseen operands rather than memorise.

    A problem is its text: `8+7` and `7+8` are two problems, which may fall in different splits. Held-out
    accuracy therefore credits a model that answers a training problem's twin by commutativity. The split stays
    as it is, because every recorded problem set depends on it."""

    name = "arithmetic"

    def __init__(self, max_operand: int = 99, ops: str = "+-", trace: str = "flat"):
        if trace not in ("flat", "columns"):
            raise ValueError(f"unknown arithmetic trace {trace!r}; choose from ['columns', 'flat']")
        if trace == "columns" and ops != "+":
            raise ValueError(f"trace='columns' works addition only; use ops='+' (got ops={ops!r})")
        if not ops or set(ops) - set("+-*"):
            raise ValueError(f"arithmetic ops must be a non-empty string of + - *, got {ops!r}")
        if max_operand < 0:
            raise ValueError(f"arithmetic max_operand is the largest operand, >= 0; got {max_operand}")
        self.max_operand, self.ops, self.trace = max_operand, ops, trace

    def generate(self, rng):
        a, b, op = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand), rng.choice(self.ops)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        steps = column_trace(a, b) if self.trace == "columns" else f"{a}{op}{b}={value}"
        return Problem(f"{a}{op}{b}", str(value), steps, {"a": a, "b": b, "op": op})

    def check(self, answer, problem):
        return _int_or_none(answer) == int(problem.answer)


def column_trace(a: int, b: int) -> str:
    """Schoolbook addition, least significant digit first: each column as `x+y+carry=sum`."""
    out, carry = [], 0
    for i in range(max(len(str(a)), len(str(b)))):
        x, y = a // 10**i % 10, b // 10**i % 10
        s = x + y + carry
        out.append(f"{x}+{y}={s}" if i == 0 else f"{x}+{y}+{carry}={s}")
        carry = s // 10
    return ",".join(out)


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _safe_eval(expr: str) -> tuple[Fraction, list[int]] | None:
    """Evaluate an arithmetic expression of integers with + - * /, signs and parentheses; (value, numbers used).
    Exactly, in fractions: a float's rounding would let 3*5+7+1/9000/9000/9000 reach 22.

    Model output is untrusted: long expressions and huge literals are refused before parsing, and any
    arithmetic failure (division by zero, overflow, recursion depth) counts as a wrong answer."""
    expr = expr.strip()
    if len(expr) > 200 or re.search(r"\d{10,}", expr):
        return None
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, RecursionError, MemoryError):
        return None
    used: list[int] = []

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):  # -5+3: no number more
            return -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
        raise ValueError("not allowed")

    try:
        return ev(tree), used
    except (ValueError, ZeroDivisionError, OverflowError, RecursionError):
        return None


class Countdown(Task):
    """Reach the target with each given number used at most once, using + - * / (after d1's Countdown, which asks
    for every number exactly once: here a shorter expression that reaches the target also counts)."""

    name = "countdown"

    def __init__(self, n_numbers: int = 3, max_number: int = 20):
        if n_numbers < 2 or not 1 <= max_number <= 10_000:
            raise ValueError(f"countdown needs n_numbers >= 2 (the puzzle combines two or three of them) and "
                             f"max_number in [1, 10000] (its products stay numbers a model can write); got "
                             f"n_numbers={n_numbers}, max_number={max_number}")  # fmt: skip
        self.n, self.max_number = n_numbers, max_number

    def generate(self, rng):
        nums = [rng.randint(1, self.max_number) for _ in range(self.n)]
        a, b, c = nums[0], nums[1], nums[2] if self.n > 2 else 0
        op1, op2 = rng.choice("+-*"), rng.choice("+-")
        expr = f"({a}{op1}{b}){op2}{c}" if self.n > 2 else f"{a}{op1}{b}"
        target = int(_safe_eval(expr)[0])
        q = f"Use {' '.join(map(str, nums))} to make {target}"
        return Problem(q, expr, f"{expr}={target}", {"numbers": nums, "target": target})

    def split_key(self, problem):  # "Use 3 5 7 to make 22" and "Use 5 3 7 to make 22" are one puzzle
        return f"{sorted(problem.meta['numbers'])} -> {problem.meta['target']}"

    scorer_version = 2  # 2: `expr = target` and the signs x and / written as × and ÷ count

    def check(self, answer, problem):
        text = answer.replace("×", "*").replace("÷", "/")
        sides = [x.strip() for x in text.split("=")]
        if len(sides) == 2:  # `3*5+7 = 22` (or `22 = 3*5+7`): the expression, if the other side is the target
            target = str(problem.meta["target"])
            text = sides[0] if sides[1] == target else sides[1] if sides[0] == target else ""
        elif len(sides) > 2:
            return False
        res = _safe_eval(text)
        if res is None:
            return False
        value, used = res
        pool = list(problem.meta["numbers"])
        for u in used:
            if u not in pool:
                return False
            pool.remove(u)
        return value == problem.meta["target"]


class Sudoku4(Task):
    """4x4 Sudoku: fill the 0s of a 16-digit grid; the answer is the 16 digits row by row.

    A puzzle is one of the 288 valid grids, drawn uniformly, with `holes` cells blanked. The splits are made by
    grid, not by puzzle: the grid a held-out puzzle was cut from is never a training answer. Any valid grid that
    keeps the givens is a right answer, though, and with many holes a puzzle has several: at 10 holes 35 of the
    lab's 80 held-out puzzles (seed 1) can also be completed with a training grid, so held-out accuracy still
    rewards some recall. (Before, puzzles came from 96 grids and were split by puzzle text: every held-out
    puzzle's own grid was a training answer too.)"""

    name = "sudoku4"
    problems_version = 2  # 2: all 288 grids, split by grid

    def __init__(self, holes: int = 6):
        if not 0 <= holes <= 16:
            raise ValueError(f"sudoku4 holes is the number of blanks of a 4x4 grid, in [0, 16]; got {holes}")
        self.holes = holes

    def generate(self, rng):
        sol = rng.choice(_sudoku4_grids())
        puzzle = list(sol)
        for i in rng.sample(range(16), self.holes):
            puzzle[i] = "0"
        return Problem("".join(puzzle), sol, sol, {})

    def split_key(self, problem):  # the solution grid: no test grid is ever seen in training
        return problem.answer

    def distinct_key(self, problem):  # many puzzles share a grid
        return problem.question

    @staticmethod
    def valid(grid: str) -> bool:
        if not re.fullmatch(r"[1-4]{16}", grid):
            return False
        g = [grid[i * 4 : i * 4 + 4] for i in range(4)]
        groups = g + ["".join(r[c] for r in g) for c in range(4)]
        groups += [g[r][c] + g[r][c + 1] + g[r + 1][c] + g[r + 1][c + 1] for r in (0, 2) for c in (0, 2)]
        return all(sorted(x) == list("1234") for x in groups)

    def check(self, answer, problem):
        a = re.sub(r"\s", "", answer)
        return self.valid(a) and all(p in ("0", x) for p, x in zip(problem.question, a, strict=False))


@functools.cache
def _sudoku4_grids() -> tuple[str, ...]:
    """Every valid 4x4 Sudoku grid (there are 288), as 16-digit strings in lexicographic order."""
    unit = lambda i, j: i // 4 == j // 4 or i % 4 == j % 4 or (i // 8, i % 4 // 2) == (j // 8, j % 4 // 2)  # noqa: E731
    grids: list[str] = []

    def fill(cells: str) -> None:  # row by row, a digit where no earlier cell of its row, column or box has it
        if len(cells) == 16:
            grids.append(cells)
            return
        for d in "1234":
            if all(cells[j] != d or not unit(len(cells), j) for j in range(len(cells))):
                fill(cells + d)

    fill("")
    return tuple(grids)


def read_rows(path: str) -> list[dict]:
    """Rows of a local dataset: JSONL (.jsonl/.json lines), Parquet (.parquet, needs pyarrow) or a directory
    written by `datasets.Dataset.save_to_disk` (needs datasets). Nothing is downloaded."""
    p = Path(path)
    if p.is_dir():
        try:
            from datasets import load_from_disk
        except ImportError as e:
            raise ImportError(
                f"{path} is a directory: reading a saved Hugging Face dataset needs `pip install datasets`"
            ) from e
        ds = load_from_disk(str(p))
        if hasattr(ds, "keys"):  # a DatasetDict: one split per key
            raise ValueError(f"{path} holds several splits {sorted(ds.keys())}; point at one split's directory")
        return [dict(r) for r in ds]
    if not p.is_file():
        raise FileNotFoundError(
            f"dataset {path!r} not found (expected a .jsonl or .parquet file, or a saved dataset dir)"
        )
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from e
        return pq.read_table(p).to_pylist()
    try:
        text = p.read_text(encoding="utf-8-sig")  # a byte-order mark, as some editors write, is not part of line 1
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}): give a .jsonl file of UTF-8 "
                         f"JSON objects (decompress a .gz first), a .parquet file or a saved dataset dir") from e
    rows = []
    for i, line in enumerate(text.split("\n")):  # not splitlines: U+2028 and \x85 may sit raw inside a string
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i + 1}: not a JSON object per line ({e.msg})") from e
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{i + 1}: each line must be a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


class JsonlMath(Task):
    """GSM8K / MATH-style problems from a local dataset (JSONL, Parquet or a saved `datasets` directory)
    with a `question` (or `problem`) and an `answer` field; GSM8K answers keep the final number after ####.

    Answers are compared with math-verify when installed (`pip install math-verify`, or `aisrl[math]`: symbolic
    equivalence, so `\\frac{1}{2}` matches `0.5` and `x^2+1` matches `1+x^2`), else as integers or exact text.
    Where the reference is a plain number, an answer that is one number among plain words (`18 dollars`, `It is
    1,000.`, `**18**`, `€18`) is read as that number: as LaTeX, math-verify would take the words for a product of
    variables; one whose words change or deny the number (`not 18`, `at least 18`, `5 thousand`) is wrong, as is a
    relation between numbers (`19 = 18`), which states two answers. A word reference (`yes`, `Monday`) matches the
    answer's word whatever its case, emphasis or final full stop.
    """

    name = "jsonl"

    def __init__(self, path: str):
        self.rows, seen = [], {}
        for i, row in enumerate(read_rows(path)):
            question = row.get("question", row.get("problem"))
            if question is None or "answer" not in row:
                raise ValueError(f"{path}: row {i + 1} needs a 'question' (or 'problem') and an 'answer' field")
            answer = row["answer"]
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                raise ValueError(f"{path}: row {i + 1}'s answer is {answer!r}; it must be a string or a number")
            ans = str(answer).split("####")[-1].strip()
            if not ans or not str(question).strip():
                raise ValueError(f"{path}: row {i + 1} has an empty question or answer (after any '####'), which "
                                 f"any output would match or none could; fix or drop the row")  # fmt: skip
            problem = Problem(str(question), ans, str(answer), {})
            if problem.question in seen:  # one problem once: `problems` promises distinct problems
                first, first_ans = seen[problem.question]
                if first_ans != ans:
                    raise ValueError(f"{path}: rows {first} and {i + 1} ask the same question with different answers "
                                     f"({first_ans!r}, {ans!r}); keep one")  # fmt: skip
                continue
            seen[problem.question] = (i + 1, ans)
            self.rows.append(problem)
        if not self.rows:
            raise ValueError(f"{path} holds no problems; give a dataset with 'question' and 'answer' rows")

    def problems(self, split, n, seed=0):
        """Up to n distinct problems of `split`: a file holds what it holds (the trainer says when it is fewer)."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        pool = [p for p in self.rows if _split_of(p.question) == split]
        random.Random(seed).shuffle(pool)
        return pool[:n]

    scorer_version = 2  # 2: `**18**`, `€18`, `18 (apples)`, `\\[18\\]`, `Yes.` count; `isn't 18`, `19 = 18` do not

    def check(self, answer, problem):
        if answer.strip() == problem.answer.strip():
            return True
        gold_number = _plain_number(problem.answer)
        sides = _RELATION.split(answer) if gold_number is not None else []  # a relation: a side may say another
        if len(sides) > 1 and any(n is not None and n != gold_number for n in map(_plain_number, sides)):  # value
            return False  # `19 = 18`, `x = 5 = 4` (`2^3 = 8`, `f(2) = 7` go on to math-verify)
        worded = _WORDED_NUMBER.fullmatch(answer.strip())
        if worded and gold_number is not None:
            if _DENIAL.search(answer):
                return False
            if not _VALUE_WORDS.search(answer):
                answer = worded.group(1).replace(",", "")
        if re.fullmatch(r"[A-Za-z][A-Za-z ]*", problem.answer.strip()):  # a word answer: as LaTeX, `no` is n*o = `on`
            bare = answer.strip().strip("*_\"'").rstrip(".!").strip("*_\"' ")  # `**Yes**.`, `"Monday".`
            return bare.casefold() == problem.answer.strip().casefold()
        try:
            from math_verify import parse, verify
        except ImportError:
            a, b = _int_or_none(answer), _int_or_none(problem.answer)
            return a is not None and a == b
        # Both sides are read as LaTeX math: bare, math-verify would take `1+x^2` for its first number. Its
        # timeouts use signal.alarm, which only the main thread may set; elsewhere a check runs without one.
        limit = 5 if threading.current_thread() is threading.main_thread() else None
        gold, got = (parse(f"${_unwrapped(s)}$", parsing_timeout=limit) for s in (problem.answer, answer))
        return bool(gold and got and verify(gold, got, timeout_seconds=limit))


def _unwrapped(math: str) -> str:
    """LaTeX without its math delimiters (`$...$`, `\\[...\\]`, `\\(...\\)`), to be wrapped in one `$...$`: a
    second pair inside made the text unreadable to math-verify."""
    math = math.strip().strip("$").strip()
    for left, right in (("\\[", "\\]"), ("\\(", "\\)")):
        if math.startswith(left) and math.endswith(right):
            math = math[len(left) : -len(right)].strip()
    return math


class ReasoningGym(Task):
    """One of reasoning-gym's procedural generators (Stojanovski et al. 2025; `pip install reasoning-gym`, or
    `aisrl[gym]`), by its name (`chain_sum`, `leg_counting`, `mini_sudoku`, ...) and its own options. Problems
    come from code, as ours do; an answer counts as correct when the generator's own `score_answer` gives it
    full marks (some generators give partial credit, which counts as wrong here). Many of those scorers evaluate
    the answer (eval, sympy), so an answer that reads as Python code (`__`, `import`, `os`, ...) or runs past
    MAX_GYM_ANSWER characters scores 0 without reaching them; one that could take long to evaluate (a power, a
    factorial, a function call, an exponent of three digits or more) is scored in a child process killed after 5
    seconds; and a scorer that raises on an answer (many do on ill-formed text) gives it no credit."""

    name = "reasoning_gym"

    def __init__(self, generator: str, **options):
        import reasoning_gym

        self.generator, self.options, self._create = generator, options, reasoning_gym.create_dataset
        self._scorer = self._dataset(seed=0, size=1)

    @classmethod
    def accepts(cls, generator: str = "", **options) -> dict:
        try:
            import reasoning_gym
        except ImportError as e:
            raise ValueError("task=reasoning_gym needs the reasoning-gym package: pip install reasoning-gym") from e
        names = sorted(reasoning_gym.factory.DATASETS)
        if generator not in names:
            raise ValueError(f"unknown reasoning-gym generator {generator!r} (set it with dataset=NAME); "
                             f"choose from {names}")  # fmt: skip
        config = reasoning_gym.factory.DATASETS[generator][1]  # (dataset class, config dataclass)
        fields = {f.name: f.default for f in dataclasses.fields(config) if f.name not in ("seed", "size")}
        return {"generator": generator, **fields}

    def _dataset(self, seed: int, size: int):
        # reasoning-gym draws entry i from Random(seed + i): seeds s and s + 1 would share all but one problem
        seed = int.from_bytes(hashlib.sha256(f"aisrl-reasoning-gym:{seed}".encode()).digest()[:4], "big")
        try:
            return self._create(self.generator, seed=seed, size=size, **self.options)
        except (TypeError, ValueError, AssertionError) as e:  # its config dataclass rejects an option or a value
            raise ValueError(f"reasoning-gym generator {self.generator!r} refused its options {self.options} "
                             f"(task_options): {e}") from e

    def problems(self, split, n, seed=0):
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if n <= 0:
            return []
        data, out, seen = self._dataset(seed=seed, size=200 * n + 1000), [], set()
        for i in range(len(data)):  # entry i is generated from (seed, i): the same problems on every call
            entry = data[i]
            q = str(entry["question"])
            if q in seen or _split_of(q) != split:
                continue
            seen.add(q)
            out.append(Problem(q, str(entry["answer"]), "", {"entry": entry}))
            if len(out) == n:
                return out
        raise ValueError(f"reasoning-gym generator {self.generator!r} could not produce {n} distinct {split} problems")

    def check(self, answer, problem):
        # Many generators score with eval / sympy's parse_expr on the answer: model text must not reach them as code
        # (`__import__('os')...`), nor as arithmetic that never finishes (`9**9**9**9`, `9999999!`, `1e99999999`:
        # uninterruptible in C).
        # The generator's own answer is its text, not the model's: a word list holding `open` or `input` is scored.
        own = answer.strip() == problem.answer.strip()
        if not own and (len(answer) > MAX_GYM_ANSWER or _CODE_LIKE.search(answer)):
            return False
        if _SLOW.search(answer):  # rare in answers: scored in a child process that is killed after the limit
            return _score_in_child(self._scorer.score_answer, answer, problem.meta["entry"]) >= 1.0
        try:
            return self._scorer.score_answer(answer, problem.meta["entry"]) >= 1.0
        except Exception:  # noqa: BLE001 - prime_factorization's int() on '2 x 3', say: a wrong answer, not a crash
            return False


MAX_GYM_ANSWER = 2000
"""Longest reasoning-gym answer handed to a generator's scorer (characters); longer ones score 0."""
_CODE_LIKE = re.compile(r"__|\b(?:import|lambda|exec|eval|compile|open|globals|locals|getattr|setattr|delattr|vars|"
                        r"breakpoint|input|os|sys|subprocess|builtins)\b")  # fmt: skip
_SLOW = re.compile(r"\*\*|\^|[\d)]\s*!|\bpow\b|[A-Za-z_]\w*\s*\(|\d\s*[eE]\s*[+-]?\s*\d{3,}")
"""What may take a scorer's evaluation (Python's, sympy's) long: powers, factorials, function calls (factorial(n),
gamma(n)), exponents of three digits or more."""


def _score_in_child(score, answer: str, entry: dict, timeout: float = 5.0) -> float:
    """score(answer, entry) in a forked process, 0.0 if it has not returned within `timeout` seconds (the child is
    killed) or fails."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def run():
        try:
            send.send(float(score(answer, entry)))
        except Exception:  # noqa: BLE001 - a scorer that fails on odd text gives no credit
            send.send(0.0)

    child = ctx.Process(target=run, daemon=True)
    child.start()
    send.close()
    try:
        value = recv.recv() if recv.poll(timeout) else 0.0
    except EOFError:  # the child died without an answer (it exited, or was killed for memory): no credit
        value = 0.0
    child.kill()
    child.join()
    return value


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
