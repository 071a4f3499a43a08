"""Tasks read from data: a local JSONL file or folder of free-form math (math-verify, with a lenient numeric
fallback), and reasoning-gym's procedural datasets (scored by reasoning-gym itself; an answer that could evaluate for
ever, or looks like code, in a child process with a timeout)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
import threading
from pathlib import Path

from aisrl.tasks.base import _NUMBER, Problem, Task, _int_or_none, _plain_number, _split_of

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
            key = _question_key(problem.question)  # one problem once: `problems` promises distinct problems
            if key in seen:
                first, first_ans = seen[key]
                if first_ans != ans:
                    raise ValueError(f"{path}: rows {first} and {i + 1} ask the same question with different answers "
                                     f"({first_ans!r}, {ans!r}); keep one")  # fmt: skip
                continue
            seen[key] = (i + 1, ans)
            self.rows.append(problem)
        if not self.rows:
            raise ValueError(f"{path} holds no problems; give a dataset with 'question' and 'answer' rows")

    def problems(self, split, n, seed=0):
        """Up to n distinct problems of `split`: a file holds what it holds (the trainer says when it is fewer)."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        pool = [p for p in self.rows if _split_of(_question_key(p.question)) == split]
        random.Random(seed).shuffle(pool)
        return pool[:n]

    problems_version = 2  # 2: a question's split and identity ignore its spacing
    scorer_version = 3  # 2: `**18**`, `€18`, `18 (apples)`, `\\[18\\]`, `Yes.` count; `isn't 18`, `19 = 18` do not;
    # 3: `\\(2\\) and \\(3\\)` is two values, not 2

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


def _question_key(question: str) -> str:
    """What identifies a dataset question: its words, whatever whitespace separates them, so that a copy of a
    question with other spacing or line breaks is the same problem (kept once, and in one split only)."""
    return " ".join(question.split())


def _unwrapped(math: str) -> str:
    """LaTeX without its math delimiters (`$...$`, `\\[...\\]`, `\\(...\\)`), to be wrapped in one `$...$`: a
    second pair inside made the text unreadable to math-verify. Only a pair around the whole text is taken off: in
    `\\(2\\) and \\(3\\)` the first and last delimiters belong to two pieces of math, and taking them off left
    `2\\) and \\(3`, which math-verify read as 2 (an answer of two values scored as the first)."""
    math = math.strip().strip("$").strip()
    for left, right in (("\\[", "\\]"), ("\\(", "\\)")):
        inner = math[len(left) : -len(right)]
        if math.startswith(left) and math.endswith(right) and left not in inner and right not in inner:
            math = inner.strip()
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
