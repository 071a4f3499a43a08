"""Reward functions on hand-made completions; splits; generators produce solvable problems."""

import dataclasses
import importlib.util
import json
import os
import re
import sys

import pytest
import torch

from aisrl.tasks import Arithmetic, Countdown, JsonlMath, Problem, Sudoku4, _split_of, extract_answer, make_task


def wrap(answer, reasoning="work"):
    return f"<reasoning>{reasoning}</reasoning><answer>{answer}</answer>"


def test_format_extraction():
    assert extract_answer(wrap(" 42 ")) == "42"
    assert extract_answer("  <reasoning>a\nb</reasoning>\n<answer>7</answer>\n") == "7"
    for bad in ["42", "<answer>42</answer>", wrap("1") + " trailing", "<reasoning>x</reasoning>"]:
        assert extract_answer(bad) is None, bad


def test_arithmetic_rewards():
    t, p = Arithmetic(), Problem("23+48", "71")
    assert t.reward(wrap("71"), p) == (1.5, True)
    assert t.reward(wrap("70"), p) == (0.5, False)
    assert t.reward(wrap("1,000"), Problem("999+1", "1000")) == (1.5, True)
    assert t.reward(wrap("7,1"), p) == (0.5, False) and t.reward(wrap("10,00"), Problem("999+1", "1000"))[1] is False
    assert t.reward("71", p) == (0.0, False)  # right number, wrong format: nothing


def test_countdown_rewards():
    t = Countdown()
    p = Problem("Use 3 5 7 to make 22", "(3*5)+7", meta={"numbers": [3, 5, 7], "target": 22})
    assert t.reward(wrap("3*5+7"), p) == (1.5, True)
    assert t.reward(wrap("7+5*3"), p) == (1.5, True)
    assert t.reward(wrap("3*5+7+0"), p)[1] is False  # 0 is not an available number
    assert t.reward(wrap("3*3+13"), p)[1] is False  # 3 used twice, 13 not given
    # never evaluated: evaluated, this would leave a mark in sys.modules and give 22, the target
    trap = "__import__('sys').modules.setdefault('aisrl_countdown_evaluated', 22)"
    assert t.reward(wrap(trap), p) == (0.5, False) and "aisrl_countdown_evaluated" not in sys.modules
    assert t.reward(wrap("22"), p)[1] is False
    # exact arithmetic: a float's rounding let a near miss count (before: True at 1e-9 of the target)
    many = Problem("", "(3*5)+7", meta={"numbers": [3, 5, 7, 1, 9000, 9000, 9000], "target": 22})
    assert not t.check("3*5+7+1/9000/9000/9000", many) and not t.check("3*5+7-1/(9000*9000)/9000", many)
    assert t.check("(3*5*9000+7*9000)/9000", many)  # a division that lands exactly on the target still counts
    assert t.check("7/(1/3)+1", Problem("", "", meta={"numbers": [7, 1, 3, 1], "target": 22}))  # 21 + 1, exactly
    negative = Problem("", "3-5", meta={"numbers": [3, 5, 8], "target": -2})  # a sign uses no number (as eval reads it)
    assert all(t.check(a, negative) for a in ("3-5", "-5+3", "-(5-3)")) and not t.check("-(5+3)", negative)
    # what a pretrained model writes: the expression with its target, and the signs × and ÷
    assert all(t.check(a, p) for a in ("3*5+7=22", "3*5 + 7 = 22", "22 = 7+3*5", "3 × 5 + 7", "(3×5)+7 = 22"))
    assert t.check("7÷(1÷3)+1", Problem("", "", meta={"numbers": [7, 1, 3, 1], "target": 22}))
    assert not any(t.check(a, p) for a in ("3*5+7=23", "3*5+7=22=22", "3*5=15", "= 22", "3*5+7 =", "22 = 22"))


