"""Step rewards in the data (issue 23 item 1): a rollout group's and a train batch's step_rewards / step_index /
step_end, their wire form, and the checks that refuse a bad step with a message naming it."""

import json
import math
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.protocol import steps as step_fields
from shared.protocol.errors import ProtocolError
from shared.protocol.records import RolloutGroup, SamplingParams, TrainBatch
from shared.protocol.wire import WireError, decode, encode, read_header

LENGTHS = (3, 1, 4, 0)


def make(steps=None, lengths=LENGTHS, group_id="g-steps") -> RolloutGroup:
    rewards = [float(i % 2) for i in range(len(lengths))]
    return RolloutGroup.from_samples(
        prompt_ids=[7, 8], completion_ids=[list(range(10, 10 + n)) for n in lengths],
        behaviour_logprobs=[[-0.5] * n for n in lengths], rewards=rewards, finish_reasons=["stop"] * len(lengths),
        policy_version=1, generator_id="gen-0", sampling=SamplingParams(temperature=0.7, max_tokens=4),
        reward_components={"correct": rewards}, task={"answer": "82"}, group_id=group_id, steps=steps)


STEPS = [[(0, 1.0), (2, -0.5)], [(0, 0.25)], [(1, 2.0), (2, 0.0), (3, -1.5)], []]


def as_lists(group: RolloutGroup) -> list[list[tuple[int, float]]]:
    out = [[] for _ in range(group.group_size)]
    for r, i, e in zip(group.step_rewards.tolist(), group.step_index.tolist(), group.step_end.tolist()):
        out[i].append((e, r))
    return out


def canonical(data: bytes) -> tuple[dict, dict, bytes]:
    """A message as (tensor header entries, JSON fields, payload): safetensors writes its metadata keys in no fixed
    order, so equal messages are compared this way."""
    header = read_header(data)
    metadata = header.pop("__metadata__")
    size = int.from_bytes(data[:8], "little")
    return header, {**metadata, "grpo_json": json.loads(metadata["grpo_json"])}, data[8 + size:]


