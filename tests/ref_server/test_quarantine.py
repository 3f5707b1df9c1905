"""Poison pills: a group whose leases keep expiring untrained (a learner that crashes on it) is isolated and then
quarantined after ``max_deliveries`` failed deliveries, while the good groups it was batched with train."""

import re
import time

import pytest

from ref_server.hub.rollout_hub import RolloutHub
from shared.protocol.client import HubClient

from .helpers import make_group

LEASE_S = 0.1


def hub(spool, **kw) -> RolloutHub:
    return RolloutHub(capacity=16, max_staleness=4, scorer=None, spool_dir=spool, lease_timeout_s=LEASE_S, **kw)


def crashing_learner(take, ack, poison: str, batch_size: int, rounds: int) -> list[list[str]]:
    """A learner that crashes on every batch holding ``poison`` (never acknowledges it) and trains the others;
    returns the group ids of each batch it was handed."""
    seen = []
    for _ in range(rounds):
        batch = take(batch_size)
        if batch is None:
            break
        seen.append(batch.group_ids)
        if poison not in batch.group_ids:
            ack([batch.batch_id])
        time.sleep(LEASE_S * 1.5)   # past the lease timeout: a crashed learner's lease expires
    return seen


def test_a_poison_group_is_isolated_then_quarantined_while_the_good_ones_train(tmp_path):
    h = hub(tmp_path)
    groups = [make_group(seed=i) for i in range(4)]
    for g in groups:
        h.put(g.to_bytes())
    ids = [g.group_id for g in groups]
    poison = ids[2]
    seen = crashing_learner(lambda n: h.take(n), h.ack, poison, batch_size=4, rounds=10)
    # two failed deliveries of the whole batch, then one group at a time: the good ones train, the poison fails a
    # third time alone and is quarantined; nothing is left to deliver
    assert seen == [ids, ids, [ids[0]], [ids[1]], [ids[2]], [ids[3]]]
    c = h.counters
    assert (c.consumed, c.quarantined, c.lease_expired) == (3, 1, 4 + 4 + 1)
    assert h.depth() == 0 and h.leased_depth() == 0
    assert list(tmp_path.glob("*.group")) == []
    quarantined = list((tmp_path / "quarantine").glob("*.group"))
    assert [p.name.split("-", 1)[1] for p in quarantined] == [f"{poison}.group"]
    reason = (tmp_path / "quarantine" / f"{quarantined[0].name}.reason").read_text()
    assert reason == ("3 leases expired or were held at shutdown untrained and unacknowledged (the last one alone), "
                      "ref_server.max_deliveries is 3\n")
    # a restart over the same spool keeps it quarantined: nothing is reloaded, the file stays
    again = hub(tmp_path)
    assert again.depth() == 0 and again.counters.spool_reloaded == 0
    assert (tmp_path / "quarantine" / quarantined[0].name).exists()


def test_a_group_that_crashes_the_learner_on_every_restart_is_quarantined_across_hub_restarts(tmp_path):
    """``grpo run`` stops every service when the learner dies: the hub shuts down cleanly holding the lease, and
    counts it as a failed delivery beside the spool file, so the count survives the restart."""
    groups = [make_group(seed=i) for i in range(4)]
    first = hub(tmp_path)
    for g in groups:
        first.put(g.to_bytes())
    ids = [g.group_id for g in groups]
    poison, runs, h = ids[1], [], first
    for _ in range(5):
        handed = []
        while (batch := h.take(4)) is not None:
            handed.append(batch.group_ids)
            if poison in batch.group_ids:
                break                              # the learner crashes: the run stops, the hub shuts down cleanly
            h.ack([batch.batch_id])
        runs.append(handed)
        h.close()
        h = hub(tmp_path)
    assert runs == [[ids], [ids], [[ids[0]], [ids[1]]], [[ids[2]], [ids[3]]], []]
    assert h.counters.quarantined == 0 and h.depth() == 0      # quarantined at the fourth start, counted there
    assert [p.name.split("-", 1)[1] for p in (tmp_path / "quarantine").glob("*.group")] == [f"{poison}.group"]
    assert list(tmp_path.glob("*.group*")) == []               # no group file and no count left behind


