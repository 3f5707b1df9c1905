"""A generator's membership of the learner's group, on a live hub with the learner's real sender: the hub answers
"connect" with the same offer until the learner's link reports the group formed, and a generator polling before
that report keeps the group it holds (it used to join the offer's store again, where nothing forms: gloo's connect
timeout, then HTTP for good); a generator that leaves and joins again forms a new group and receives through it."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from generator.engines.hf import TransformersEngine
from shared.config.schema import WeightSyncConfig
from shared.protocol.weight_sync_messages import MemberPoll
from shared.weight_sync.publisher import WeightPublisher
from shared.weight_sync.receiver import WeightReceiver
from tests.live_server import LiveServer, make_config
from tests.weight_sync.test_lora_publish import sync_until
from tests.weight_sync.test_weight_sync import CFG, client, wait_for

pytestmark = pytest.mark.slow  # a live hub
SYNC = WeightSyncConfig(**{**CFG, "timeout_s": 2.0})  # a failed re-connect: gloo's 5 x 2 s, then HTTP


@pytest.fixture
def learner(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def test_a_repeated_offer_keeps_the_group_and_a_generator_that_left_joins_a_new_one(tiny_model_dir, learner, tmp_path):
    with LiveServer(make_config(tmp_path)) as live:
        publisher = WeightPublisher(learner, lambda: client(live.url), SYNC, rank=0, world=1,
                                    device=torch.device("cpu"), relay_version=None)
        sender = publisher.sender
        report = sender.member_state

        def report_late(member_id: str, state: str, **kw) -> None:  # the link's "formed" report, overtaken
            if state == "active":
                time.sleep(1.5)
            report(member_id, state, **kw)

        sender.member_state = report_late
        gen = TransformersEngine(tiny_model_dir)
        receiver = WeightReceiver(gen, client(live.url), SYNC, "gen", tmp_path / "gen")
        try:
            wait_for(lambda: (receiver.sync(0), receiver.connected)[1])
            group, member = gen._weight_group, receiver.member_id
            # the premise: the hub still offers the group the engine holds
            assert receiver.client.sync_poll(member, MemberPoll(version=0)).action == "connect"
            started = time.monotonic()
            assert receiver.sync(0) is None
            assert receiver.connected and gen._weight_group is group and receiver.member_id == member
            assert time.monotonic() - started < 1.0  # no connect timeout waited out
            publisher.publish(1)
            have = sync_until(receiver, 0, 1)
            wait_for(lambda: sender.counters.served == 1)
            assert receiver.transport == "collective" and group.bytes_received == publisher.layout.total_bytes
            # leave, join again: a new member, a new group, the next version through it
            receiver.close()
            assert not receiver.connected and gen._weight_group is None
            wait_for(lambda: (receiver.sync(have), receiver.connected)[1])
            assert receiver.member_id != member and gen._weight_group is not group
            assert sender.wait_idle(20)
            publisher.publish(2)
            have = sync_until(receiver, have, 2)
            wait_for(lambda: sender.counters.served == 2)
            assert receiver.failed_receives == 0
            assert gen._weight_group.bytes_received == publisher.layout.total_bytes
        finally:
            receiver.close()
            publisher.close()
