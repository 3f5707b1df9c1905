"""The arithmetic task: problem text, the train/test split and the answer checker (the RL reward)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from generator.tasks.arithmetic import (
    ArithmeticTask,
    Problem,
    check_answer,
    evaluate,
    extract_answer,
    format_target,
    make_problem,
    normalize_int,
    sloppy_result,
)

REPO = Path(__file__).resolve().parents[2]


def test_problem_text_and_target() -> None:
    p = make_problem((37, 45), ("+",))
    assert p == Problem(prompt="37+45=", answer="82", operands=(37, 45), ops=("+",))
    assert format_target(p) == "<answer>82</answer>"
    neg = make_problem((3, 11), ("-",))
    assert (neg.prompt, neg.answer, format_target(neg)) == ("3-11=", "-8", "<answer>-8</answer>")


def test_evaluate_uses_precedence_and_left_to_right() -> None:
    assert evaluate((2, 3, 4), ("+", "*")) == 14
    assert evaluate((2, 3, 4), ("*", "-")) == 2
    assert evaluate((10, 2, 3), ("-", "-")) == 5
    with pytest.raises(ValueError):
        evaluate((1, 2), ("/",))
    with pytest.raises(ValueError):
        evaluate((1, 2, 3), ("+",))


def test_sampled_problems_are_in_range_and_correct() -> None:
    task = ArithmeticTask(min_value=5, max_value=20, ops=("+", "-", "*"), num_operands=3)
    for p in task.sample(300, "train", random.Random(0)):
        assert all(5 <= v <= 20 for v in p.operands) and len(p.ops) == 2
        assert p.answer == str(evaluate(p.operands, p.ops))
        assert p.prompt == f"{p.operands[0]}{p.ops[0]}{p.operands[1]}{p.ops[1]}{p.operands[2]}="


def test_split_is_disjoint_exhaustive_and_close_to_fraction() -> None:
    task = ArithmeticTask(max_value=19, ops=("+", "-", "*"), heldout_fraction=0.25)
    train = [p.prompt for p in task.enumerate("train")]
    test = [p.prompt for p in task.enumerate("test")]
    everything = [p.prompt for p in task.enumerate()]
    assert len(everything) == task.space_size == 20 * 20 * 3
    assert len(set(everything)) == len(everything)
    assert not set(train) & set(test)
    assert sorted(train + test) == sorted(everything)
    # Binomial(1200, 0.25): sd ~ 15; 4 sd either side.
    assert abs(len(test) - 300) < 60, len(test)


def test_sample_respects_split_whatever_the_seed() -> None:
    task = ArithmeticTask()
    for seed in range(3):
        rng = random.Random(seed)
        assert all(task.split_of(p) == "test" for p in task.sample(50, "test", rng))
        assert all(task.split_of(p) == "train" for p in task.sample(50, "train", rng))
    # Same rng state -> same problems (reproducible runs).
    assert task.sample(20, "train", random.Random(7)) == task.sample(20, "train", random.Random(7))


def test_salt_changes_the_split_but_fraction_holds() -> None:
    a = ArithmeticTask(max_value=29)
    b = ArithmeticTask(max_value=29, split_salt="other")
    test_a = {p.prompt for p in a.enumerate("test")}
    test_b = {p.prompt for p in b.enumerate("test")}
    assert test_a != test_b
    assert abs(len(test_a) - 180) < 50 and abs(len(test_b) - 180) < 50


def test_empty_split_raises_instead_of_looping() -> None:
    task = ArithmeticTask(max_value=9, heldout_fraction=0.0)
    with pytest.raises(RuntimeError, match="split"):
        task.sample(1, "test", random.Random(0), max_tries_per_item=50)
    with pytest.raises(ValueError):
        task.sample(1, "validation", random.Random(0))
    assert len(list(task.enumerate("test"))) == 0


def test_enumerate_refuses_huge_spaces() -> None:
    with pytest.raises(ValueError, match="max_problems"):
        next(ArithmeticTask(max_value=999, num_operands=3).enumerate())


@pytest.mark.slow
def test_split_is_stable_across_processes_and_hash_seeds() -> None:
    """Python's hash() is salted per process; a split built on it would leak test problems into training."""
    task = ArithmeticTask()
    problems = task.sample(200, "train", random.Random(0)) + task.sample(50, "test", random.Random(0))
    prompts = [p.prompt for p in problems]
    here = [task.split_of(p) for p in problems]
    code = (
        "import json,sys\n"
        "from generator.tasks.arithmetic import ArithmeticTask, Problem\n"
        "t = ArithmeticTask()\n"
        "ps = json.loads(sys.stdin.read())\n"
        "print(json.dumps([t.split_of(Problem(s, '0', (), ())) for s in ps]))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(prompts),
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        check=True,
        timeout=60,
    )
    assert json.loads(out.stdout) == here
    assert here.count("test") == 50


def test_split_golden_values() -> None:
    """Pins the hash recipe: changing it silently reshuffles train/test between versions."""
    task = ArithmeticTask()
    splits = "".join("T" if task.split_of(p) == "test" else "." for p in task.enumerate(max_problems=10**6))
    assert len(splits) == 20000
    assert splits[:40] == GOLDEN_FIRST_40
    assert splits.count("T") == GOLDEN_TEST_COUNT