def test_sudoku_rewards():
    t = Sudoku4()
    p = Problem("1034341223414103", "1234341223414123")
    assert t.reward(wrap("1234341223414123"), p) == (1.5, True)
    assert t.reward(wrap("1234 3412 2341 4123"), p)[1] is True
    assert t.reward(wrap("2134341223414123"), p)[1] is False  # invalid grid
    # each rule on its own, every clue kept: a row (1434 repeats 4), a box (rows and columns are permutations, the
    # top-left box holds 1, 2, 2, 3), a column (rows and boxes are permutations, column 0 reads 1, 3, 1, 3)
    assert t.reward(wrap("1434341223414143"), p) == (0.5, False)
    assert t.reward(wrap("1234234134124123"), Problem("0" * 16, "")) == (0.5, False)
    assert t.reward(wrap("1234341212343412"), Problem("0" * 16, "")) == (0.5, False)
    assert t.reward(wrap("3412123441232341"), Problem("1000000000000000", ""))[1] is False  # breaks a clue


@pytest.mark.parametrize("name", ["arithmetic", "countdown", "sudoku4"])
def test_generated_problems_are_solved_by_their_reference(name):
    task = make_task(name)
    train, test = task.problems("train", 40, seed=1), task.problems("test", 10, seed=1)
    assert not {p.question for p in train} & {p.question for p in test}  # disjoint splits
    assert task.problems("train", 40, seed=1)[0].question == train[0].question  # deterministic
    for p in train + test:
        assert task.reward(wrap(p.answer), p) == (1.5, True), p
        # the reference answers are right, by a computation of their own (check alone compares with p.answer)
        if name == "arithmetic":
            a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)", p.question).groups()
            assert int(p.answer) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op], p
        elif name == "countdown":
            nums, target = re.fullmatch(r"Use ([\d ]+) to make (-?\d+)", p.question).groups()
            assert eval(p.answer) == int(target), p  # noqa: S307 - the generator's own digits and + - * ( )
            assert sorted(map(int, re.findall(r"\d+", p.answer))) == sorted(map(int, nums.split())), p


def test_jsonl_task_and_errors(tmp_path):
    path = tmp_path / "gsm.jsonl"
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i}+{i} = {2 * i}\n#### {2 * i}"} for i in range(40)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    t = JsonlMath(str(path))
    train, test = t.problems("train", 100), t.problems("test", 100)
    assert len(train) + len(test) == 40 and not {p.question for p in train} & {p.question for p in test}
    p = train[0]
    assert t.reward(wrap(p.answer), p) == (1.5, True)
    assert t.reward(wrap(str(int(p.answer) + 1)), p)[1] is False
    with pytest.raises(FileNotFoundError, match="dataset 'nope.jsonl' not found"):
        JsonlMath("nope.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"question": "q", "answer": "1"}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not a JSON object per line"):
        JsonlMath(str(tmp_path / "bad.jsonl"))
    (tmp_path / "noans.jsonl").write_text('{"question": "q"}\n')
    with pytest.raises(ValueError, match="row 1 needs a 'question'"):
        JsonlMath(str(tmp_path / "noans.jsonl"))
    with pytest.raises(ValueError, match="unknown task 'chess'; choose from"):
        make_task("chess")
    with pytest.raises(ValueError, match="split must be 'train' or 'test', got 'validation'"):
        t.problems("validation", 3)
    # a null or empty answer would be matched by 'none' or by an empty answer; a blank file holds nothing to train on
    for name, text, message in [
        ("null.jsonl", '{"question": "q", "answer": null}', r"row 1's answer is None; it must be a string or a number"),
        ("dict.jsonl", '{"question": "q", "answer": {"x": 1}}', "row 1's answer is"),
        ("empty.jsonl", '{"question": "q", "answer": "1"}\n{"question": "r", "answer": "####"}', "row 2 has an empty"),
        ("blank.jsonl", "\n\n", "holds no problems"),
        ("clash.jsonl", '{"question": "q", "answer": "1"}\n{"question": "q", "answer": "2"}',
         r"rows 1 and 2 ask the same question with different answers \('1', '2'\)"),
    ]:  # fmt: skip
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=message):
            JsonlMath(str(tmp_path / name))
    (tmp_path / "twice.jsonl").write_text('{"question": "q", "answer": "1"}\n{"question": "q", "answer": 1}')
    assert [p.question for p in JsonlMath(str(tmp_path / "twice.jsonl")).rows] == ["q"]  # one problem once
    # JSON lets U+2028 and \x85 stand raw inside a string (json.dumps(ensure_ascii=False) writes them so), and an
    # editor may begin the file with a byte-order mark: both are valid JSONL (before: "not a JSON object per line")
    raw = [{"question": "line\u2028separator", "answer": "1"}, {"question": "next\x85line", "answer": "2"}]
    (tmp_path / "raw.jsonl").write_text("\ufeff" + "\r\n".join(json.dumps(r, ensure_ascii=False) for r in raw),
                                        encoding="utf-8")  # fmt: skip
    assert [(p.question, p.answer) for p in JsonlMath(str(tmp_path / "raw.jsonl")).rows] == [
        ("line\u2028separator", "1"), ("next\x85line", "2")]  # fmt: skip
    (tmp_path / "zipped.jsonl").write_bytes(b"\x1f\x8b\x08\x00 not text")
    with pytest.raises(ValueError, match=r"zipped.jsonl is not UTF-8 text .*decompress a .gz first"):
        JsonlMath(str(tmp_path / "zipped.jsonl"))


