"""The delivery ledger's renewal timer and held redeliveries, with a real HubClient against a live hub on 127.0.0.1
whose leases time out after a second: a learner that waits (for groups, a checkpoint, a publish) keeps the leases
of what it trained, and a trained group that comes back is never acknowledged before a checkpoint holds it."""

import time

import pytest

from learner.delivery import DeliveryLedger
from learner.prefetch import HubCalls
from shared.protocol.client import HubClient
from tests.live_server import LiveServer, make_config
from tests.ref_server.helpers import make_group

LEASE_S = 1.0


@pytest.fixture
def live(tmp_path):
    with LiveServer(make_config(tmp_path, lease_timeout_s=LEASE_S)) as server:
        yield server


def upload(url, seeds):
    client = HubClient(url)
    groups = [make_group(seed=s) for s in seeds]
    for group in groups:
        client.upload_group(group)
    return [g.group_id for g in groups]


def expire_now(hub, batch_id):
    """A lease lost despite the renewals (a hub restart, a lost renewal): what the timer cannot prevent."""
    with hub.queue.cond:
        hub.leases.held[batch_id].deadline = 0.0
        hub.leases.expire_locked()


@pytest.mark.slow
@pytest.mark.parametrize("through_calls", [False, True])
def test_the_timer_keeps_trained_leases_while_the_learner_waits(live, through_calls):
    """Three lease timeouts without a single ledger call from the training thread: the trained batch stays leased,
    nothing expires; the checkpoint acknowledges it; close() stops the timer at once and renewals stop."""
    ids = upload(live.url, range(2))
    hub = live.state.hub
    calls = HubCalls(HubClient(live.url)) if through_calls else None
    ledger = DeliveryLedger(HubClient(live.url), ack_on_checkpoint=True, lease_timeout_s=LEASE_S,
                            calls=calls.submit if calls else None).start()
    try:
        batch = ledger.fresh_part(HubClient(live.url).get_batch(2))
        assert batch.group_ids == ids
        ledger.trained(batch)
        time.sleep(3 * LEASE_S + 0.5)  # the learner waits for groups that do not come
        assert hub.counters.lease_expired == 0 and hub.leased_depth() == 2 and hub.counters.consumed == 0
        assert ledger.renewals >= 8  # every third of a lease timeout, for 3.5 s: 10 expected
        ledger.checkpointed()
        if calls:
            calls.flush()
        assert hub.counters.consumed == 2 and hub.leased_depth() == 0 and hub.depth() == 0
    finally:
        started = time.monotonic()
        ledger.close()
        assert time.monotonic() - started < LEASE_S  # a clean stop: the timer wakes up for it
        if calls:
            calls.close()
    assert not ledger._timer.is_alive()
    renewals = ledger.renewals
    time.sleep(LEASE_S)
    assert ledger.renewals == renewals


@pytest.mark.slow
def test_untrained_leases_are_kept_too_and_forgotten_when_handed_back(live):
    upload(live.url, range(2))
    hub = live.state.hub
    ledger = DeliveryLedger(HubClient(live.url), ack_on_checkpoint=True, lease_timeout_s=LEASE_S).start()
    try:
        batch = HubClient(live.url).get_batch(2)
        ledger.leased(batch.batch_id)  # what the prefetcher does: a step longer than the lease timeout keeps it
        time.sleep(2 * LEASE_S + 0.5)
        assert hub.counters.lease_expired == 0 and hub.leased_depth() == 2
        assert not hub.leases.held[batch.batch_id].trained  # renewed as untrained: it still paces generators
        ledger.forget(batch.batch_id)  # handed back (a stopping learner): no longer renewed, it expires
        time.sleep(LEASE_S + 0.5)
        with hub.queue.cond:
            hub.leases.expire_locked()
        assert hub.counters.lease_expired == 2 and hub.depth() == 2
    finally:
        ledger.close()


