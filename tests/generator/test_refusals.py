"""generator/refusals.py: refused groups are counted, each kind of reason logged once, and only an unbroken run of
refusals (no group accepted in between) stops the generator."""

import logging

import pytest

from generator.refusals import GroupsRefused, RefusalCounter, reason_kind
from shared.errors import UsageError


def test_a_run_of_refusals_stops_only_when_nothing_was_accepted_in_between():
    counter = RefusalCounter(limit=3)
    for _ in range(10):   # refusals broken up by acceptances never stop the generator
        counter.refused("the hub (422)", "completion 0: 300 tokens exceed the model's context of 256")
        counter.refused("the hub (422)", "completion 1: 301 tokens exceed the model's context of 256")
        counter.accepted()
    counter.refused("the hub (422)", "a")
    counter.refused("the hub (422)", "b")
    with pytest.raises(GroupsRefused, match="refused the last 3 groups and accepted none.*the last reason: c") as info:
        counter.refused("the hub (422)", "c")
    assert isinstance(info.value, UsageError) and info.value.exit_code == 2   # the user changes the config
    assert counter.kinds == {reason_kind("completion 0: 300 tokens exceed the model's context of 256"): 20,
                             "a": 1, "b": 1, "c": 1}


def test_each_kind_of_reason_is_logged_once(caplog):
    counter = RefusalCounter(limit=0)   # 0: never stops
    with caplog.at_level(logging.ERROR, logger="grpo.generator"):
        for i in range(200):
            counter.refused("the hub (422)", f"completion {i % 4}: {300 + i} tokens exceed the model's context of 256")
            counter.refused("the hub (400)", "rollout group is missing 'group_id'")
    assert len(caplog.records) == 2 and counter.in_a_row == 400
    assert "completion 0: 300 tokens exceed the model's context of 256" in caplog.records[0].getMessage()


def test_groups_dropped_as_constant_stop_only_in_an_unbroken_run_from_one_policy_version():
    """Dynamic sampling's livelock: while every group is dropped as constant nothing reaches the learner and the
    policy cannot change. An accepted group or a new policy version (another generator's groups trained on) starts
    the count again; the limit's worth in a row from one version stops with the scores named."""
    counter = RefusalCounter(limit=3)
    for version in range(5):   # a new version each time: never stops
        counter.constant(version, [0.0] * 4)
        counter.constant(version, [0.0] * 4)
    for _ in range(5):         # an accepted group in between: never stops
        counter.constant(7, [1.0] * 4)
        counter.constant(7, [1.0] * 4)
        counter.accepted()
    counter.constant(7, [0.0] * 4)
    counter.constant(7, [0.0] * 4)
    with pytest.raises(GroupsRefused, match=r"the last 3 groups, all sampled from policy version 7, were dropped by "
                                            r"dynamic sampling .*the last group: 0.5 for all 4") as info:
        counter.constant(7, [0.5] * 4)
    assert info.value.exit_code == 2 and "generator.drop_constant_groups: false" in str(info.value)
    unlimited = RefusalCounter(limit=0)
    for _ in range(500):
        unlimited.constant(0, [0.0, 0.0])
