"""Procedural tasks, generated from a seed by code alone: column arithmetic, Countdown, and 4x4 Sudoku."""

from __future__ import annotations

import ast
import functools
import operator
import re
from fractions import Fraction

from aisrl.tasks.base import Problem, Task, _int_or_none


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
