"""RolloutGroup.from_samples: per-sample lists into the group's right-padded tensors."""

import pytest
import torch

from shared.protocol.errors import ProtocolError
from shared.protocol.records import RolloutGroup, SamplingParams


def samples(**changes):
    fields = dict(
        prompt_ids=[7, 8, 9], completion_ids=[[11, 12], [13], [14, 15, 16]],
        behaviour_logprobs=[[-0.5, -0.25], [-1.0], [-0.125, -2.0, -3.5]], rewards=[1.0, 0.0, 0.5],
        finish_reasons=["stop", "length", "stop"], policy_version=4, generator_id="gen-0",
        sampling=SamplingParams(temperature=0.7, max_tokens=3), reward_components={"correct": [1, 0, 1]},
        task={"answer": "82"}, group_id="g-1")
    return {**fields, **changes}


def test_values_land_in_the_right_tensors_right_padded_with_zeros():
    group = RolloutGroup.from_samples(**samples()).validate(vocab_size=32)
    assert group.prompt_ids.tolist() == [7, 8, 9] and group.prompt_ids.dtype == torch.int64
    assert group.completion_ids.tolist() == [[11, 12, 0], [13, 0, 0], [14, 15, 16]]
    assert group.completion_ids.dtype == torch.int64
    assert group.completion_lengths.tolist() == [2, 1, 3] and group.completion_lengths.dtype == torch.int64
    assert group.behaviour_logprobs.tolist() == [[-0.5, -0.25, 0.0], [-1.0, 0.0, 0.0], [-0.125, -2.0, -3.5]]
    assert group.behaviour_logprobs.dtype == torch.float32
    assert group.rewards.tolist() == [1.0, 0.0, 0.5] and group.rewards.dtype == torch.float32
    assert group.reward_components["correct"].tolist() == [1.0, 0.0, 1.0]
    assert group.reward_components["correct"].dtype == torch.float32
    assert group.finish_reasons == ["stop", "length", "stop"] and group.policy_version == 4
    assert (group.generator_id, group.group_id, group.task) == ("gen-0", "g-1", {"answer": "82"})
    assert group.sampling == SamplingParams(temperature=0.7, max_tokens=3) and group.group_size == 3
    assert RolloutGroup.from_bytes(group.to_bytes()).completion_ids.tolist() == group.completion_ids.tolist()


def test_empty_completions_are_one_column_wide_and_defaults_fill_the_rest():
    group = RolloutGroup.from_samples(**samples(completion_ids=[[], []], behaviour_logprobs=[[], []],
                                                rewards=[0.0, 0.0], finish_reasons=["stop", "stop"],
                                                reward_components=None, task=None, group_id=None,
                                                sampling=None)).validate()
    assert group.completion_ids.shape == (2, 1) and group.completion_lengths.tolist() == [0, 0]
    assert group.sampling == SamplingParams() and group.reward_components == {} and group.task == {}
    assert len(group.group_id) == 32 and group.group_id != RolloutGroup.from_samples(**samples(group_id=None)).group_id


def test_a_logprob_row_of_another_length_is_refused():
    with pytest.raises(ProtocolError, match="completion 1: 2 behaviour logprobs for 1 tokens"):
        RolloutGroup.from_samples(**samples(behaviour_logprobs=[[-0.5, -0.25], [-1.0, -1.0], [-0.1, -0.2, -0.3]]))
    with pytest.raises(ProtocolError, match="2 behaviour logprob rows for 3 completions"):
        RolloutGroup.from_samples(**samples(behaviour_logprobs=[[-0.5, -0.25], [-1.0]]))


@pytest.mark.parametrize(("changes", "message"), [
    (dict(rewards=[1.0, 0.0]), r"rewards must be \[3\]"),
    (dict(finish_reasons=["stop", "eos", "stop"]), "finish_reasons"),
    (dict(prompt_ids=[]), "prompt_ids must be a non-empty"),
    (dict(completion_ids=[], behaviour_logprobs=[], rewards=[], finish_reasons=[]), "at least one completion"),
    (dict(behaviour_logprobs=[[-0.5, float("nan")], [-1.0], [-0.1, -0.2, -0.3]]),
     r"behaviour_logprobs\[0, 1\] = nan is not a finite float32"),
    (dict(reward_components={"correct": [1.0]}), r"reward component 'correct' must be \[3\]"),
    (dict(generator_id="../x"), "generator_id"),
    (dict(policy_version=-1), "policy_version"),
])
def test_bad_input_is_refused_by_validate_as_for_any_group(changes, message):
    with pytest.raises(ProtocolError, match=message):
        RolloutGroup.from_samples(**samples(**changes)).validate()