# -- round trips ----------------------------------------------------------------------------------------------
def test_a_group_with_steps_round_trips_through_the_wire():
    group = make(STEPS).validate(vocab_size=64)
    assert group.step_rewards.dtype == torch.float32 and group.step_index.dtype == torch.int64
    assert group.step_index.tolist() == [0, 0, 1, 2, 2, 2] and group.step_end.tolist() == [0, 2, 0, 1, 2, 3]
    back = RolloutGroup.from_bytes(group.to_bytes())
    assert as_lists(back) == STEPS
    for name in step_fields.STEP_FIELDS:
        x, y = getattr(back, name), getattr(group, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert {"step_rewards", "step_index", "step_end"} <= set(read_header(group.to_bytes()))


def test_an_outcome_only_group_encodes_exactly_as_before():
    group = make()
    assert group.step_rewards is None and group.step_index is None and group.step_end is None
    data = group.to_bytes()
    # what to_bytes wrote before step rewards existed
    before = encode("rollout_group/v1", {
        "prompt_ids": group.prompt_ids, "completion_ids": group.completion_ids,
        "completion_lengths": group.completion_lengths, "behaviour_logprobs": group.behaviour_logprobs,
        "rewards": group.rewards, "reward/correct": group.reward_components["correct"]},
        dict(finish_reasons=group.finish_reasons, policy_version=1, generator_id="gen-0",
             sampling={"temperature": 0.7, "top_p": 1.0, "top_k": -1, "max_tokens": 4}, task={"answer": "82"},
             group_id="g-steps"))
    assert canonical(data) == canonical(before) and len(data) == len(before)
    assert canonical(make(None).to_bytes()) == canonical(data)
    back = RolloutGroup.from_bytes(data)
    assert back.step_rewards is None and back.step_index is None and back.step_end is None


def test_steps_but_none_is_kept_apart_from_outcome_only():
    group = make([[], [], [], []]).validate()
    back = RolloutGroup.from_bytes(group.to_bytes())
    assert back.step_rewards is not None and back.step_rewards.shape == (0,) and back.step_index.shape == (0,)


# -- the checks -------------------------------------------------------------------------------------------------
def with_steps(rewards, index, end, **changes) -> RolloutGroup:
    return replace(make(), step_rewards=rewards, step_index=index, step_end=end, **changes)


F32 = torch.float32


def t(values, dtype=torch.long):
    return torch.tensor(values, dtype=dtype)


def f(values, dtype=F32):
    return torch.tensor(values, dtype=dtype)


@pytest.mark.parametrize(("rewards", "index", "end", "message"), [
    (f([1.0, math.nan]), t([0, 0]), t([0, 1]), r"step_rewards: step 1 of completion 0 \(entry 1\) has reward nan"),
    (f([math.inf]), t([2]), t([1]), "step_rewards: step 0 of completion 2 .* has reward inf"),
    (f([-math.inf], torch.float64), t([1]), t([0]), "step_rewards: .* has reward -inf"),
    (f([0.5, 1e300], torch.float64), t([0, 2]), t([0, 0]),
     r"step_rewards: step 0 of completion 2 \(entry 1\) has reward 1e\+300, not a finite float32"),
    (f([1.0]), t([-1]), t([0]), "step_index: entry 0 is -1, outside the group's 4 completions"),
    (f([1.0, 1.0]), t([0, 4]), t([0, 0]), "step_index: entry 1 is 4, outside the group's 4 completions"),
    (f([1.0, 1.0]), t([2, 0]), t([0, 0]), r"step_index: entry 1 \(completion 0\) comes after a step of completion 2"),
    (f([1.0]), t([0]), t([-1]), r"step_end: step 0 of completion 0 \(entry 0\) ends at token -1, outside the "
     "completion's 3 tokens"),
    (f([1.0]), t([0]), t([3]), "step_end: step 0 of completion 0 .* ends at token 3, outside the completion's 3"),
    (f([1.0]), t([3]), t([0]), "step_end: step 0 of completion 3 .* ends at token 0, outside the completion's 0"),
    (f([1.0, 1.0]), t([2, 2]), t([2, 1]), r"step_end: step 1 of completion 2 \(entry 1\) ends at token 1, not "
     "after the previous step's end 2"),
    (f([1.0, 1.0]), t([2, 2]), t([1, 1]), "step 1 of completion 2 .* not after the previous step's end 1"),
    (f([1.0, 1.0]), t([0]), t([0]), r"must all be \[S\], got shapes \[\(2,\), \(1,\), \(1,\)\]"),
    (f([1.0]), t([0, 0]), t([0, 1]), r"must all be \[S\]"),
    (f([[1.0]]), t([[0]]), t([[0]]), r"must all be \[S\]"),
    (t([1]), t([0]), t([0]), "step_rewards must be floating-point"),
    (f([1.0]), t([0.0], F32), t([0]), "step_index must be an integer tensor"),
    (f([1.0]), t([0]), t([True], torch.bool), "step_end must be an integer tensor"),
    (f([1.0]), None, t([0]), "go together; got only step_rewards, step_end"),
    (None, t([0]), None, "go together; got only step_index"),
])
def test_a_bad_step_is_refused_naming_it(rewards, index, end, message):
    group = with_steps(rewards, index, end)
    with pytest.raises(ProtocolError, match=message):
        group.validate()
    # and the same tensors over the wire (raw, as a foreign client could send them): refused alike, never decoded
    tensors, fields = decode(make().to_bytes(), "rollout_group/v1")
    tensors.update({k: v for k, v in zip(step_fields.STEP_FIELDS, (rewards, index, end)) if v is not None})
    with pytest.raises(ProtocolError, match=message):
        RolloutGroup.from_bytes(encode("rollout_group/v1", tensors, fields))


def test_too_many_steps_are_refused(monkeypatch):
    monkeypatch.setattr(step_fields, "MAX_STEPS_PER_GROUP", 5)
    with pytest.raises(ProtocolError, match="6 steps in one group; at most 5"):
        make(STEPS)
    group = make([[(0, 1.0), (1, 1.0), (2, 1.0)], [], [(0, 1.0), (1, 1.0)], []]).validate()
    with pytest.raises(ProtocolError, match="6 steps in one group; at most 5"):
        replace(group, step_rewards=f([1.0] * 6), step_index=t([0, 0, 0, 2, 2, 2]),
                step_end=t([0, 1, 2, 0, 1, 2])).validate()


def test_the_cap_is_documented_and_at_most_one_step_per_token():
    assert step_fields.MAX_STEPS_PER_GROUP >= 4096
    full = make([[(e, 1.0) for e in range(n)] for n in LENGTHS]).validate()
    assert full.step_rewards.numel() == sum(LENGTHS)
    with pytest.raises(ProtocolError, match="outside the completion's 1 tokens"):
        make([[], [(0, 1.0), (1, 1.0)], [], []]).validate()


@pytest.mark.parametrize(("steps", "message"), [
    ([[(0, 1.0)]], "step lists for 1 completions, but the group has 4"),
    ([[(0.0, 1.0)], [], [], []], r"completion 0, step 0: step end must be an int64 integer, got 0.0"),
    ([[], [(True, 1.0)], [], []], "step end must be an int64 integer"),
    ([[], [(0, "1")], [], []], r"completion 1, step 0: step reward must be a number, got '1'"),
    ([[], [(0, None)], [], []], "step reward must be a number"),
    ([[(0,)], [], [], []], r"expected an \(end, reward\) pair"),
    ([[], [], [(0, 1.0), (1, 1e300)], []], r"step 1 of completion 2 \(entry 1\) has reward 1e\+300"),
    ([[], [], [(2**70, 1.0)], []], "step end must be an int64 integer, got 1180591620717411303424"),
    ([[], [], [(0, 10**400)], []], r"step 0 of completion 2 \(entry 0\) has reward inf"),
])
def test_from_samples_refuses_bad_step_lists(steps, message):
    with pytest.raises(ProtocolError, match=message):
        make(steps).validate()


# -- the train batch ----------------------------------------------------------------------------------------------
def test_a_batch_concatenates_the_steps_with_row_offsets_and_mixes_outcome_only_groups():
    a = make(STEPS, group_id="a")
    b = make(None, group_id="b")                      # outcome-only: its 4 rows have no steps
    c = make([[], [], [], []], group_id="c")          # steps, but none
    d = make([[(1, 9.0)], [], [], []], group_id="d")
    batch = TrainBatch.from_groups([a, b, c, d], None)
    assert batch.step_rewards.tolist() == [1.0, -0.5, 0.25, 2.0, 0.0, -1.5, 9.0]
    assert batch.step_index.tolist() == [0, 0, 1, 2, 2, 2, 12]
    assert batch.step_end.tolist() == [0, 2, 0, 1, 2, 3, 1]
    assert batch.step_rewards.dtype == torch.float32 and batch.step_index.dtype == batch.step_end.dtype == torch.int64
    assert (batch.completion_lengths[batch.step_index] > batch.step_end).all()
    back = TrainBatch.from_bytes(batch.to_bytes())
    for name in step_fields.STEP_FIELDS:
        assert torch.equal(getattr(back, name), getattr(batch, name)), name
    picked = batch.select_groups([1, 3])
    assert picked.step_index.tolist() == [4] and picked.step_end.tolist() == [1] and picked.step_rewards.tolist() == [9.0]
    assert batch.select_groups([1]).step_index.tolist() == []


def test_a_batch_of_outcome_only_groups_has_no_step_fields_anywhere():
    batch = TrainBatch.from_groups([make(group_id="a"), make(group_id="b")], None)
    assert batch.step_rewards is None and batch.step_index is None and batch.step_end is None
    assert not set(step_fields.STEP_FIELDS) & set(read_header(batch.to_bytes()))
    back = TrainBatch.from_bytes(batch.to_bytes())
    assert back.step_rewards is None and back.select_groups([1]).step_rewards is None
    only_empty = TrainBatch.from_groups([make([[], [], [], []], group_id="a"), make(group_id="b")], None)
    assert only_empty.step_rewards.shape == (0,) and only_empty.step_index.dtype == torch.int64


def test_a_batch_message_with_part_of_the_step_fields_is_refused():
    batch = TrainBatch.from_groups([make(STEPS)], None)
    tensors, fields = decode(batch.to_bytes(), "train_batch/v2")
    del tensors["step_end"]
    with pytest.raises(ProtocolError, match="go together; got only step_rewards, step_index"):
        TrainBatch.from_bytes(encode("train_batch/v2", tensors, fields))


# -- properties -----------------------------------------------------------------------------------------------------
finite_f32 = st.floats(allow_nan=False, allow_infinity=False, width=32)


@st.composite
def valid_steps(draw):
    lengths = draw(st.lists(st.integers(0, 6), min_size=1, max_size=5))
    steps = [[(e, draw(finite_f32)) for e in sorted(draw(st.sets(st.integers(0, n - 1))))] if n else []
             for n in lengths]
    return lengths, steps


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_steps())
def test_random_valid_step_lists_round_trip_exactly(drawn):
    lengths, steps = drawn
    group = make(steps, lengths=lengths).validate()
    back = RolloutGroup.from_bytes(group.to_bytes())
    assert as_lists(back) == steps
    batch = TrainBatch.from_groups([group, make(None, lengths=lengths, group_id="x"), back], None)
    assert batch.step_index.tolist() == group.step_index.tolist() + (group.step_index + 2 * len(lengths)).tolist()


