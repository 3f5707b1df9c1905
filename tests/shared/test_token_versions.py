"""Per-token policy versions (issue 38): the record, its checks, both wires and the batch layout
(shared/protocol/token_versions.py, shared/protocol/records.py)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.protocol.errors import ProtocolError
from shared.protocol.numbers import batch_problem
from shared.protocol.records import RolloutGroup, TrainBatch
from shared.protocol.token_versions import MAX_VERSION, newest_version
from shared.protocol.wire import decode, encode

from .groups import random_group

LENGTHS = (4, 2, 5, 0)
# completion 0 crossed two weight switches, completion 2 one; completion 1 all at the oldest; 3 is empty
VERSIONS = ([3, 3, 4, 6], None, [3, 5, 5, 5, 5], [])


def group_of(versions=VERSIONS, lengths=LENGTHS, policy_version=3, seed=0) -> RolloutGroup:
    return random_group(lengths, seed, policy_version=policy_version, versions=versions, group_id=f"g{seed}")


def rows_of(tensor: torch.Tensor, lengths) -> list[list[int]]:
    return [tensor[i, :n].tolist() for i, n in enumerate(lengths)]


def test_versions_from_lists_round_trip_and_one_version_sends_nothing():
    group = group_of().validate()
    assert group.token_versions.dtype == torch.int64 and group.token_versions.shape == (4, 5)
    assert rows_of(group.token_versions, LENGTHS) == [[3, 3, 4, 6], [3, 3], [3, 5, 5, 5, 5], []]
    assert newest_version(group) == 6
    back = RolloutGroup.from_bytes(group.to_bytes())
    assert torch.equal(back.token_versions, group.token_versions) and back.policy_version == 3
    # every token at policy_version (given explicitly, as None rows or not at all): nothing new on the wire
    for versions in ([[3] * 4, [3, 3], [3] * 5, []], [None] * 4, None):
        plain = group_of(versions=versions)
        assert plain.token_versions is None and newest_version(plain) == 3
        tensors, _ = decode(plain.to_bytes(), "rollout_group/v1")
        assert "token_versions" not in tensors
        old_tensors, old_fields = decode(group_of(versions=None).to_bytes(), "rollout_group/v1")
        assert sorted(tensors) == sorted(old_tensors) and decode(plain.to_bytes(), "rollout_group/v1")[1] == old_fields
        assert RolloutGroup.from_bytes(plain.to_bytes()).token_versions is None


def test_from_samples_refuses_version_rows_that_do_not_fit():
    with pytest.raises(ProtocolError, match="completion 1: 3 token versions for 2 tokens"):
        group_of(versions=([3] * 4, [3, 3, 3], [3] * 5, []))
    with pytest.raises(ProtocolError, match="versions for 3 completions, but the group has 4"):
        group_of(versions=([3] * 4, [3, 3], [3] * 5))
    for bad in (3.0, True, -1, 2**53, "3"):
        with pytest.raises(ProtocolError, match="token versions must be integers in"):
            group_of(versions=([3, 3, 3, bad], None, None, None))


def _with_versions(versions: torch.Tensor, policy_version: int = 3) -> bytes:
    """A plain group's bytes with ``versions`` as its token_versions tensor (any dtype and shape a sender picks)."""
    tensors, fields = decode(group_of(versions=None).to_bytes(), "rollout_group/v1")
    tensors["token_versions"] = versions
    fields["policy_version"] = policy_version
    return encode("rollout_group/v1", tensors, fields)


GOOD = torch.tensor([[3, 3, 4, 6, 0], [3, 3, 0, 0, 0], [3, 5, 5, 5, 5], [0, 0, 0, 0, 0]])


def _changed(row: int, col: int, value: int) -> torch.Tensor:
    out = GOOD.clone()
    out[row, col] = value
    return out


HOSTILE = [
    (_changed(0, 1, -1), "completion 0, token 1 is -1, outside [3, 2^53)"),
    (_changed(2, 4, 2**53), f"completion 2, token 4 is {2**53}, outside [3, 2^53)"),
    (_changed(1, 1, 2), "completion 1, token 1 is 2, outside [3, 2^53)"),
    (_changed(0, 3, 2), "completion 0, token 3 is 2, outside [3, 2^53)"),
    (_changed(2, 2, 4), "completion 2, token 2 has version 4 after 5"),   # 3, 5, 4: decreasing
    (GOOD.double(), "token_versions must be an integer tensor, got torch.float64"),
    (GOOD.bool(), "token_versions must be an integer tensor, got torch.bool"),
    (GOOD[:, :4], "token_versions must have the shape of the completions (4, 5), got (4, 4)"),
    (GOOD.reshape(-1), "token_versions must have the shape of the completions"),
    (GOOD + 1, "the oldest token version is 4, but policy_version is 3"),
]


@pytest.mark.parametrize("versions, reason", HOSTILE)
def test_hostile_token_versions_are_a_protocol_error_naming_the_problem(versions, reason):
    with pytest.raises(ProtocolError) as refused:
        RolloutGroup.from_bytes(_with_versions(versions))
    assert reason in str(refused.value)


def test_padding_positions_are_not_read():
    garbage = GOOD.clone()
    garbage[0, 4], garbage[1, 2:], garbage[3] = -7, 2**62, 1   # past each row's length
    group = RolloutGroup.from_bytes(_with_versions(garbage))
    assert rows_of(group.token_versions, LENGTHS) == [[3, 3, 4, 6], [3, 3], [3, 5, 5, 5, 5], []]
    assert newest_version(group) == 6
    # smaller integer dtypes are integers too: kept, and sent as int64 again
    small = RolloutGroup.from_bytes(_with_versions(GOOD.to(torch.int32)))
    assert decode(small.to_bytes(), "rollout_group/v1")[0]["token_versions"].dtype == torch.int64


