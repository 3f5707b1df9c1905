"""Delivery: leases, acknowledgements, expiry, and groups refused at upload so they never poison a batch."""

import time

import pytest
import torch

from ref_server.hub.intake import GroupRejected
from ref_server.hub.rollout_hub import RolloutHub
from shared.protocol.client import HubClient
from shared.protocol.errors import ProtocolError
from shared.protocol.records import RolloutGroup
from shared.protocol.wire import encode

from .helpers import make_group

OCTET = {"Content-Type": "application/octet-stream"}


def hub(tmp_path=None, **kw) -> RolloutHub:
    return RolloutHub(capacity=kw.pop("capacity", 16), max_staleness=kw.pop("max_staleness", 4), scorer=None,
                      spool_dir=tmp_path, **kw)


def spooled(tmp_path) -> list[str]:
    return sorted(p.name.split("-", 1)[1].removesuffix(".group") for p in tmp_path.glob("*.group"))


def test_groups_stay_spooled_until_the_batch_is_acknowledged(tmp_path):
    h = hub(tmp_path)
    groups = [make_group(seed=i) for i in range(3)]
    for g in groups:
        h.put(g.to_bytes())
    batch = h.take(2)
    assert batch.group_ids == [g.group_id for g in groups[:2]] and batch.batch_id
    assert h.depth() == 1 and h.leased_depth() == 2
    assert spooled(tmp_path) == sorted(g.group_id for g in groups)  # nothing deleted on hand-out
    assert h.ack([batch.batch_id]) == {batch.batch_id: "acked"}
    assert spooled(tmp_path) == [groups[2].group_id] and h.counters.consumed == 2 and h.leased_depth() == 0
    assert h.ack([batch.batch_id, "nope"]) == {batch.batch_id: "already", "nope": "unknown"}
    assert h.counters.consumed == 2


def test_an_unacknowledged_lease_returns_its_groups_to_the_front(tmp_path):
    h = hub(tmp_path, lease_timeout_s=0.3)
    groups = [make_group(seed=i) for i in range(3)]
    for g in groups:
        h.put(g.to_bytes())
    first = h.take(2)
    time.sleep(0.4)
    again = h.take(2)  # the expired lease's groups come first, in arrival order
    assert again.group_ids == first.group_ids and again.batch_id != first.batch_id
    assert h.counters.lease_expired == 2
    # the late acknowledgement of the first lease finds them leased again: they stay with the new batch
    assert h.ack([first.batch_id]) == {first.batch_id: "late"}
    assert h.leased_depth() == 2 and h.counters.consumed == 0
    h.ack([again.batch_id])
    assert spooled(tmp_path) == [groups[2].group_id] and h.counters.consumed == 2


def test_a_late_acknowledgement_removes_requeued_groups_not_yet_leased_again(tmp_path):
    h = hub(tmp_path, lease_timeout_s=0.2)
    groups = [make_group(seed=i) for i in range(2)]
    for g in groups:
        h.put(g.to_bytes())
    first = h.take(2)
    time.sleep(0.3)
    assert h.renew([first.batch_id]) == {first.batch_id: "unknown"}  # expired (and requeued) by now
    assert h.depth() == 2
    assert h.ack([first.batch_id]) == {first.batch_id: "late"}
    assert h.depth() == 0 and spooled(tmp_path) == [] and h.counters.consumed == 2


def test_a_late_acknowledgement_of_groups_dropped_as_stale_since_counts_them_consumed(tmp_path):
    """The chaos run's books: a lease expired under a learner that trained it (a hub restart ate its renewals); its
    groups went back to the queue and were dropped as stale; then the late acknowledgement came. They were trained:
    consumed, not dropped, so accepted = consumed + dropped + queued + leased holds over the whole run."""
    h = hub(tmp_path, lease_timeout_s=0.2, max_staleness=1)
    for i in range(3):
        h.put(make_group(version=0, seed=i).to_bytes())
    first = h.take(2)
    time.sleep(0.3)
    assert h.renew([first.batch_id]) == {first.batch_id: "unknown"}   # expired by now: its 2 groups queued again
    assert h.depth() == 3
    assert h.report_version(2) == 3 and h.counters.dropped_stale == 3
    assert h.ack([first.batch_id]) == {first.batch_id: "late"}
    assert h.counters.consumed == 2 and h.counters.dropped_stale == 1   # the third was never leased: dropped
    assert h.ack([first.batch_id]) == {first.batch_id: "already"} and h.counters.consumed == 2
    stats = h.counters
    assert stats.accepted == stats.consumed + stats.dropped_stale + h.depth() + h.leased_depth()


def test_renewing_keeps_a_lease(tmp_path):
    h = hub(tmp_path, lease_timeout_s=0.3)
    h.put(make_group().to_bytes())
    batch = h.take(1)
    for _ in range(3):
        time.sleep(0.15)
        assert h.renew([batch.batch_id]) == {batch.batch_id: "renewed"}
    assert h.take(1) is None and h.counters.lease_expired == 0


