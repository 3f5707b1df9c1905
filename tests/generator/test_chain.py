"""The chain task (generator/tasks/chain.py) and its rewards (generator/rewards/chain.py): hand-computed lines,
the split, and properties: never raises, a correct chain gets all 1s, one slip at line k gives 0 only at k."""

from __future__ import annotations

import hashlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import generator.rewards.chain  # noqa: F401 - registers chain / chain_steps
from generator.datasets import chain_examples
from generator.rewards import REWARDS
from generator.rewards.steps import StepScores
from generator.tasks.chain import (
    WORDS_TEMPLATE,
    ChainTask,
    final_line_correct,
    format_solution,
    line_checks,
    partial_results,
    solution_lines,
)
from shared.config.schema import DatasetConfig

EXAMPLE = {"answer": "74", "operands": [17, 25, 8, 40], "ops": ["+", "-", "+"]}


def steps_of(texts, **args) -> list[StepScores]:
    return REWARDS.get("chain_steps")(**args)("17+25-8+40=", texts, EXAMPLE)


# -- the task --------------------------------------------------------------------------------------------------
def test_problem_prompt_answer_and_target_by_hand() -> None:
    task = ChainTask(max_value=50)
    p = task.problem((17, 25, 8, 40), ("+", "-", "+"))
    assert (p.prompt, p.answer, task.target(p)) == ("17+25-8+40=", "74", "42\n34\n74")
    assert partial_results((3, 5), ("-",)) == [-2]
    assert format_solution([-2, 7]) == "-2\n7"
    worded = ChainTask(template=WORDS_TEMPLATE).problem((3, 5, 9), ("-", "+"))
    assert worded.prompt.startswith("Work out 3 - 5 + 9 from left to right.") and worded.answer == "7"


def test_split_is_a_salted_sha256_of_the_expression_shared_by_both_wordings() -> None:
    symbols, words = ChainTask(), ChainTask(template=WORDS_TEMPLATE)
    for operands, ops in [((1, 2, 3, 4), ("+", "+", "-")), ((9, 0, 9, 0), ("-", "-", "+"))]:
        expression = "".join(f"{v}{op}" for v, op in zip(operands, (*ops, ""))).rstrip()
        digest = hashlib.sha256(f"grpo-chain\x00{expression}".encode()).digest()
        expected = "test" if int.from_bytes(digest[:8], "big") / 2.0**64 < 0.1 else "train"
        assert symbols.split_of(symbols.problem(operands, ops)) == expected
        assert words.split_of(words.problem(operands, ops)) == expected
    drawn = symbols.sample(300, "test", random.Random(0))
    assert all(symbols.split_of(p) == "test" for p in drawn)
    share = sum(symbols.split_of(symbols.random_problem(random.Random(i))) == "test" for i in range(3000)) / 3000
    assert 0.07 < share < 0.13


def test_bad_settings_are_refused_with_the_setting_named() -> None:
    with pytest.raises(ValueError, match="ops must be"):
        ChainTask(ops=("*",))
    with pytest.raises(ValueError, match="min_value 5 > max_value 1"):
        ChainTask(min_value=5, max_value=1)
    with pytest.raises(ValueError, match="num_operands"):
        ChainTask(num_operands=1)
    with pytest.raises(ValueError, match="template must contain"):
        ChainTask(template="no placeholder")


def test_line_checks_by_hand() -> None:
    ops, operands = EXAMPLE["ops"], EXAMPLE["operands"]
    assert line_checks("42\n34\n74", operands, ops) == [True, True, True]
    # slip at line 1 (43), carried on correctly: 43-8 = 35, 35+40 = 75 -> only line 1 is wrong
    assert line_checks("43\n35\n75", operands, ops) == [False, True, True]
    assert line_checks("42\n30\n70", operands, ops) == [True, False, True]
    assert line_checks(" +42 \n034\n74\n", operands, ops) == [True, True, True]  # harmless spellings
    assert line_checks("42\nabc\n74", operands, ops) == [True, False, False]  # no value to continue from
    assert line_checks("42\n34\n74\n74", operands, ops) == [True, True, True, False]  # an extra line
    assert line_checks("42\n34", operands, ops) == [True, False]  # stopped before the answer
    assert line_checks("", operands, ops) == []
    assert line_checks("42.0\n34\n74", operands, ops) == [False, False, True]
    assert line_checks("9" * 40 + "\n34\n74", operands, ops) == [False, False, True]


def test_final_line_by_hand() -> None:
    assert final_line_correct("42\n34\n74", "74") and final_line_correct("74", "74")
    assert not final_line_correct("42\n34\n75", "74") and not final_line_correct("", "74")
    assert not final_line_correct("74\nfoo", "74")
    with pytest.raises(ValueError, match="not an integer"):
        final_line_correct("1", "seven")


def test_dataset_kind_chain_carries_what_the_rewards_need() -> None:
    cfg = DatasetConfig(kind="chain", chain={"max_value": 20, "num_operands": 3})
    examples = chain_examples(ChainTask(**cfg.chain.model_dump()), "train", 50, seed=1)
    assert len(examples) == 50
    for e in examples:
        totals = partial_results(e.data["operands"], e.data["ops"])
        assert len(e.data["operands"]) == 3 and e.data["answer"] == str(totals[-1])
        assert e.question == "".join(f"{v}{op}" for v, op in zip(e.data["operands"], [*e.data["ops"], "="]))
    with pytest.raises(ValueError, match="chain.ops"):
        DatasetConfig(kind="chain", chain={"ops": ["*"]})
    with pytest.raises(ValueError, match="chain.wrong"):
        DatasetConfig(kind="chain", chain={"wrong": 1})


