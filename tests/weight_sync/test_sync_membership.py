"""Membership of a weight-sync group does not outlive the hub instance that brokered it (issue 22): after a hub
restart the learner's sender drops the links of members the new hub does not hold, and its final sync and close
never wait out a group's timeout on a generator that was told to rejoin elsewhere. A real hub (uvicorn) restarted on
the same port and spool, the learner's publisher and sender threads, a transformers generator over gloo."""

import asyncio
import time

import pytest

from shared.protocol.weight_sync_messages import JoinRequest, SenderInfo
from shared.weight_sync.rendezvous import SyncRendezvous
from tests.live_server import LiveServer, make_config
from tests.weight_sync.test_weight_sync import Generator, learner_model, make_publisher, perturb, wait_for  # noqa: F401


def _sender(sender_id: str = "s1") -> SenderInfo:
    return SenderInfo(sender_id=sender_id, host="127.0.0.1", backend="gloo", layout=[], bucket_bytes=8,
                      timeout_s=5.0)


def test_member_ids_never_repeat_across_hub_instances_and_the_sender_hears_which_members_are_held():
    first, second = SyncRendezvous(), SyncRendezvous()
    request = JoinRequest(generator_id="gen-0", transport="collective")
    for rendezvous in (first, second):
        rendezvous.register_sender(_sender())
    a, b = first.join(request), second.join(request)
    assert a != b and a.endswith("-gen-0") and b.endswith("-gen-0")   # both the first member of their hub
    other = first.join(JoinRequest(generator_id="gen-1", transport="collective"))
    work = asyncio.run(first.work("s1", 0))
    assert sorted(work.members) == sorted([a, other]) and {j.member_id for j in work.joins} == {a, other}
    first.leave(other)
    assert asyncio.run(first.work("s1", 0)).members == [a]   # a member that left is no longer held
    first.register_sender(_sender("s2"))   # a new learner process: the old one's members are not its own
    assert asyncio.run(first.work("s2", 0)).members == []


@pytest.mark.slow
def test_a_final_sync_after_a_hub_restart_does_not_wait_on_a_member_of_the_old_hub(tiny_model_dir, learner_model,  # noqa: F811
                                                                                   tmp_path):
    live = LiveServer(make_config(tmp_path)).__enter__()
    port = int(live.url.rsplit(":", 1)[1])
    # the group's per-operation timeout is the default 30 s: a link waiting on a gone member would cost that
    publisher = make_publisher(learner_model, live.url, timeout_s=30.0)
    try:
        perturb(learner_model, 1)
        publisher.publish(1)
        gen = Generator(tiny_model_dir, live.url, "gen", tmp_path, timeout_s=30.0)
        assert gen.receiver._join()  # joined and offered a group, not yet connected to it ...
        wait_for(lambda: live.state.sync.summary()["members"] == {"offered": 1})
        old_member = gen.receiver.member_id
        live.__exit__(None, None, None)  # ... when the hub restarts: the new hub tells it to rejoin
        live = LiveServer(make_config(tmp_path), port=port).__enter__()
        gen.connect()
        assert gen.receiver.member_id != old_member and gen.version == 1
        counters = publisher.sender.counters
        wait_for(lambda: counters.dropped == 1 and counters.members == 1)  # the old link went, the new one holds
        assert old_member not in publisher.sender.members.links
        perturb(learner_model, 2)
        started = time.monotonic()
        publisher.finish(2)
        gen.sync_until(2)
        publisher.close()
        assert time.monotonic() - started < 5.0
        assert live.state.weights.current == 2 and gen.version == 2
    finally:
        publisher.close()
        live.__exit__(None, None, None)