def test_a_restart_keeps_leases_and_redelivers_their_groups_once_they_expire(tmp_path):
    first = hub(tmp_path, lease_timeout_s=0.2)
    group = make_group()
    first.put(group.to_bytes())
    old = first.take(1)  # leased, never acknowledged: the hub dies
    second = hub(tmp_path, lease_timeout_s=0.2)
    assert second.take(1) is None and second.leased_depth() == 1   # still leased to the learner that holds it
    time.sleep(0.3)
    again = second.take(1)
    assert again.group_ids == [group.group_id] and again.batch_id != old.batch_id
    assert second.ack([old.batch_id, again.batch_id]) == {old.batch_id: "late", again.batch_id: "acked"}


@pytest.mark.parametrize("poison, reason", [
    (dict(temperature=0.7), "temperature 0.7"),
    (dict(version=2**70), "policy_version"),
    (dict(version=5), "newer than any version"),
    (dict(generator_id="../../etc"), "generator_id"),
])
def test_groups_that_cannot_join_a_batch_are_refused_and_never_take_others_down(tmp_path, poison, reason):
    h = hub(tmp_path, temperature=1.0)
    good = [make_group(seed=i) for i in range(2)]
    h.put(good[0].to_bytes())
    with pytest.raises((GroupRejected, ProtocolError, ValueError), match=reason):
        h.put(make_group(seed=9, **poison).to_bytes())
    h.put(good[1].to_bytes())
    assert h.take(2).group_ids == [g.group_id for g in good]


def _tamper(group: RolloutGroup, **fields) -> bytes:
    """Encode ``group`` with some JSON fields replaced, as a misbehaving client could."""
    tensors = {"prompt_ids": group.prompt_ids, "completion_ids": group.completion_ids,
               "completion_lengths": group.completion_lengths, "behaviour_logprobs": group.behaviour_logprobs,
               "rewards": group.rewards}
    base = {"finish_reasons": group.finish_reasons, "policy_version": 0, "generator_id": "g",
            "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 8}, "task": {},
            "group_id": group.group_id}
    return encode("rollout_group/v1", tensors, {**base, **fields})


@pytest.mark.slow
@pytest.mark.parametrize("fields, reason", [
    ({"group_id": "a/b"}, "group_id"),
    ({"group_id": "x" * 300}, "group_id"),
    ({"group_id": ".."}, "group_id"),
    ({"group_id": 7}, "group_id"),
    ({"policy_version": "3"}, "policy_version"),
    ({"policy_version": 1e300}, "policy_version"),
    ({"sampling": {"temperature": "hot", "top_p": 1.0, "top_k": -1, "max_tokens": 8}}, "temperature"),
    ({"sampling": {"temperature": 1e-300, "top_p": 1.0, "top_k": -1, "max_tokens": 8}}, "temperature"),
    ({"sampling": {"temperature": 1.0, "top_p": 0.0, "top_k": -1, "max_tokens": 8}}, "top_p"),
    ({"sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 2.5, "max_tokens": 8}}, "top_k"),
    ({"sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 8, "seed": 1}}, "seed"),
    ({"sampling": "hot"}, "sampling"),
    ({"finish_reasons": "stop"}, "finish_reasons"),
])
def test_malformed_group_fields_are_4xx_over_http(server_factory, fields, reason):
    live = server_factory(model=False)
    response = live.post("/v1/rollouts", data=_tamper(make_group(), **fields), headers=OCTET)
    assert response.status_code in (400, 422) and reason in str(response.json()["detail"]), response.text
    assert live.get("/v1/hub/stats").json()["queue_depth"] == 0


@pytest.mark.slow
def test_non_finite_behaviour_logprobs_are_refused(server_factory):
    live = server_factory(model=False)
    group = make_group()
    group.behaviour_logprobs[1, 0] = float("nan")
    response = live.post("/v1/rollouts", data=group.to_bytes(), headers=OCTET)
    assert response.status_code == 422 and "finite" in response.json()["detail"]
    padded = make_group()
    padded.behaviour_logprobs[1, 3] = float("nan")  # completion 1 has length 1: position 3 is padding
    assert live.post("/v1/rollouts", data=padded.to_bytes(), headers=OCTET).status_code == 200


@pytest.mark.slow
def test_ack_and_renew_over_http(server_factory):
    live = server_factory(model=False, lease_timeout_s=60)
    client = HubClient(live.url)
    client.upload_group(make_group())
    batch = client.get_batch(1)
    assert client.renew_batches([batch.batch_id]) == {batch.batch_id: "renewed"}
    assert client.ack_batches([batch.batch_id, "other"]) == {batch.batch_id: "acked", "other": "unknown"}
    stats = client.hub_stats()
    assert stats["consumed"] == 1 and stats["leased_groups"] == 0 and stats["lease_timeout_s"] == 60
    bad = live.post("/v1/batch/ack", json={"batch_ids": "abc"})
    assert bad.status_code == 422


def test_batch_std_is_the_learners_business_not_the_hubs(tmp_path):
    """The hub hands out rewards and the group index; no advantages (the learner computes them)."""
    h = hub(tmp_path)
    h.put(make_group(seed=0, rewards=[0.0, 1.0, 0.0, 1.0]).to_bytes())
    h.put(make_group(seed=1, rewards=[0.0, 10.0, 0.0, 10.0]).to_bytes())
    batch = h.take(2)
    assert not hasattr(batch, "advantages")
    assert torch.equal(batch.group_index, torch.tensor([0] * 4 + [1] * 4))