# -- the rewards -----------------------------------------------------------------------------------------------
def test_outcome_reward_by_hand() -> None:
    chain = REWARDS.get("chain")()
    assert chain("p", ["42\n34\n74", "43\n35\n75", "74", "garbage"], EXAMPLE) == [1.0, 0.0, 1.0, 0.0]
    assert REWARDS.get("chain")(correct=2.0, wrong=-1.0)("p", ["74", "7"], EXAMPLE) == [2.0, -1.0]


def test_step_reward_by_hand() -> None:
    right, slip, empty = steps_of(["42\n34\n74", "43\n35\n75", ""])
    assert right == StepScores(rewards=(1.0, 1.0, 1.0), separator="\n", outcome=1.0)
    assert slip == StepScores(rewards=(0.0, 1.0, 1.0), separator="\n", outcome=0.0)
    assert empty.rewards == () and empty.outcome == 0.0
    assert slip.char_ends("43\n35\n75") == [2, 5, 8]  # each step ends after its line's last character
    valued = steps_of(["42\n30\n70"], correct=1.0, wrong=-0.5)[0]
    assert valued.rewards == (1.0, -0.5, 1.0)


def test_step_reward_on_a_malformed_example_raises_for_the_reward_set_to_contain() -> None:
    with pytest.raises(ValueError, match="operands"):
        REWARDS.get("chain_steps")()("p", ["1"], {"answer": "1"})


TEXT = st.text(alphabet=st.sampled_from(list("0123456789-+ \n.xa")), max_size=30) | st.text(max_size=30)


@settings(max_examples=300, deadline=None)
@given(TEXT)
def test_never_raises_and_steps_match_the_separator_split(text: str) -> None:
    scores = steps_of([text])[0]
    assert len(scores.char_ends(text)) == len(scores.rewards) == len(solution_lines(text))
    assert set(scores.rewards) <= {0.0, 1.0}
    assert REWARDS.get("chain")()("p", [text], EXAMPLE)[0] in (0.0, 1.0)


PROBLEMS = st.tuples(st.lists(st.integers(0, 99), min_size=2, max_size=6), st.randoms(use_true_random=False))


def draw_problem(values, rnd):
    ops = tuple(rnd.choice("+-") for _ in values[1:])
    return ChainTask(max_value=99).problem(tuple(values), ops)


@settings(max_examples=200, deadline=None)
@given(PROBLEMS)
def test_a_correct_chain_gets_all_ones(drawn) -> None:
    p = draw_problem(*drawn)
    example = {"answer": p.answer, "operands": list(p.operands), "ops": list(p.ops)}
    scores = REWARDS.get("chain_steps")()("", [ChainTask(max_value=99).target(p)], example)[0]
    assert scores.rewards == (1.0,) * len(p.ops) and scores.outcome == 1.0


@settings(max_examples=300, deadline=None)
@given(PROBLEMS, st.integers(0, 10), st.integers(1, 50))
def test_one_slip_at_line_k_gives_zero_only_at_k(drawn, k, delta) -> None:
    p = draw_problem(*drawn)
    k %= len(p.ops)
    totals = partial_results(p.operands, p.ops)
    # the model slips by delta at line k and then works on correctly from its own wrong value
    slipped = totals[:k] + [totals[k] + delta] + [v + delta for v in totals[k + 1:]]
    example = {"answer": p.answer, "operands": list(p.operands), "ops": list(p.ops)}
    scores = REWARDS.get("chain_steps")()("", [format_solution(slipped)], example)[0]
    assert scores.rewards == tuple(0.0 if j == k else 1.0 for j in range(len(p.ops)))
    assert scores.outcome == 0.0


@pytest.mark.slow
def test_the_worded_chain_through_smollm2s_chat_template(smollm2_dir) -> None:
    """The chat-model path: deploy/configs/smollm2-chain-cpu.yaml's prompts are rendered by SmolLM2's chat template
    as a user turn, and each line of a solution ends inside one of SmolLM2's tokens (the step's end token)."""
    from transformers import AutoTokenizer

    from generator.datasets import load_examples, render_prompt, system_prompt_for
    from shared.config.loader import load_config

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    dataset = load_config("deploy/configs/smollm2-chain-cpu.yaml").generator.dataset
    example = load_examples(dataset, seed=0)[0]
    text = render_prompt(tokenizer, example.question, system_prompt_for(dataset), dataset.template)
    operands, ops = example.data["operands"], example.data["ops"]
    expression = " ".join([str(operands[0])] + [f"{op} {v}" for op, v in zip(ops, operands[1:])])
    assert f"<|im_start|>user\nWork out {expression} from left to right." in text
    assert text.endswith("<|im_start|>assistant\n")
    solution = format_solution(partial_results(operands, ops))
    scores = REWARDS.get("chain_steps")()("", [solution], example.data)[0]
    assert scores.rewards == (1.0,) * len(ops)
    offsets = tokenizer(solution, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
    for end in scores.char_ends(solution):
        assert any(start < end <= stop for start, stop in offsets), (solution, end, offsets)