def test_lenient_reward_credits_a_correct_final_number():
    from aisrl.tasks import make_task

    strict, lenient = make_task("arithmetic"), make_task("arithmetic", lenient=True)
    p = Problem("12+7", "19")
    text = "Let me add: 12 plus 7 gives 19."
    assert strict.reward(text, p) == (0.0, False)
    assert lenient.reward(text, p) == (1.0, True)  # correctness points, no format points
    assert lenient.reward("12+7 is 18", p) == (0.0, False)
    assert lenient.reward("12+7 is 1,9", p) == (0.0, False)  # a comma only separates thousands
    assert lenient.reward("1,000+7 is 1,007", Problem("1000+7", "1007")) == (1.0, True)
    assert lenient.reward(wrap("19"), p) == (1.5, True)  # the format still earns its points


def test_countdown_survives_hostile_answers():
    t = Countdown()
    p = Problem("Use 3 5 7 to make 22", "(3*5)+7", meta={"numbers": [3, 5, 7], "target": 22})
    for hostile in ["9" * 400 + "/1", "1+" * 2000 + "1", "(" * 500 + "1" + ")" * 500, "10**10**10", "1/0"]:
        assert t.reward(wrap(hostile), p) == (0.5, False), hostile[:20]


def test_repeated_blocks_are_not_the_format():
    assert extract_answer(wrap("1") + wrap("2")) is None


def test_column_trace_is_schoolbook_addition():
    from aisrl.tasks import column_trace

    assert column_trace(47, 38) == "7+8=15,4+3+1=8"
    assert column_trace(5, 7) == "5+7=12" and column_trace(99, 99) == "9+9=18,9+9+1=19"
    assert column_trace(100, 5) == "0+5=5,0+0+0=0,1+0+0=1"
    p = Arithmetic(ops="+", trace="columns").problems("train", 1, seed=3)[0]
    a, b = p.meta["a"], p.meta["b"]
    # the last column's sum followed by the lower columns' units, most significant first, is the answer
    sums = [int(c.split("=")[1]) for c in p.solution.split(",")]
    assert int(str(sums[-1]) + "".join(str(s % 10) for s in reversed(sums[:-1]))) == a + b == int(p.answer)
    with pytest.raises(ValueError, match="addition only"):
        Arithmetic(ops="+-", trace="columns")
    with pytest.raises(ValueError, match="unknown arithmetic trace"):
        Arithmetic(trace="words")


