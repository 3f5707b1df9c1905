"""Every float of a rollout group is checked as the float32 the learner computes with, whatever dtype it arrived in.

Property: a group whose rewards, reward component or behaviour logprobs hold ``x`` (sent as F64, F32, F16 or
BF16) is accepted iff ``x`` is finite once cast to float32 (and, for a logprob, within
``[MIN_LOGPROB, MAX_LOGPROB]``); otherwise a ProtocolError names the field and the entry. Oracle for the float32
cast of a float64: it overflows to inf from the midpoint ``2^128 - 2^103`` between FLT_MAX and ``2^128`` on (ties go
to the even ``2^128``), and underflows to 0 (a finite value) below the smallest subnormal."""

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from shared.protocol.errors import ProtocolError
from shared.protocol.numbers import MAX_LOGPROB, MIN_LOGPROB, batch_problem
from shared.protocol.records import RolloutGroup, SamplingParams, TrainBatch
from tests.ref_server.helpers import group_bytes, make_group

OVERFLOW = 2.0**128 - 2.0**103   # float64 values of this magnitude or more become inf in float32
FLOAT32_MAX = 3.4028234663852886e38
EDGES = [FLOAT32_MAX, OVERFLOW, math.nextafter(OVERFLOW, 0), 1e39, 1e300, -1e300, 5e-324, 1e-310, 1.4e-45, -0.0,
         0.0, math.inf, -math.inf, math.nan, MIN_LOGPROB, math.nextafter(MIN_LOGPROB, -math.inf), MAX_LOGPROB,
         0.0100001, -1e4 - 1e-3]
values = st.one_of(st.sampled_from(EDGES), st.floats(width=64), st.floats(width=32))
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def finite_in_float32(x: float) -> bool:
    return math.isfinite(x) and abs(x) < OVERFLOW


@settings(max_examples=300, deadline=None)
@given(x=values, dtype=st.sampled_from(sorted(DTYPES)), field=st.sampled_from(["rewards", "reward/correct"]))
@example(x=1e300, dtype="F64", field="rewards")
@example(x=1e39, dtype="F64", field="reward/correct")
def test_rewards_are_accepted_iff_finite_in_float32(x, dtype, field):
    data, sent = group_bytes(field, x, DTYPES[dtype])
    name = "rewards" if field == "rewards" else "reward component 'correct'"
    if finite_in_float32(sent):
        group = RolloutGroup.from_bytes(data)
        tensor = group.rewards if field == "rewards" else group.reward_components["correct"]
        assert torch.isfinite(tensor.float()).all()
    else:
        with pytest.raises(ProtocolError, match=rf"^{name}\[1\] = .* is not a finite float32"):
            RolloutGroup.from_bytes(data)


@settings(max_examples=300, deadline=None)
@given(x=values, dtype=st.sampled_from(sorted(DTYPES)))
@example(x=1e300, dtype="F64")
@example(x=0.5, dtype="F32")
@example(x=-0.0, dtype="F64")
def test_behaviour_logprobs_are_accepted_iff_a_float32_log_probability(x, dtype):
    data, sent = group_bytes("behaviour_logprobs", x, DTYPES[dtype])   # entry [0, 1]: a completion token
    as32 = float(torch.tensor(sent, dtype=torch.float64).float()) if finite_in_float32(sent) else math.inf
    if finite_in_float32(sent) and MIN_LOGPROB <= as32 <= MAX_LOGPROB:
        RolloutGroup.from_bytes(data)
    else:
        with pytest.raises(ProtocolError, match=r"^behaviour_logprobs\[0, 1\] = .* (not a finite float32|outside)"):
            RolloutGroup.from_bytes(data)


def test_padding_is_not_checked_and_the_message_is_short():
    group = make_group(lengths=(3, 1, 4, 2))
    group.behaviour_logprobs[1, 3] = math.inf        # past completion 1's single token: padding, meaningless
    RolloutGroup.from_bytes(group.to_bytes())
    data, _ = group_bytes("rewards", 1e300, torch.float64)
    with pytest.raises(ProtocolError) as info:
        RolloutGroup.from_bytes(data)
    assert str(info.value) == "rewards[1] = 1e+300 is not a finite float32 (the dtype the learner uses)"


def test_token_ids_are_never_negative_even_without_a_vocabulary():
    group = make_group()
    group.prompt_ids[0] = -3
    with pytest.raises(ProtocolError, match=r"prompt_ids: token ids must be in >= 0, got -3"):
        group.validate()
    group = make_group()
    group.completion_ids[2, 0] = 50
    with pytest.raises(ProtocolError, match=r"completion_ids: token ids must be in \[0, 50\), got 50"):
        group.validate(vocab_size=50)
    group.validate(vocab_size=51)


@settings(max_examples=100, deadline=None)
@given(t=st.one_of(st.sampled_from([1e39, 1e300, FLOAT32_MAX, 1e-3, 1e-4, 0.0, -1.0]), st.floats(width=64)))
def test_temperatures_from_json_metadata_are_checked_in_float32(t):
    ok = math.isfinite(t) and 1e-3 <= t <= FLOAT32_MAX
    if ok:
        assert SamplingParams(temperature=t).validate().temperature == t
    else:
        with pytest.raises(ProtocolError, match="temperature must be a finite float32"):
            SamplingParams(temperature=t).validate()


def test_the_learners_own_check_of_a_batch_names_what_it_cannot_train():
    groups = [make_group(seed=0), make_group(seed=1, lengths=(2, 2, 2, 2))]
    ref = [-torch.rand(g.completion_ids.shape) for g in groups]
    batch = TrainBatch.from_groups(groups, ref, batch_id="b")
    top = int(batch.input_ids.max())
    assert batch_problem(batch, vocab_size=top + 1) is None and batch_problem(batch, vocab_size=None) is None
    assert batch_problem(batch, vocab_size=top) == f"input_ids: token ids must be in [0, {top}), got {top}"
    batch.behaviour_logprobs[5, 3] = math.inf          # row 5 has 2 completion tokens: padding, ignored
    assert batch_problem(batch, vocab_size=40) is None
    batch.ref_logprobs[5, 1] = -math.inf
    assert batch_problem(batch, 40) == "ref_logprobs[5, 1] = -inf is not a finite float32 (the dtype the learner uses)"
    batch.rewards[2] = math.nan
    assert batch_problem(batch, 40).startswith("rewards[2] = nan")
