"""Your own reward: named as path/to/file.py:fn or module:fn, its signature checked against the documented contract
when it is built, and a reward that fails on a whole first batch stopping the generator with its error and line
(the rule for later windows and environments: tests/generator/test_failures.py)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from generator.datasets import Example, PromptStream
from generator.engines.hf import TransformersEngine
from generator.failures import FailureRateExceeded, FailureRule
from generator.loop import RolloutLoop
from generator.rewards import RewardConfigError, RewardSet
from shared.config.schema import RewardSpec
from shared.protocol.client import HubClient
from shared.protocol.numbers import finite_float32
from shared.protocol.records import SamplingParams
from tests import service_forks as forks


def python_spec(function: str, **args) -> RewardSpec:
    return RewardSpec(name="python", args={"function": function, **args})


def test_a_reward_file_relative_to_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "mine.py").write_text(
        "def exact(prompt, completion, example, bonus=0.0):\n"
        "    return float(completion.strip() == example['answer']) + bonus\n"
        "def lengths(prompt, completions, example):\n"
        "    return [len(c) for c in completions]\n")
    rewards = RewardSet.from_specs([python_spec("rewards/mine.py:exact", bonus=0.25),
                                    RewardSpec(name="python", label="len",
                                               args={"function": "rewards/mine.py:lengths", "per_group": True})])
    scores = rewards.score_group("2+3=", ["5", " 4", "five"], {"answer": "5"})
    assert scores.components == {"python": [1.25, 0.25, 0.25], "len": [1.0, 2.0, 4.0]}
    assert scores.errors == {}


@pytest.mark.parametrize("source, per_group, fragment", [
    ("def f(text):\n    return 1.0\n", False, "missing a required argument: 'text'"),
    ("def f(prompt, completion):\n    return 1.0\n", False, "got an unexpected keyword argument 'example'"),
    ("def f(prompt, completion, example):\n    return 1.0\n", True, "missing a required argument: 'completion'"),
    ("def f(prompt, completion, example, scale):\n    return 1.0\n", False, "missing a required argument: 'scale'"),
    ("f = 3\n", False, "is not callable"),
])
def test_a_wrong_signature_stops_at_build_time_showing_the_contract(tmp_path, source, per_group, fragment):
    (tmp_path / "r.py").write_text(source)
    with pytest.raises(RewardConfigError) as info:
        RewardSet.from_specs([RewardSpec(name="format"),
                              python_spec(f"{tmp_path}/r.py:f", per_group=per_group)])
    message = str(info.value)
    assert message.startswith(f"generator.rewards[1] (python): function '{tmp_path}/r.py:f': ")
    assert fragment in message and "\n" not in message
    contract = ("fn(prompt: str, completions: list[str], example: dict, **args) -> list[float]" if per_group
                else "fn(prompt: str, completion: str, example: dict, **args) -> float")
    assert contract in message


def test_config_args_reach_the_function_and_are_part_of_its_signature(tmp_path):
    (tmp_path / "r.py").write_text("def f(prompt, completion, example, scale=1.0, **rest):\n"
                                   "    return scale * len(completion) + len(rest)\n")
    rewards = RewardSet.from_specs([python_spec(f"{tmp_path}/r.py:f", scale=2.0, extra="x")])
    assert rewards.score_group("p", ["abc"], {}).components["python"] == [7.0]


def raises_always(prompt, completion, example):
    return example["no_such_field"]   # the line a stopped run names


RAISES_AT = f"{__file__}:{raises_always.__code__.co_firstlineno + 1} in raises_always"


def scored(rewards: RewardSet, *groups: list[str], rule: FailureRule | None = None) -> FailureRule:
    """The rule on failing rewards after ``rewards`` scored ``groups`` (as the rollout loop records them)."""
    rule = rule or FailureRule(window=64, max_rate=0.5)
    for group in groups:
        scores = rewards.score_group("p", group, {"answer": "1"})
        for term in rewards.terms:
            rule.record(f"reward {term.name!r}", scores.failures[term.name])
    return rule


def fails_sometimes(prompt, completion, example):
    return 1.0 / len(completion)   # ZeroDivisionError on an empty completion


def test_a_reward_that_never_scored_stops_with_its_first_error_and_line():
    rewards = RewardSet.from_specs([RewardSpec(name="format"), python_spec(
        "tests.generator.test_python_reward:raises_always")])
    scored(rewards).check()   # nothing scored yet: nothing to say
    rule = scored(rewards, ["a", "b"], ["c"])
    with pytest.raises(FailureRateExceeded) as info:
        rule.check()
    assert str(info.value) == (
        "reward 'python' failed on all 3 completions it was given so far: the rule is to stop at 50% of a window "
        "of 64 (generator.failures.max_rate and .window), since training would learn from on_error scores alone; "
        f"the first failure in the window: KeyError: 'no_such_field' (at {RAISES_AT})")
    assert info.value.exit_code == 2


def test_a_reward_that_failed_only_sometimes_or_returned_garbage():
    sometimes = RewardSet.from_specs([python_spec("tests.generator.test_python_reward:fails_sometimes")])
    scores = sometimes.score_group("p", ["", "ab"], {})
    assert scores.components["python"] == [0.0, 0.5] and scores.errors == {"python": 1}
    scored(sometimes, ["", "ab"]).check()   # it scored one, and the window is not full: the run goes on
    nan = RewardSet.from_specs([python_spec("tests.generator.test_python_reward:all_nan", per_group=True)])
    with pytest.raises(FailureRateExceeded, match=r"failed on all 2 completions .* returned nan, not finite"):
        scored(nan, ["x", "y"]).check()


def all_nan(prompt, completions, example):
    return [math.nan] * len(completions)


@settings(max_examples=40, deadline=None)
@given(outcomes=st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.none()), min_size=1,
                         max_size=12))
def test_never_scored_is_exactly_every_value_unusable(outcomes):
    """Property: before a window is full, the run stops iff no completion got a usable value (a float finite in
    float32)."""
    values = iter(outcomes)
    rewards = RewardSet.from_specs([python_spec("tests.generator.test_python_reward:from_list")])
    scores = rewards.score_group("p", ["c"] * len(outcomes), {"values": values})
    rule = FailureRule(window=64, max_rate=0.5)
    rule.record("reward 'python'", scores.failures["python"])
    usable = [v for v in outcomes if v is not None and finite_float32(v)]
    if usable:
        rule.check()
    else:
        with pytest.raises(FailureRateExceeded):
            rule.check()


def from_list(prompt, completion, example):
    value = next(example["values"])
    if value is None:
        raise ValueError("no value")
    return value


@pytest.mark.slow   # loads the tiny model into an engine and samples (a few seconds on a loaded machine)
def test_the_generator_stops_after_a_first_batch_its_reward_never_scored(tiny_model_dir, tmp_path):
    """The real loop with the tiny model: the first engine call's groups are scored, then the run stops with the
    reward's error instead of uploading groups of on_error scores (nothing reaches the hub: none is running)."""
    engine = TransformersEngine(tiny_model_dir)
    rewards = RewardSet.from_specs([python_spec("tests.generator.test_python_reward:raises_always")])
    loop = RolloutLoop(engine=engine, tokenizer=engine.tokenizer, client=HubClient("http://127.0.0.1:9"),
                       rewards=rewards, prompts=PromptStream([Example("1+2=", {"answer": "3"}, "a")], seed=0,
                                                             generator_id="g"),
                       sampling=SamplingParams(temperature=1.0, max_tokens=4), group_size=3, prompts_per_batch=2,
                       generator_id="g", weights_dir=tmp_path / "w")
    with pytest.raises(FailureRateExceeded, match="failed on all 6 completions it was given so far.*KeyError"):
        loop.step()
    assert loop.stats.prompts == 2 and loop.stats.reward_errors == 6