def test_parquet_and_saved_datasets_give_the_same_problems_as_jsonl(tmp_path):
    rows = [{"problem": f"What is {i} * 3?", "answer": str(3 * i)} for i in range(30)]
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    ref = make_task("dataset", path=str(tmp_path / "m.jsonl")).problems("train", 50, seed=1)
    assert len(ref) > 10 and ref[0].question.startswith("What is")
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "m.parquet")
    got = make_task("dataset", path=str(tmp_path / "m.parquet")).problems("train", 50, seed=1)
    assert [(p.question, p.answer) for p in got] == [(p.question, p.answer) for p in ref]
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    got = make_task("dataset", path=str(tmp_path / "saved")).problems("train", 50, seed=1)
    assert [(p.question, p.answer) for p in got] == [(p.question, p.answer) for p in ref]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"several splits \['train'\]; point at one split"):
        make_task("dataset", path=str(tmp_path / "dd"))


def test_task_options_are_checked_against_the_task():
    assert make_task("arithmetic", max_operand=9).problems("train", 5)[0].meta["a"] <= 9
    tiny = make_task("arithmetic", max_operand=1, ops="+")  # 0+0 ... 1+1: four problems over both splits
    with pytest.raises(ValueError, match=r"could not produce 50 distinct train problems \(it has about [0-4] under "
                                         r"these options\): ask for fewer .*lab.sft_examples"):  # fmt: skip
        tiny.problems("train", 50)
    # it gives up once a long run of draws finds nothing new, not after 200 draws per problem asked for (a training
    # pool of 100000 drew 20 million problems, a minute, before saying so); a pool the task can fill is unchanged
    draws, real = [], tiny.generate
    tiny.generate = lambda rng: draws.append(1) or real(rng)
    with pytest.raises(ValueError, match=r"could not produce 100000 distinct train problems"):
        tiny.problems("train", 100_000)
    assert len(draws) < 20_000  # 10_000 plus 100 per problem found, after the last new one
    full = make_task("arithmetic", max_operand=4, ops="+")  # 25 problems over both splits: the whole pool is found
    train = {f"{a}+{b}" for a in range(5) for b in range(5) if _split_of(f"{a}+{b}") == "train"}  # counted by hand
    assert {p.question for p in full.problems("train", len(train))} == train
    with pytest.raises(ValueError, match=r"task 'arithmetic' got options \['bogus'\]; it accepts \['max_operand'"):
        make_task("arithmetic", bogus=1)
    with pytest.raises(ValueError, match=r"task 'jsonl' got options \[\]; it accepts \['path'\]"):
        make_task("jsonl")
    with pytest.raises(ValueError, match=r"option 'max_operand' expects int \(default 99\), got '20'"):
        make_task("arithmetic", max_operand="20")
    # values out of range fail when checked, naming the option (before: IndexError or randrange's error, later)
    from aisrl.tasks import check_task

    for name, opts, message in [("countdown", {"n_numbers": 1}, "n_numbers >= 2"),
                                ("countdown", {"max_number": 0}, r"max_number in \[1, 10000\]"),
                                ("countdown", {"max_number": 10**10}, r"max_number in \[1, 10000\]"),
                                ("sudoku4", {"holes": 17}, r"holes .* in \[0, 16\]; got 17"),
                                ("arithmetic", {"max_operand": -5}, "max_operand .* >= 0; got -5")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            check_task(name, **opts)
    check_task("countdown", n_numbers=2, max_number=1)


def test_reasoning_gym_generator_by_name():
    pytest.importorskip("reasoning_gym")
    task = make_task("reasoning_gym", generator="chain_sum", min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    train, test = task.problems("train", 30, seed=3), task.problems("test", 5, seed=3)
    assert not {p.question for p in train} & {p.question for p in test}  # disjoint splits
    assert [p.question for p in task.problems("train", 30, seed=3)] == [p.question for p in train]  # deterministic
    assert [p.question for p in task.problems("train", 30, seed=4)] != [p.question for p in train]
    for p in train + test:
        a, op, b = re.fullmatch(r".*?(\d) ([+-]) (\d) =", p.question).groups()  # two one-digit terms, as asked
        value = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert p.answer == str(value)
        assert task.reward(wrap(str(value)), p) == (1.5, True)
        assert task.reward(wrap(str(value + 1)), p) == (0.5, False)
    with pytest.raises(ValueError, match="unknown reasoning-gym generator 'chess'.*choose from .*'chain_sum'"):
        make_task("reasoning_gym", generator="chess")
    with pytest.raises(ValueError, match="generator 'chain_sum' refused its options"):
        make_task("reasoning_gym", generator="chain_sum", min_terms=5, max_terms=2)
    with pytest.raises(ValueError, match=r"options \['generator', 'terms'\]; it accepts \['generator', 'min_terms'"):
        make_task("reasoning_gym", generator="chain_sum", terms=3)  # its options are its config's fields
    with pytest.raises(ValueError, match="option 'max_terms' expects int .default 6., got '3'"):
        make_task("reasoning_gym", generator="chain_sum", max_terms="3")
    # reasoning-gym draws entry i from seed + i; the task mixes the seed, so neighbouring seeds share few problems
    other = {p.question for p in task.problems("train", 30, seed=4)}
    assert len(other & {p.question for p in train}) < 15


def test_math_answers_are_compared_symbolically(tmp_path):
    pytest.importorskip("math_verify")
    import threading

    gold = {"Half of one?": r"\frac{1}{2}", "Expand it.": "x^2+1", "Root of two?": r"\sqrt{2}", "Count.": "1,000",
            "Is it?": "no"}
    path = tmp_path / "math.jsonl"
    path.write_text("\n".join(json.dumps({"problem": q, "answer": a}) for q, a in gold.items()))
    t = JsonlMath(str(path))
    by_q = {p.question: p for p in t.problems("train", 10) + t.problems("test", 10)}
    right = {"Half of one?": "0.5", "Expand it.": "1+x^2", "Root of two?": "2^{1/2}", "Count.": "1000", "Is it?": "No"}
    wrong = {"Half of one?": "0.6", "Expand it.": "x^2+2", "Root of two?": r"\sqrt{3}", "Count.": "100", "Is it?": "on"}
    for q, p in by_q.items():
        assert t.reward(wrap(right[q]), p) == (1.5, True), q
        assert t.reward(wrap(p.answer), p) == (1.5, True), q
        assert t.reward(wrap(wrong[q]), p) == (0.5, False), q
    seen = []  # math-verify's timeouts need the main thread; elsewhere it runs without them instead of failing
    worker = threading.Thread(target=lambda: seen.append(t.check("0.5", by_q["Half of one?"])))
    worker.start()
    worker.join()
    assert seen == [True]


def test_without_math_verify_answers_compare_as_integers_or_text(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify now raises ImportError
    t = JsonlMath.__new__(JsonlMath)
    assert t.check("1,000", Problem("q", "1000")) and t.check(" x^2+1", Problem("q", "x^2+1"))
    assert not t.check("0.5", Problem("q", r"\frac{1}{2}")) and not t.check("999", Problem("q", "1000"))


def test_reasoning_gym_answers_never_reach_a_scorer_as_code_or_as_an_endless_power(tmp_path):
    pytest.importorskip("reasoning_gym")
    import time

    from aisrl.tasks.data import _score_in_child

    task = make_task("reasoning_gym", generator="countdown")  # its scorer parses answers with sympy (eval)
    p = task.problems("train", 1, seed=0)[0]
    marker = tmp_path / "ran"
    attack = f"__import__('os').system('touch {marker}') or 0"
    assert task.reward(wrap(attack), p) == (0.5, False) and not marker.exists()
    assert task.reward(wrap(p.answer), p) == (1.5, True)
    assert task.reward(wrap("2**3"), p) == (0.5, False)  # a power is scored, in a child process
    # the generator's own answer is scored even where it holds a word the code filter stops (before: 0 points)
    words = make_task("reasoning_gym", generator="word_sorting")
    w = words.problems("train", 1, seed=0)[0]
    w = dataclasses.replace(w, answer=w.answer + ", open", meta={"entry": {**w.meta["entry"],
                            "answer": w.meta["entry"]["answer"] + ", open"}})  # fmt: skip
    assert words.check(w.answer, w) and not words.check(w.answer.replace(", open", ", open()"), w)
    # a scorer that never returns is killed after the limit and gives no credit
    t0 = time.perf_counter()
    assert _score_in_child(lambda a, e: time.sleep(60) or 1.0, "9**9**9**9", {}, timeout=0.5) == 0.0
    assert time.perf_counter() - t0 < 5
    assert _score_in_child(lambda a, e: 1.0, "2**3", {}) == 1.0
    assert _score_in_child(lambda a, e: 1 / 0, "2**3", {}) == 0.0
    assert _score_in_child(lambda a, e: os._exit(3), "2**3", {}) == 0.0  # died without an answer (was EOFError)


def test_reasoning_gym_answers_that_may_evaluate_for_ever_or_raise_give_no_credit(monkeypatch):
    pytest.importorskip("reasoning_gym")
    import aisrl.tasks.data as data

    task = make_task("reasoning_gym", generator="countdown")
    p = task.problems("train", 1, seed=0)[0]
    sent = []
    monkeypatch.setattr(data, "_score_in_child", lambda score, answer, entry: sent.append(answer) or 0.0)
    # each of these ran in the trainer's process for minutes (sympy evaluates them); now in a child killed in 5 s
    slow = ["9999999!", "factorial(9999999)", "gamma (9999999)", "1e99999999", "2 E+999", "9**9**9", "9^9^9"]
    assert not any(task.check(a, p) for a in slow) and sent == slow
    assert task.check(p.answer, p) and not task.check("1e99", p) and sent == slow  # plain answers stay in-process
    assert not task.check("Yes!", p) and sent == slow  # an exclamation mark after a word is no factorial: no fork
    # a scorer that raises on ill-formed text scores it 0 (before: the ValueError ended the run)
    factors = make_task("reasoning_gym", generator="prime_factorization")
    q = factors.problems("train", 1, seed=0)[0]
    assert factors.reward(wrap("2 x 3"), q) == (0.5, False) and factors.check(q.answer, q)


def test_text_outside_the_blocks_gets_no_format_points():
    from aisrl.tasks import extract_answer

    assert extract_answer("<reasoning>a</reasoning><answer>71</answer>") == "71"
    for text in ("<reasoning>a</reasoning> junk </reasoning><answer>71</answer>",
                 "<reasoning>a</reasoning></reasoning><answer>71</answer>"):  # fmt: skip
        assert extract_answer(text) is None


def test_countdown_splits_hold_no_puzzle_twice_in_another_order():
    task = make_task("countdown")
    key = lambda p: (tuple(sorted(p.meta["numbers"])), p.meta["target"])  # noqa: E731
    train, test = task.problems("train", 2000, seed=0), task.problems("test", 200, seed=1)
    assert not {key(p) for p in train} & {key(p) for p in test}
    assert len({key(p) for p in train}) == len(train)


def test_a_numeric_answer_among_plain_words_is_that_number():
    from aisrl.tasks import JsonlMath, Problem

    task = JsonlMath.__new__(JsonlMath)  # check() needs no file
    symbolic = importlib.util.find_spec("math_verify") is not None  # without it, non-integers compare as exact text
    for gold, answer, right in [("18", "18 dollars", True), ("1000", "1,000 dollars", True), ("18", "It is 18.", True),
                                ("-18", "It is -18", True), ("18", "17 dollars", False), ("18", "18 and 19", False),
                                ("18", "18x", False), ("x+1", "x + 1", symbolic), ("71", "7,1", False),
                                ("123", "1,2,3", False), ("1234", "1,234", True), ("5", ".5", False),
                                ("50", "$.50", False), ("0.5", ".5", symbolic), ("18", "The answer is 18 cm.", True),
                                # words that change the value or deny it (before: each read as the bare number)
                                ("5", "5 thousand", False), ("5", "5 Million", False), ("5", "negative 5", False),
                                ("5", "minus 5", False), ("18", "not 18", False), ("10", "half of 10", False),
                                ("3", "3 squared", False), ("18", "about 18", False),
                                # what instruct models write around a right answer (before: each scored wrong)
                                ("18", "**18**", True), ("18", "€18", True), ("18", "£18", True),
                                ("18", "18 (apples)", True), ("18", r"\[18\]", symbolic), ("18", r"$\(18\)$", symbolic),
                                ("yes", "Yes.", True), ("yes", "**Yes**", True), ("Monday", "monday.", True),
                                ("yes", "Yes, no", False),
                                # denials and relations (before: each read as the number it names)
                                ("18", "It isn't 18.", False), ("18", "18 is wrong", False),
                                ("18", "at least 18", False),
                                ("18", "19 = 18", False), ("18", r"18 \approx 19", False), ("4", "x = 5 = 4", False),
                                ("18", "x = 18", symbolic), ("x=2", "x = 2", symbolic),
                                # and what they must not catch: the words of a question, a side naming the value
                                ("18", "18 more apples", symbolic), ("18", "The least number of boxes is 18", True),
                                ("18", "The most he can buy is 18", True), ("18", "Don ate 18 cookies", True),
                                ("7", "f(2) = 7", symbolic), ("5", "x_1 = 5", symbolic), ("8", "2^3=8", symbolic),
                                ("4", r"\sqrt{16} = 4", symbolic), ("18", "18 = 18", symbolic)]:  # fmt: skip
        assert task.check(answer, Problem("q", gold)) is right, (gold, answer)


def test_word_answers_need_no_math_verify(monkeypatch):
    """A word reference is compared as words; without math-verify, `Yes.` against `yes` was read as an integer."""
    import sys

    from aisrl.tasks import JsonlMath, Problem

    monkeypatch.setitem(sys.modules, "math_verify", None)  # `import math_verify` now raises ImportError
    task = JsonlMath.__new__(JsonlMath)
    assert task.check("Yes.", Problem("q", "yes")) and task.check("**Monday**", Problem("q", "Monday"))
    assert not task.check("Tuesday", Problem("q", "Monday")) and task.check("It is 18.", Problem("q", "18"))


def test_sudoku4_draws_every_grid_and_splits_by_grid():
    from aisrl.tasks.procedural import _sudoku4_grids

    grids = _sudoku4_grids()
    assert len(grids) == len(set(grids)) == 288 and all(Sudoku4.valid(g) for g in grids)  # 4x4 Sudoku has 288
    t = Sudoku4(holes=10)
    train, test = t.problems("train", 3000, seed=0), t.problems("test", 80, seed=1)
    assert len({p.question for p in train}) == 3000  # many puzzles per grid, each puzzle once
    # a held-out solution is never a training answer (before: puzzles of one grid landed in both splits)
    assert not {p.answer for p in train} & {p.answer for p in test}
    assert len({p.answer for p in train} | {p.answer for p in test}) > 200  # before: 96 grids reachable


def test_long_digit_strings_are_wrong_answers_not_errors():
    a = make_task("arithmetic", lenient=True)
    p = Problem("1+1", "2")
    assert a.reward("1" * 5000, p) == (0.0, False)  # Python refuses int() past 4300 digits: was a ValueError
    assert a.reward(wrap("1" * 5000), p) == (0.5, False)
    assert a.reward(wrap("2"), p) == (1.5, True)


def test_asking_for_no_problems_gives_none():
    for name in ("arithmetic", "countdown", "sudoku4"):
        assert make_task(name).problems("train", 0) == []


def test_an_answer_of_two_delimited_values_is_not_the_first(tmp_path):
    pytest.importorskip("math_verify")
    path = tmp_path / "two.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "2"}))
    t, p = JsonlMath(str(path)), Problem("q", "2")
    # before: the outer \( and \) were taken off as if they wrapped one piece of math, leaving `2\) and \(3`: read as 2
    assert not t.check(r"\(2\) and \(3\)", p) and not t.check(r"\[2\] or \[3\]", p)
    assert t.check(r"\(2\)", p) and t.check(r"\[ 2 \]", p) and t.check("$2$", p)  # one value, delimited: still 2


def test_edges_of_the_rules_by_hand(tmp_path):
    """Values worked out by hand where a plausible slip in the code would change them (found by mutation testing)."""
    from aisrl.solrl import select_extremes
    from aisrl.tasks.base import _plain_number

    countdown = Problem("Use 3 5 7 to make 22", "(3*5)+7", meta={"numbers": [3, 5, 7], "target": 22})
    assert not Countdown().check("5*5-3", countdown)  # 25 - 3 = 22, but 5 is given once
    assert Sudoku4().check("1234341221434321", Problem("0" * 16, ""))  # a valid grid...
    assert not Sudoku4().check("1234341221434321", Problem("0" * 15 + "3", ""))  # ...that breaks the last clue
    assert Sudoku4(holes=16).problems("train", 1)[0].question == "0" * 16  # every cell a hole
    assert _plain_number("1000,000") is None and _plain_number("1,000,000") == 1_000_000  # thousands groups of 3
    assert Arithmetic().reward(wrap("+71"), Problem("23+48", "71")) == (1.5, True)  # a written plus sign
    assert select_extremes(torch.tensor([3.0, 1.0, 2.0, 0.0]), pool=4, keep=4).tolist() == [3, 1, 2, 0]  # keep = pool
    # 1 in 8 problems held out: 8000 strings, 1000 expected, SD about 30
    assert 900 <= sum(_split_of(str(i)) == "test" for i in range(8000)) <= 1100
    # every distinct problem of a small space is found: 0-9 + 0-9 has 100, of which the split rule holds out these
    small = Arithmetic(max_operand=9, ops="+")
    k = sum(_split_of(f"{a}+{b}") == "test" for a in range(10) for b in range(10))
    assert len(small.problems("test", k, seed=7)) == k
    # GSM8K's `#### 72` keeps 72 (spaces off); a line of spaces in a JSONL file is no row
    path = tmp_path / "gsm.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "work\n#### 72"}) + "\n   \n"
                    + json.dumps({"question": "r", "answer": "5"}) + "\n")  # fmt: skip
    assert [p.answer for p in JsonlMath(str(path)).rows] == ["72", "5"]


def test_a_dataset_question_is_one_problem_whatever_its_spacing(tmp_path):
    # a copy of a question with other spacing is the same problem: kept once, refused with another answer, and in
    # the split its single-spaced text falls in (before: its exact text was hashed, so copies could land in both)
    plain = [{"question": f"How many apples are in basket {i}?", "answer": str(i)} for i in range(40)]
    spaced = [{"question": f"  How many\napples  are in\tbasket {i}? ", "answer": str(i)} for i in range(40)]
    for name, rows in (("plain", plain), ("spaced", spaced), ("both", plain + spaced)):
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    sets = {name: JsonlMath(str(tmp_path / f"{name}.jsonl")) for name in ("plain", "spaced", "both")}
    assert len(sets["both"].rows) == 40 and sets["both"].rows[0].question == plain[0]["question"]  # the first copy
    held = [sorted(" ".join(p.question.split()) for p in t.problems("test", 40)) for t in sets.values()]
    assert held[0] == held[1] == held[2] and 0 < len(held[0]) < 40
    expected = sorted(r["question"] for r in plain if _split_of(r["question"]) == "test")  # by the plain text
    assert held[0] == expected
    clash = [plain[0], {**spaced[0], "answer": "7"}]
    (tmp_path / "clash.jsonl").write_text("\n".join(json.dumps(r) for r in clash))
    with pytest.raises(ValueError, match=r"rows 1 and 2 ask the same question with different answers \('0', '7'\)"):
        JsonlMath(str(tmp_path / "clash.jsonl"))
