"""A reward value finite in float64 but not in float32 (1e39; 3e38 weighted by 2; two terms of 3e38 summed) is
contained like a NaN: scored ``on_error``, counted, its steps dropped, so that the group still uploads (before, the
group's float32 rewards held inf and the hub refused the whole upload)."""

import math

import pytest

from generator.rewards import RewardSet
from generator.rewards.steps import StepScores
from ref_server.hub.rollout_hub import RolloutHub
from shared.config.schema import RewardSpec
from shared.protocol.records import RolloutGroup

HUGE = {"a": 1e39, "b": -3.5e38, "c": 3e38, "d": 1.0}


def huge(prompt, completion, example):
    return HUGE[completion]


def huge_steps(prompt, completion, example):
    return StepScores(rewards=(1.0, HUGE[completion[0]]), ends=(1, 2), outcome=0.5)


def group_of(scores, texts):
    return RolloutGroup.from_samples(
        prompt_ids=[1, 2], completion_ids=[[5, 6]] * len(texts), behaviour_logprobs=[[-0.5, -0.25]] * len(texts),
        rewards=scores.total, finish_reasons=["stop"] * len(texts), policy_version=0, generator_id="gen",
        reward_components=scores.components,
        steps=None if scores.steps is None else [[(e - 1, r) for e, r in s or []] for s in scores.steps])


def spec(function, weight=1.0, on_error=-1.0, label=None):
    return RewardSpec(name="python", weight=weight, on_error=on_error, label=label,
                      args={"function": f"tests.generator.test_reward_overflow:{function}"})


def test_a_value_inf_in_float32_is_scored_on_error_and_the_group_uploads():
    rewards = RewardSet.from_specs([spec("huge", weight=1.0, on_error=-1.0)])
    texts = ["a", "b", "c", "d"]
    scores = rewards.score_group("p", texts, {})
    # 1e39 and -3.5e38 overflow float32; 3e38 and 1 fit
    assert scores.components["python"] == [-1.0, -1.0, 3e38, 1.0]
    assert scores.total == [-1.0, -1.0, 3e38, 1.0] and scores.errors == {"python": 2}
    hub = RolloutHub(capacity=4, max_staleness=1, scorer=None)
    assert hub.put(group_of(scores, texts).to_bytes())["accepted"] is True


def test_a_weighted_value_or_a_sum_that_overflows_float32_is_contained():
    weighted = RewardSet.from_specs([spec("huge", weight=2.0, on_error=0.0)])
    scores = weighted.score_group("p", ["c", "d"], {})
    assert scores.total == [0.0, 2.0] and scores.errors == {"python": 1}   # 2 * 3e38 is inf in float32
    summed = RewardSet.from_specs([spec("huge", on_error=0.25), spec("huge", on_error=0.5, label="again")])
    scores = summed.score_group("p", ["c", "d"], {})
    assert scores.total == [0.75, 2.0]                                        # 3e38 + 3e38: each term's on_error
    assert scores.errors == {"total": 1} and math.isfinite(scores.total[0])
    RolloutGroup.from_samples(prompt_ids=[1], completion_ids=[[5], [6]], behaviour_logprobs=[[-1.0], [-1.0]],
                              rewards=scores.total, finish_reasons=["stop", "stop"], policy_version=0,
                              generator_id="gen", reward_components=scores.components).validate()


@pytest.mark.parametrize("weight", [1.0, 2.0])
def test_a_step_reward_inf_in_float32_drops_that_completions_steps_and_the_group_uploads(weight):
    rewards = RewardSet.from_specs([spec("huge_steps", weight=weight, on_error=-1.0)])
    scores = rewards.score_group("p", ["ab", "db"], {})  # step rewards (1, 1e39) and (1, 1)
    assert scores.steps[0] is None and scores.steps[1] == [(1, weight), (2, weight)]
    assert scores.step_errors == 1 and scores.errors == {"python": 1}
    assert scores.total == [-weight, 0.5 * weight]
    hub = RolloutHub(capacity=4, max_staleness=1, scorer=None)
    assert hub.put(group_of(scores, ["ab", "db"]).to_bytes())["accepted"] is True
