"""The batch prefetcher against a real hub on 127.0.0.1: one batch ahead of training, exactly-once training with
the delivery ledger, leases handed back on stop, an unreachable hub raised on the training thread."""

import threading
import time

import pytest

from learner.delivery import DeliveryLedger
from learner.prefetch import BatchPrefetcher, HubCalls
from shared.protocol.client import HubClient, HubError, HubUnavailable, RetryPolicy
from tests.live_server import LiveServer, make_config
from tests.ref_server.helpers import make_group


def wait_until(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


@pytest.fixture
def live(tmp_path):
    with LiveServer(make_config(tmp_path, lease_timeout_s=300.0)) as server:
        yield server


def prefetcher(url, stop, ledger, groups=2, wait_s=0.5, retry_s=30.0):
    return BatchPrefetcher(HubClient(url, retry=RetryPolicy(max_retry_s=retry_s)), groups, wait_s, stop, ledger)


@pytest.mark.slow
def test_one_batch_is_leased_ahead_and_every_group_is_trained_exactly_once(live):
    client = HubClient(live.url)
    groups = [make_group(seed=i) for i in range(8)]
    for g in groups:
        client.upload_group(g)
    hub = live.state.hub
    calls = HubCalls(HubClient(live.url))  # acknowledgements from a background thread, as the learner sends them
    ledger = DeliveryLedger(client, ack_on_checkpoint=True, lease_timeout_s=300.0, calls=calls.submit)
    stop = threading.Event()
    fetch = prefetcher(live.url, stop, ledger)
    try:
        first, fetched = fetch.next()
        assert fetched.fetch_s > 0 and fetched.decode_s > 0
        # while the first batch "trains", the next one is leased, and no more than that
        wait_until(lambda: hub.leased_depth() == 4)
        time.sleep(0.2)
        assert hub.leased_depth() == 4 and hub.depth() == 4
        ledger.trained(first)
        trained = list(first.group_ids)
        with hub.queue.cond:  # the trained, not yet acknowledged lease is lost (a learner slower than the lease)
            hub.leases.held[first.batch_id].deadline = 0.0
            hub.leases.expire_locked()  # its groups are the next batch the prefetcher leases
        while len(trained) < 8:
            batch, _ = fetch.next()
            trained += batch.group_ids
            ledger.trained(batch)
        ledger.checkpointed()
        calls.flush()
    finally:
        fetch.close()
        calls.close()
    assert sorted(trained) == sorted(g.group_id for g in groups) and len(trained) == 8
    assert ledger.duplicates == 2  # the re-delivered copy was dropped, never trained again
    assert hub.counters.consumed == 8 and hub.depth() == 0 and hub.leased_depth() == 0


@pytest.mark.slow
def test_stop_hands_the_prefetched_lease_back_at_once(live):
    client = HubClient(live.url)
    groups = [make_group(seed=i) for i in range(4)]
    for g in groups:
        client.upload_group(g)
    hub = live.state.hub
    ledger = DeliveryLedger(client, ack_on_checkpoint=False, lease_timeout_s=300.0)
    stop = threading.Event()
    fetch = prefetcher(live.url, stop, ledger)
    batch, _ = fetch.next()
    wait_until(lambda: hub.leased_depth() == 4)  # the second batch is prefetched
    ledger.trained(batch)
    stop.set()
    assert fetch.next() == (None, None)
    fetch.close()
    # the untrained batch is queued again now (the lease timeout is 300 s), first in line
    assert hub.leased_depth() == 0 and hub.depth() == 2
    assert client.get_batch(2).group_ids == [g.group_id for g in groups[2:]]


@pytest.mark.slow
def test_stop_while_waiting_for_groups_returns_none_and_leaves_the_hub_untouched(live):
    client = HubClient(live.url)
    client.upload_group(make_group(seed=0))  # fewer than a batch
    stop = threading.Event()
    fetch = prefetcher(live.url, stop, DeliveryLedger(client, ack_on_checkpoint=False, lease_timeout_s=300.0))
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    assert fetch.next() == (None, None) and time.monotonic() - started < 5
    fetch.close()
    assert live.state.hub.depth() == 1 and live.state.hub.leased_depth() == 0


@pytest.mark.slow
def test_an_unreachable_hub_is_raised_on_the_training_thread(tmp_path):
    server = LiveServer(make_config(tmp_path))
    with server:
        url = server.url
    client = HubClient(url, retry=RetryPolicy(max_retry_s=0.5))
    fetch = prefetcher(url, threading.Event(), DeliveryLedger(client, ack_on_checkpoint=False, lease_timeout_s=300),
                       retry_s=0.5)
    with pytest.raises(HubUnavailable):
        fetch.next()
    fetch.close()


@pytest.mark.slow
def test_hub_calls_are_made_in_order_and_a_failure_surfaces_on_the_training_thread(live):
    calls = HubCalls(HubClient(live.url))
    hub = live.state.hub
    try:
        for version in (1, 2, 3):
            calls.submit(lambda client, v=version: client.report_version(v))  # returns at once
        calls.flush()
        assert hub.learner_version == 3
        hub.report_version(10)
        calls.submit(lambda client: client.report_version(4))  # older than the hub's: 409
        with pytest.raises(HubError) as failure:
            calls.flush()
        assert failure.value.status == 409
        with pytest.raises(HubError):  # and at the next call, which is not made
            calls.submit(lambda client: client.report_version(11))
        assert hub.learner_version == 10
    finally:
        calls.close()


@pytest.mark.slow
def test_each_lease_asks_for_groups_fit_for_the_version_it_will_be_trained_at(live):
    """Prefetching trains a batch one version after it was leased: the lease names the oldest version allowed at
    the version the learner will hold then, so max_staleness holds for what is trained."""
    client = HubClient(live.url)
    client.report_version(3)
    for i, version in enumerate([0, 1, 2, 2, 2, 3, 3]):
        client.upload_group(make_group(version=version, seed=i))
    ledger = DeliveryLedger(client, ack_on_checkpoint=False, lease_timeout_s=300.0)
    stop = threading.Event()
    fetch = BatchPrefetcher(HubClient(live.url), 2, 0.5, stop, ledger, max_staleness=1, start_version=3,
                            version_after_batch=lambda: 4)
    try:
        first, _ = fetch.next()  # trained at version 3: versions 2 and 3 only
        assert first.policy_versions.unique().tolist() == [2]
        wait_until(lambda: live.state.hub.leased_depth() == 4)  # the next one, leased while the first trains
        ledger.trained(first)
        second, _ = fetch.next()  # trained at version 4: the third version-2 group is stale for it
        assert second.policy_versions.unique().tolist() == [3]
        assert live.state.hub.counters.dropped_stale == 3
    finally:
        stop.set()
        fetch.close()
