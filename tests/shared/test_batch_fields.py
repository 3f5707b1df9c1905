"""TrainBatch.fields_of_groups: the per-row and per-group fields that TrainBatch.from_groups and the hub's batch
assembly (ref_server/hub/batching.py) share, checked value by value."""

import math

import pytest
import torch

from ref_server.hub.batching import GroupRows, assemble_batch
from shared.protocol.errors import ProtocolError
from shared.protocol.records import RolloutGroup, SamplingParams, TrainBatch


def group(prompt, lengths, rewards, reasons, version, gid, temperature=1.0, components=None) -> RolloutGroup:
    return RolloutGroup.from_samples(
        prompt_ids=prompt, completion_ids=[[5] * n for n in lengths], behaviour_logprobs=[[-1.0] * n for n in lengths],
        rewards=rewards, finish_reasons=reasons, policy_version=version, generator_id=f"gen-{gid}",
        sampling=SamplingParams(temperature=temperature, max_tokens=max(lengths)), reward_components=components,
        group_id=gid).validate()


def two_groups(second_temperature=0.7):
    return [group((1, 2, 3), (2, 1), [1.0, 0.0], ["stop", "length"], 4, "a", 0.7,
                  {"correct": torch.tensor([1.0, 0.0])}),
            group((9,), (3, 3, 1), [0.5, 0.25, 0.0], ["length", "stop", "stop"], 6, "b", second_temperature,
                  {"format": torch.tensor([0.1, 0.2, 0.3])})]


def test_fields_of_groups_values():
    fields = TrainBatch.fields_of_groups(two_groups())
    assert fields["prompt_lengths"].tolist() == [3, 3, 1, 1, 1]
    assert fields["completion_lengths"].tolist() == [2, 1, 3, 3, 1]
    assert fields["completion_lengths"].dtype == torch.int64 and fields["rewards"].dtype == torch.float32
    assert fields["rewards"].tolist() == [1.0, 0.0, 0.5, 0.25, 0.0]
    assert fields["group_index"].tolist() == [0, 0, 1, 1, 1]
    assert fields["policy_versions"].tolist() == [4, 4, 6, 6, 6]
    assert fields["truncated"].tolist() == [False, True, True, False, False]
    # a component missing from a group is NaN in its rows, never 0
    assert sorted(fields["reward_components"]) == ["correct", "format"]
    correct, fmt = fields["reward_components"]["correct"].tolist(), fields["reward_components"]["format"].tolist()
    assert correct[:2] == [1.0, 0.0] and all(math.isnan(v) for v in correct[2:])
    assert all(math.isnan(v) for v in fmt[:2]) and fmt[2:] == pytest.approx([0.1, 0.2, 0.3])
    assert (fields["group_ids"], fields["generator_ids"], fields["temperature"]) == (["a", "b"], ["gen-a", "gen-b"],
                                                                                     0.7)
    # the two builders of a batch take exactly these fields
    groups = two_groups()
    for batch in (TrainBatch.from_groups(groups, None, batch_id="x"),
                  assemble_batch(groups, [GroupRows.of(g, None) for g in groups], batch_id="x")):
        assert batch.rewards.tolist() == fields["rewards"].tolist() and batch.group_ids == ["a", "b"]
        assert batch.policy_versions.tolist() == [4, 4, 6, 6, 6] and batch.batch_id == "x"


def test_groups_of_different_temperatures_or_none_make_no_batch():
    groups = two_groups(second_temperature=1.0)
    with pytest.raises(ProtocolError, match="different temperatures"):
        TrainBatch.from_groups(groups, None)
    with pytest.raises(ProtocolError, match="different temperatures"):
        assemble_batch(groups, [GroupRows.of(g, None) for g in groups], batch_id="x")
    with pytest.raises(ProtocolError, match="at least one group"):
        TrainBatch.from_groups([], None)