def oracle(rewards, index, end, lengths) -> bool:
    """An independent statement of the rules (rewards as float32, which they are on the wire)."""
    if not (len(rewards) == len(index) == len(end)) or len(rewards) > step_fields.MAX_STEPS_PER_GROUP:
        return False
    previous = (-1, -1)
    for r, i, e in zip(rewards, index, end):
        r32 = torch.tensor(r, dtype=torch.float64).float().item()
        if not math.isfinite(r32) or not 0 <= i < len(lengths) or not 0 <= e < lengths[i] or (i, e) <= previous:
            return False
        previous = (i, e)
    return True


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(0, 4), min_size=1, max_size=4),
       rows=st.lists(st.tuples(st.one_of(st.floats(), st.sampled_from([1e39, -3.5e38, 1e300])),
                               st.integers(-2, 5), st.integers(-2, 6)), max_size=8),
       drop=st.sampled_from([None, 0, 1, 2]), wire=st.booleans())
def test_random_step_fields_are_accepted_exactly_when_valid_and_refused_as_protocol_errors(lengths, rows, drop, wire):
    rewards = [r for r, _, _ in rows]
    index = [i for _, i, _ in rows]
    end = [e for _, _, e in rows]
    values = [torch.tensor(rewards, dtype=torch.float64), t(index), t(end)]
    if drop is not None:
        values[drop] = values[drop][:-1] if values[drop].numel() else values[drop][:0].reshape(0, 1)
    group = replace(make(lengths=lengths), step_rewards=values[0], step_index=values[1],
                    step_end=values[2])
    valid = drop is None and oracle(rewards, index, end, lengths)
    try:
        if wire:
            tensors, fields = decode(make(lengths=lengths).to_bytes(), "rollout_group/v1")
            tensors.update(zip(step_fields.STEP_FIELDS, values))
            RolloutGroup.from_bytes(encode("rollout_group/v1", tensors, fields))
        else:
            group.validate()
    except (ProtocolError, WireError):
        assert not valid
    else:
        assert valid
