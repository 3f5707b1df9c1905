"""The arithmetic_words task and its final_number reward (for chat models that answer in prose)."""

import random
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deploy.cli import SHIPPED_CONFIGS
from generator.datasets import arithmetic_words_examples, load_examples, system_prompt_for
from generator.rewards import RewardSet
from generator.tasks.arithmetic_words import (
    WordsArithmeticTask,
    final_number_correct,
    stated_answer,
    words_prompt,
)
from shared.config.loader import load_config

CPU_CONFIG = SHIPPED_CONFIGS / "smollm2-arithmetic-cpu.yaml"


@pytest.mark.parametrize("text, answer, operands, correct", [
    # the stated answer, not the first number: working before it is fine
    ("2+3=5, so the answer is 7", "7", (3, 4), True),
    ("2+3=5, so the answer is 7", "5", (2, 3), False),
    ("81", "81", (23, 58), True),
    ("23 + 58 = 81", "81", (23, 58), True),
    ("The sum of 23 and 58 is 81.", "81", (23, 58), True),
    ("The answer is 81.", "81", (23, 58), True),
    ("The answer is: **81**", "81", (23, 58), True),
    ("Answer: 81", "81", (23, 58), True),
    ("\\boxed{81}", "81", (23, 58), True),
    ("-5", "-5", (2, 7), True),
    ("0081", "81", (23, 58), True),
    # listing candidates is never credited, with or without a marker
    ("79 80 81", "81", (23, 58), False),
    ("79, 80, 81, 82, 83", "81", (23, 58), False),
    ("1 2 3 4 5 6 7 answer: 81", "81", (23, 58), False),
    ("The answer is 81, or 82", "81", (23, 58), False),
    ("81\n82", "81", (23, 58), False),
    # two answers that disagree: the last one counts
    ("answer: 81\n\nanswer: 80", "81", (23, 58), False),
    ("\\boxed{80} no wait, the answer is 81", "81", (23, 58), True),
    # not an integer, no number, a boxed expression
    ("81.0", "81", (23, 58), False),
    ("The sum is 81.5", "81", (23, 58), False),
    ("eighty-one", "81", (23, 58), False),
    ("", "81", (23, 58), False),
    ("\\boxed{23+58}", "81", (23, 58), False),
    ("23 + 58 = 81 (checked with 80 + 1 = 81)", "81", (23, 58), False),
])
def test_final_number_reads_the_stated_answer(text, answer, operands, correct):
    assert final_number_correct(text, answer, operands) is correct


def test_stated_answer_is_the_marked_one_else_the_last_number():
    assert stated_answer("2+3=5, so the answer is 7").value == "7"
    assert stated_answer("2+3=5, so the answer is 7").marked
    assert stated_answer("23 + 58 = 81").value == "81" and not stated_answer("23 + 58 = 81").marked
    assert stated_answer("the answer is 12 and then 3 more").value == "12"
    assert stated_answer("no digits here") is None and stated_answer(None) is None


def test_working_numbers_are_capped():
    text = "10 + 20 = 30, 30 + 40 = 70, 70 + 11 = 81, so the answer is 81"
    assert final_number_correct(text, "81", (23, 58), max_other_numbers=7)
    assert not final_number_correct(text, "81", (23, 58), max_other_numbers=3)
    with pytest.raises(ValueError, match="not an integer"):
        final_number_correct("81", "eighty-one")


@given(st.text(max_size=200))
def test_final_number_never_raises_on_model_output(text):
    assert final_number_correct(text, "81", (23, 58)) in (True, False)


@given(st.integers(-10**6, 10**6), st.integers(-10**6, 10**6))
def test_the_right_number_alone_is_always_correct_and_a_wrong_one_never(value, other):
    assert final_number_correct(str(value), str(value))
    assert final_number_correct(f"The answer is {value}.", str(value))
    assert final_number_correct(str(other), str(value)) is (other == value)


def test_prompts_in_words_and_answers():
    assert words_prompt((23, 58), ("+",)) == "What is 23 plus 58? Reply with only the number."
    task = WordsArithmeticTask(min_value=0, max_value=99, ops=("+", "-"))
    for problem in task.sample(300, "train", random.Random(0)):
        a, b = problem.operands
        match = re.fullmatch(r"What is (\d+) (plus|minus) (\d+)\? Reply with only the number\.", problem.prompt)
        assert match and (int(match[1]), int(match[3])) == (a, b)
        assert int(problem.answer) == (a + b if match[2] == "plus" else a - b)
    with pytest.raises(ValueError, match="expression"):
        WordsArithmeticTask(template="What is it?")
    with pytest.raises(ValueError, match="ops"):
        WordsArithmeticTask(ops=("/",))


def test_held_out_split_is_disjoint_and_near_its_fraction():
    task = WordsArithmeticTask(max_value=99, heldout_fraction=0.1)
    problems = [task.problem((a, b), ("+",)) for a in range(100) for b in range(100)]
    test = {p.prompt for p in problems if task.split_of(p) == "test"}
    assert 850 <= len(test) <= 1150
    train = task.sample(2000, "train", random.Random(1))
    held = task.sample(500, "test", random.Random(2))
    assert not {p.prompt for p in train} & test and {p.prompt for p in held} <= test
    # a pure function of the expression and the salt: the same problems in another process, another order
    assert {p.prompt for p in held} == {p.prompt for p in task.sample(500, "test", random.Random(2))}
    assert WordsArithmeticTask(split_salt="other").split_of(problems[0]) in ("train", "test")


def test_examples_carry_answer_and_operands_and_the_config_kind_loads_them():
    examples = arithmetic_words_examples(WordsArithmeticTask(), "test", 20, seed=3)
    assert all(e.data["answer"] == str(sum(e.data["operands"])) for e in examples)
    config = load_config(CPU_CONFIG)
    loaded = load_examples(config.generator.dataset, seed=0)
    assert len(loaded) == config.generator.dataset.arithmetic_pool
    assert all(e.question.startswith("What is ") and " plus " in e.question for e in loaded[:50])
    assert system_prompt_for(config.generator.dataset) is None  # the chat template's own system prompt


def test_shipped_rewards_score_answer_and_format():
    """The CPU config's rewards: 1 for the stated answer, +0.2 for one line that ends with it."""
    config = load_config(CPU_CONFIG)
    rewards = RewardSet.from_specs(config.generator.rewards)
    example = {"answer": "81", "operands": [23, 58]}
    completions = ["23 + 58 = 81", "81", "The answer is 81.", "2+3=5, so the answer is 81", "23 + 58 = 80",
                   "81\n\nIs there anything else?", "79 80 81", "Sure! Let me think."]
    scores = rewards.score_group("What is 23 plus 58?", completions, example)
    assert scores.components["final_number"] == [1, 1, 1, 1, 0, 1, 0, 0]
    assert scores.components["one_line"] == [1, 1, 1, 1, 1, 0, 1, 0]
    assert scores.total == pytest.approx([1.2, 1.2, 1.2, 1.2, 0.2, 1.0, 0.2, 0.0])