GOLDEN_FIRST_40 = "......T......T......T.T.T..............."
GOLDEN_TEST_COUNT = 1977


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer>82</answer>", "82"),
        ("no tags at all", None),
        ("", None),
        ("<answer>1</answer> then <answer>2</answer>", "2"),
        ("<answer>1<answer>2</answer>", "2"),
        ("<answer>3</answer><answer>4", "3"),
        ("<answer>5", None),
        ("5</answer>", None),
        ("</answer><answer>", None),
        ("<answer>  -8 \n</answer>", "-8"),
        ("<answer></answer>", ""),
        ("<think>12</think><answer>12</answer>", "12"),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("<answer>82</answer>", "82", 1.0),
        ("<answer>83</answer>", "82", 0.0),
        ("<answer> 82 </answer>", "82", 1.0),
        ("<answer>+82</answer>", "82", 1.0),
        ("<answer>0082</answer>", "82", 1.0),  # leading zeros: same value, accepted
        ("<answer>82.0</answer>", "82", 0.0),  # decimals: rejected, integer task
        ("<answer>8 2</answer>", "82", 0.0),
        ("<answer>8_2</answer>", "82", 0.0),  # int() would accept this
        ("<answer>٨٢</answer>", "82", 0.0),  # Arabic-Indic digits; int() would accept this
        ("<answer>-8</answer>", "-8", 1.0),
        ("<answer>8</answer>", "-8", 0.0),
        ("<answer>-0</answer>", "0", 1.0),
        ("<answer>--8</answer>", "-8", 0.0),
        ("<answer>- 8</answer>", "-8", 0.0),
        ("<answer>1</answer><answer>82</answer>", "82", 1.0),
        ("<answer>82</answer><answer>1</answer>", "82", 0.0),
        ("82", "82", 0.0),
        ("<answer>82", "82", 0.0),
        ("", "82", 0.0),
        ("<answer>" + "9" * 10000 + "</answer>", "82", 0.0),  # beyond int()'s digit limit: no raise
        ("\x00<answer>\x00</answer>", "0", 0.0),
    ],
)
def test_check_answer(completion: str, answer: str, reward: float) -> None:
    assert check_answer(completion, answer) == reward


def test_check_answer_rejects_bad_reference_and_non_str_completion() -> None:
    with pytest.raises(ValueError):
        check_answer("<answer>1</answer>", "one")
    assert check_answer(None, "1") == 0.0  # type: ignore[arg-type]
    assert normalize_int(" +007 ") == "7" and normalize_int("-000") == "0" and normalize_int("1e3") is None


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_check_answer_never_raises(text: str) -> None:
    assert check_answer(text, "5") in (0.0, 1.0)
    assert check_answer(f"<answer>{text}", "5") in (0.0, 1.0)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=-(10**30), max_value=10**30), st.text(alphabet=" \n<>/a", max_size=10))
def test_check_answer_is_exact_on_integers(n: int, noise: str) -> None:
    assert check_answer(f"{noise}<answer>{n}</answer>", str(n)) == 1.0
    assert check_answer(f"<answer>{n + 1}</answer>{noise}", str(n)) == 0.0


def test_task_from_config_kwargs() -> None:
    task = ArithmeticTask(max_value=9, ops=["+"])
    assert task.ops == ("+",) and task.space_size == 100
    with pytest.raises(ValueError):
        ArithmeticTask(ops=("/",))
    with pytest.raises(ValueError):
        ArithmeticTask(min_value=5, max_value=1)


@pytest.mark.parametrize(("a", "op", "b", "sloppy"), [
    (58, "+", 67, 115),   # carry forgotten (true 125)
    (41, "-", 38, 13),    # borrow forgotten (true 3)
    (38, "-", 41, 13),    # borrow and sign forgotten (true -3)
    (12, "-", 34, 22),    # sign forgotten (true -22)
    (99, "+", 99, 188),   # true 198
    (100, "-", 1, 109),   # three digits (true 99)
    (12, "+", 34, 46),    # nothing to forget: correct
    (5, "+", 7, 12),      # one digit: the leading digits are added as they are
    (7, "-", 7, 0),
])
def test_sloppy_result(a: int, op: str, b: int, sloppy: int) -> None:
    assert sloppy_result((a, b), (op,)) == sloppy


def test_sloppy_result_is_right_exactly_when_nothing_is_forgotten() -> None:
    for a in range(100):
        for b in range(100):
            carry = a % 10 + b % 10 >= 10
            assert (sloppy_result((a, b), ("+",)) == a + b) == (not carry or a < 10 and b < 10), (a, b)
            hi, lo = max(a, b), min(a, b)
            borrow = hi % 10 < lo % 10 and hi >= 10
            assert (sloppy_result((a, b), ("-",)) == a - b) == (a >= b and not borrow), (a, b)


@pytest.mark.parametrize(("operands", "ops"), [((2, 3), ("*",)), ((1, 2, 3), ("+", "+")), ((-1, 2), ("+",))])
def test_sloppy_result_refuses_what_it_does_not_define(operands, ops) -> None:
    with pytest.raises(ValueError, match="sloppy result is defined for a\\+b and a-b"):
        sloppy_result(operands, ops)