def test_a_batch_carries_versions_only_when_a_group_has_them():
    mixed = [group_of(seed=1), group_of(versions=None, policy_version=5, lengths=(2, 6), seed=2),
             group_of(versions=([7, 8], [7]), policy_version=7, lengths=(2, 1), seed=3)]
    batch = TrainBatch.from_groups(mixed, None)
    lengths = batch.completion_lengths.tolist()
    assert batch.token_versions.shape == batch.behaviour_logprobs.shape == (8, 6)
    assert rows_of(batch.token_versions, lengths) == [[3, 3, 4, 6], [3, 3], [3, 5, 5, 5, 5], [],
                                                      [5, 5], [5] * 6, [7, 8], [7]]
    assert batch.policy_versions.tolist() == [3, 3, 3, 3, 5, 5, 7, 7]
    # padding holds the row's version: nothing reads it, and a reader that forgets the lengths sees no false lag
    assert (batch.token_versions >= batch.policy_versions[:, None]).all()
    assert batch_problem(batch, vocab_size=None) is None
    back = TrainBatch.from_bytes(batch.to_bytes())
    assert torch.equal(back.token_versions, batch.token_versions)
    kept = batch.select_groups([2, 0])
    assert rows_of(kept.token_versions, kept.completion_lengths.tolist()) == [[3, 3, 4, 6], [3, 3], [3, 5, 5, 5, 5],
                                                                             [], [7, 8], [7]]
    assert kept.token_versions.shape == kept.behaviour_logprobs.shape
    plain = TrainBatch.from_groups([group_of(versions=None), group_of(versions=None, seed=4)], None)
    assert plain.token_versions is None
    assert "token_versions" not in decode(plain.to_bytes(), "train_batch/v2")[0]
    assert TrainBatch.from_bytes(plain.to_bytes()).token_versions is None


def test_the_learner_check_refuses_a_batch_with_tokens_older_than_their_row():
    batch = TrainBatch.from_groups([group_of(seed=1), group_of(versions=None, policy_version=5, seed=2)], None)
    batch.token_versions[5, 1] = 4                         # row 5 is at version 5
    assert batch_problem(batch, None) == ("token_versions: completion 5, token 1 is 4, outside [5, 2^53) (no token "
                                          "is older than its row's policy_version)")
    batch.token_versions = batch.token_versions[:, :3]
    assert "token_versions must have the shape of the completions (8, 5)" in batch_problem(batch, None)


@st.composite
def version_groups(draw):
    """A group of 1-4 completions, each crossing 0-3 weight switches at random tokens, policy_version the oldest."""
    start = draw(st.integers(0, MAX_VERSION - 30))
    lengths = draw(st.lists(st.integers(0, 7), min_size=1, max_size=4))
    rows = []
    for n in lengths:
        steps = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
        first = start + draw(st.integers(0, 2))
        rows.append([first + sum(steps[:k + 1]) for k in range(n)])
    valid = [v for row in rows for v in row]
    oldest = min(valid) if valid else start
    return group_of(versions=rows, lengths=lengths, policy_version=oldest, seed=draw(st.integers(0, 9))), rows


@settings(max_examples=60, deadline=None)
@given(version_groups())
def test_property_any_valid_versions_survive_both_wires(drawn):
    group, rows = drawn
    back = RolloutGroup.from_bytes(group.to_bytes())
    lengths = group.completion_lengths.tolist()
    if back.token_versions is None:   # every token at the oldest version: the group is an old client's
        assert all(v == group.policy_version for row in rows for v in row)
    else:
        assert rows_of(back.token_versions, lengths) == rows
    batch = TrainBatch.from_bytes(TrainBatch.from_groups([back, group_of(versions=None, seed=5)], None).to_bytes())
    assert batch_problem(batch, None) is None
    if batch.token_versions is not None:
        assert rows_of(batch.token_versions, lengths) == rows


_DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.float32, torch.float64]


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from(_DTYPES), rows=st.just(4) | st.integers(0, 5), cols=st.just(5) | st.integers(0, 6),
       values=st.lists(st.integers(-2**63, 2**63 - 1) | st.integers(-3, 9), min_size=30, max_size=30))
def test_property_any_token_versions_tensor_is_a_group_or_a_protocol_error(dtype, rows, cols, values):
    """Whatever tensor a sender puts under token_versions: a valid group that obeys every rule, or a ProtocolError
    (the hub's 4xx), never another exception."""
    flat = torch.tensor(values[:rows * cols], dtype=torch.int64)
    versions = (flat.to(dtype) if dtype.is_floating_point or dtype == torch.bool
                else flat.clamp(torch.iinfo(dtype).min, torch.iinfo(dtype).max).to(dtype)).reshape(rows, cols)
    try:
        group = RolloutGroup.from_bytes(_with_versions(versions))
    except ProtocolError:
        return
    assert group.token_versions.shape == (4, 5) and not group.token_versions.is_floating_point()
    valid = rows_of(group.token_versions, LENGTHS)
    assert min(v for row in valid for v in row) == 3 and all(row == sorted(row) for row in valid)
    assert max(v for row in valid for v in row) < MAX_VERSION
