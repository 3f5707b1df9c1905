"""The reward functions TRL ships (``trl.rewards``) through ``reward: python`` with ``function: trl.rewards:NAME``,
scoring the values TRL's own tests give (huggingface/trl tests/test_rewards.py, trl 1.16.0: the same inputs and
expected values, regrouped: here a group shares its example, so TRL's rows with different solutions are separate
groups). TRL's rewards read ``completion[0]["content"]``: the conversational form, which a conversational example
(``prompt_messages``) or ``conversational: true`` gives."""

from __future__ import annotations

import threading

import pytest

from generator.rewards import RewardSet
from shared.config.schema import RewardSpec

pytest.importorskip("trl")
pytest.importorskip("math_verify")

CHAT = {"prompt_messages": [{"role": "user", "content": "Solve it."}]}


def trl_reward(name: str, **args) -> RewardSet:
    return RewardSet.from_specs([RewardSpec(name="python", label="r", args={"function": f"trl.rewards:{name}",
                                                                             **args})])


VALID = ["<think>This is my reasoning.</think>This is my answer.",
         "<think>\nThis is my reasoning.\n</think>\nThis is my answer.",
         "<think>\nThis is\nmy reasoning.\n</think>\nThis is my answer.",
         "<think>\nThis is <some tag> my reasoning.</think>\nThis is my answer.",
         "<think></think>\nThis is my answer."]
INVALID = ["<think>\nThis is my reasoning.\nThis is my answer.",
           "<think>This is my reasoning.\nThis is my answer.",
           "This is my reasoning. This is my answer.",
           "This is my reasoning.\nThis is my answer.",
           "This is my reasoning.</think>\nThis is my answer.",
           "This is my reasoning.</think>This is my answer.",
           "This<think>is my reasoning.</think>\nThis is my answer.",
           "<think>This is<think>my reasoning.</think></think>This is my answer.",
           "<think>This is</think>\nmy\n<think>reasoning.</think>\nThis is my answer."]


def test_think_format_reward_on_a_conversational_example_and_forced_on_a_plain_one():
    rewards = trl_reward("think_format_reward")
    assert rewards.score_group("q", VALID + INVALID, CHAT).components["r"] == [1.0] * 5 + [0.0] * 9
    forced = trl_reward("think_format_reward", conversational=True)
    scores = forced.score_group("q", VALID[:2] + INVALID[2:4], {})
    assert scores.components["r"] == [1.0, 1.0, 0.0, 0.0] and scores.errors == {}
    plain = trl_reward("think_format_reward").score_group("q", VALID[:2], {})   # as in TRL: strings do not index
    assert plain.errors == {"r": 2} and plain.failures["r"][0].what.startswith("TypeError: string indices")


@pytest.mark.parametrize("solution, completions, expected", [
    (r"\frac{63}{400}", [r"\boxed{\frac{63}{400}}", r"\boxed{\frac{64}{400}}"], [1.0, 0.0]),
    ("63/400", [r"\boxed{\frac{63}{400}}"], [1.0]),
    ("6", [r"\boxed{3}"], [0.0]),
])
def test_accuracy_reward(solution, completions, expected):
    scores = trl_reward("accuracy_reward").score_group("q", completions, {**CHAT, "solution": solution})
    assert scores.components["r"] == expected and scores.errors == {} and scores.not_applicable == {}


def test_accuracy_reward_unparsable_gold_is_not_applicable_and_no_failure():
    completions = ["Answer is forty two.", r"Some other content. \boxed{43}."]
    scores = trl_reward("accuracy_reward").score_group("q", completions, {**CHAT, "solution": "Answer is forty two."})
    assert scores.not_applicable == {"r": [True, True]} and scores.errors == {} and scores.total == [0.0, 0.0]


def test_accuracy_reward_from_a_worker_thread():
    rewards, out = trl_reward("accuracy_reward"), []
    thread = threading.Thread(target=lambda: out.append(rewards.score_group(
        "q", [r"\boxed{\frac{1}{3}}"], {**CHAT, "solution": r"\frac{1}{3}"})))
    thread.start()
    thread.join()
    assert out[0].components["r"] == [1.0]


def test_reasoning_accuracy_reward():
    rewards = trl_reward("reasoning_accuracy_reward")
    completions = [r"<think> Reasoning content </think> \boxed{\frac{63}{400}}",
                   r"Reasoning content </think> \boxed{\frac{63}{400}}",
                   r"<think> Reasoning content </think> \boxed{\frac{64}{400}}",
                   r"<think> Incomplete reasoning without closing tag"]
    scores = rewards.score_group("q", completions, {**CHAT, "solution": r"\frac{63}{400}"})
    assert scores.components["r"] == [1.0, 1.0, 0.0, 0.0]
    custom = trl_reward("reasoning_accuracy_reward", reasoning_delimiters=["</REASONING_END>"])
    text = r"<REASONING_START> Reasoning content </REASONING_END> \boxed{\frac{63}{400}}"
    assert custom.score_group("q", [text], {**CHAT, "solution": r"\frac{63}{400}"}).components["r"] == [1.0]


def test_soft_overlong_punishment_through_its_factory():
    """A factory (``get_soft_overlong_punishment(max_completion_len, soft_punish_cache)``): ``factory_args`` are its
    arguments, the function it returns is the reward; it reads ``completion_ids``."""
    rewards = trl_reward("get_soft_overlong_punishment",
                         factory_args={"max_completion_len": 100, "soft_punish_cache": 20})
    scores = rewards.score_group("q", ["a", "b", "c"], {}, [[1] * 50, [1] * 110, [1] * 90])
    assert scores.components["r"] == [0.0, -1.0, pytest.approx(-0.5, abs=1e-4)]


def test_cosine_scaled_reward_through_its_factory():
    rewards = trl_reward("get_cosine_scaled_reward", factory_args={"max_len": 100})
    right = rewards.score_group("q", [r"\boxed{\frac{1}{3}}"] * 2, {**CHAT, "solution": r"\frac{1}{3}"},
                                [[1] * 25, [1] * 75])
    assert right.components["r"] == [pytest.approx(0.92678, abs=1e-4), pytest.approx(0.57322, abs=1e-4)]
    wrong = rewards.score_group("q", [r"\boxed{\frac{1}{2}}"] * 2, {**CHAT, "solution": r"\frac{1}{3}"},
                                [[1] * 25, [1] * 75])
    assert wrong.components["r"] == [pytest.approx(-0.92678, abs=1e-4), pytest.approx(-0.57322, abs=1e-4)]


def test_a_factory_given_wrong_arguments_stops_at_build_time():
    from generator.rewards import RewardConfigError

    with pytest.raises(RewardConfigError, match=r"^generator.rewards\[0\] \(python\): function "
                                                r"'trl.rewards:get_soft_overlong_punishment' \(factory_args\): "
                                                r"unknown argument 'max_len'"):
        trl_reward("get_soft_overlong_punishment", factory_args={"max_len": 100, "soft_punish_cache": 20})