def test_a_hub_killed_outright_counts_nothing_against_the_groups_it_had_leased(tmp_path):
    h = hub(tmp_path, max_deliveries=1)
    h.put(make_group(seed=0).to_bytes())
    assert h.take(1) is not None
    again = hub(tmp_path, max_deliveries=1)      # no close(): a kill -9 of the hub
    assert again.depth() == 0 and again.leased_depth() == 1   # the lease is held again after the restart
    time.sleep(LEASE_S * 1.5)                    # its learner went with the hub: the restored lease expires unrenewed
    assert again.take(1) is not None and again.counters.quarantined == 0


def test_handed_back_and_trained_leases_are_not_failed_deliveries(tmp_path):
    h = hub(tmp_path, max_deliveries=1)    # any failed delivery would quarantine at once
    for i in range(2):
        h.put(make_group(seed=i).to_bytes())
    batch = h.take(2)
    h.release([batch.batch_id])            # a stopping learner hands it back
    batch = h.take(2)
    h.renew([batch.batch_id], trained=True)  # trained, waiting for a checkpoint, and then the learner dies
    time.sleep(LEASE_S * 1.5)
    again = h.take(2)
    assert again is not None and again.group_ids == batch.group_ids
    assert h.counters.quarantined == 0 and h.counters.lease_expired == 4
    time.sleep(LEASE_S * 1.5)              # untrained and expired: with max_deliveries 1, both are quarantined
    assert h.take(2) is None and h.counters.quarantined == 2 and h.depth() == 0


@pytest.mark.parametrize(("max_deliveries", "expected"), [
    (2, lambda ids: [ids, [ids[0]], [ids[1]], [ids[2]]]),            # one failure: already alone
    (4, lambda ids: [ids, ids, ids, [ids[0]], [ids[1]], [ids[2]]]),
])
def test_max_deliveries_sets_when_a_group_is_isolated_and_quarantined(tmp_path, max_deliveries, expected):
    h = hub(tmp_path, max_deliveries=max_deliveries)
    groups = [make_group(seed=i) for i in range(3)]
    for g in groups:
        h.put(g.to_bytes())
    ids = [g.group_id for g in groups]
    seen = crashing_learner(lambda n: h.take(n), h.ack, ids[1], batch_size=3, rounds=12)
    assert seen == expected(ids)
    assert h.counters.consumed == 2 and h.counters.quarantined == 1


@pytest.mark.slow
def test_over_http_a_poison_group_is_quarantined_counted_and_the_rest_trains(server_factory, tmp_path):
    live = server_factory(model=False, lease_timeout_s=0.5, path=tmp_path)
    client = HubClient(live.url)
    groups = [make_group(seed=i) for i in range(6)]
    client.upload_groups(groups)
    ids = [g.group_id for g in groups]
    trained: list[str] = []
    deadline = time.monotonic() + 30
    while len(trained) < 5 and time.monotonic() < deadline:
        batch = client.get_batch(3, wait_s=1.0)
        if batch is None:
            continue
        if ids[4] in batch.group_ids:     # the learner crashes on it: no acknowledgement, a fresh client next
            client = HubClient(live.url)
            time.sleep(0.6)
            continue
        trained += batch.group_ids
        client.ack_batches([batch.batch_id])
    assert sorted(trained) == sorted(ids[:4] + ids[5:])          # every good group trained once
    time.sleep(0.6)
    assert client.get_batch(1, wait_s=1.5) is None                # the poison is never delivered again
    stats = live.get("/v1/hub/stats").json()
    assert stats["quarantined"] == 1 and stats["consumed"] == 5 and stats["queue_depth"] == 0
    metrics = live.get("/metrics").text
    assert re.search(r'grpo_hub_groups\{event="quarantined"\} 1\.0', metrics)
    assert [p.name.split("-", 1)[1] for p in (tmp_path / "spool" / "quarantine").glob("*.group")] == \
        [f"{ids[4]}.group"]


@pytest.mark.parametrize("spool", ["none", "file gone"])
def test_quarantine_without_a_spool_file_still_counts_and_never_fails_the_lease_request(tmp_path, spool):
    h = hub(None if spool == "none" else tmp_path, max_deliveries=1)
    h.put(make_group(seed=0).to_bytes())
    assert h.take(1) is not None
    for path in tmp_path.glob("*.group"):
        path.unlink()                       # removed behind the hub's back
    time.sleep(LEASE_S * 1.5)
    assert h.take(1) is None and h.counters.quarantined == 1 and h.depth() == 0