@pytest.mark.slow
def test_grpo_generator_exits_2_with_the_rewards_error_and_uploads_nothing(tmp_path, tiny_model_dir):
    """`grpo generator` against a live hub with a reward that raises on every completion: one clear line, exit
    status 2, and not one group of on_error scores reaches the hub."""

    from tests.generator.test_cli import ENV, GRPO, write_config
    from tests.live_server import LiveServer, make_config

    (tmp_path / "broken.py").write_text("def score(prompt, completion, example):\n    return example['label']\n")
    with LiveServer(make_config(tmp_path)) as live:
        config = write_config(tmp_path, live.url, tiny_model_dir,
                              rewards=f"[{{name: python, args: {{function: {tmp_path}/broken.py:score}}}}]")
        result = forks.run([GRPO, "generator", "--config", str(config)], capture_output=True, text=True,
                                timeout=300, env=ENV)
        accepted = live.state.hub.counters.accepted
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "grpo generator: error: reward 'python' failed on all 6 completions it was given so far: the rule is to stop "
        "at 50% of a window of 64 (generator.failures.max_rate and .window), since training would learn from "
        f"on_error scores alone; the first failure in the window: KeyError: 'label' (at {tmp_path}/broken.py:2 in "
        "score)")
    assert "Traceback (most recent call last)" in result.stderr   # logged with the error, the user's line in it
    assert accepted == 0