@pytest.mark.slow
def test_a_trained_group_that_comes_back_is_held_until_the_checkpoint(live):
    """The trained lease expires anyway; its groups come back in another batch. That batch is dropped (never
    trained twice) but held, not acknowledged: a crash before the checkpoint leaves the groups on the hub, and a
    learner resumed from the earlier checkpoint trains them once. A checkpoint instead acknowledges both."""
    ids = upload(live.url, range(2))
    hub = live.state.hub
    client = HubClient(live.url)
    ledger = DeliveryLedger(client, ack_on_checkpoint=True, lease_timeout_s=LEASE_S).start()
    first = ledger.fresh_part(client.get_batch(2))
    ledger.trained(first)
    expire_now(hub, first.batch_id)
    again = client.get_batch(2)
    assert again.group_ids == ids and again.batch_id != first.batch_id
    assert ledger.fresh_part(again) is None and ledger.duplicates == 2
    time.sleep(2 * LEASE_S)  # the held redelivery is renewed like a trained batch
    assert hub.counters.consumed == 0 and hub.leased_depth() == 2 and hub.leases.held[again.batch_id].trained
    assert set(ledger.held()) == {first.batch_id, again.batch_id}
    ledger.close()  # the learner crashes before its checkpoint: nothing was acknowledged
    expire_now(hub, again.batch_id)
    resumed = DeliveryLedger(client, ack_on_checkpoint=True, lease_timeout_s=LEASE_S, consumed=[]).start()
    try:
        batch = resumed.fresh_part(client.get_batch(2, wait_s=5))
        assert batch.group_ids == ids  # 0 lost: trained once more by the resumed learner, whose checkpoint lacked them
        resumed.trained(batch)
        resumed.checkpointed()
    finally:
        resumed.close()
    assert hub.counters.consumed == 2 and hub.depth() == 0 and hub.leased_depth() == 0


@pytest.mark.slow
def test_a_checkpoint_acknowledges_the_held_redelivery_and_the_expired_lease(live):
    ids = upload(live.url, range(4))
    hub = live.state.hub
    client = HubClient(live.url)
    ledger = DeliveryLedger(client, ack_on_checkpoint=True, lease_timeout_s=LEASE_S)
    first = ledger.fresh_part(client.get_batch(2))
    ledger.trained(first)
    expire_now(hub, first.batch_id)
    # the redelivered pair arrives with two fresh groups: the fresh ones are trained, the batch is held
    mixed = client.get_batch(4)
    assert mixed.group_ids == ids
    fresh = ledger.fresh_part(mixed)
    assert fresh.group_ids == ids[2:] and fresh.batch_id == mixed.batch_id
    ledger.trained(fresh)
    assert hub.counters.consumed == 0
    ledger.checkpointed()
    assert ledger.held() == [] and hub.counters.consumed == 4 and hub.leased_depth() == 0 and hub.depth() == 0


def test_the_renewal_timer_needs_no_hub_while_nothing_is_held():
    """No hub at all: with nothing held the timer makes no call, and stops cleanly."""
    ledger = DeliveryLedger(HubClient("http://127.0.0.1:9"), ack_on_checkpoint=True, lease_timeout_s=0.03).start()
    time.sleep(0.2)
    ledger.close()
    assert ledger.renewals == 0 and not ledger._timer.is_alive()


@pytest.mark.slow
def test_a_checkpoint_still_names_batches_whose_acknowledgement_has_not_been_answered(live):
    """The chaos run's books: a checkpoint freed a batch for acknowledgement, the acknowledgement waited on the
    background thread, and the learner was killed with the next checkpoint written. That checkpoint must still name
    the batch, or the resumed learner's hand-over releases its lease and the hub drops groups the lineage trained."""
    upload(live.url, range(2))
    queued = []   # the background thread that sends hub calls, stalled
    ledger = DeliveryLedger(HubClient(live.url), ack_on_checkpoint=True, lease_timeout_s=LEASE_S,
                            calls=queued.append)
    batch = ledger.fresh_part(HubClient(live.url).get_batch(2))
    ledger.trained(batch)
    assert ledger.unacknowledged() == [batch.batch_id]
    ledger.checkpointed()                                    # its acknowledgement is queued, not sent
    assert ledger.unacknowledged() == [batch.batch_id]      # what the next checkpoint writes
    client = HubClient(live.url)
    for call in queued:
        call(client)                                         # sent and answered
    assert ledger.unacknowledged() == [] and live.state.hub.counters.consumed == 2
