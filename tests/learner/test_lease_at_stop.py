"""A learner that stops leaves nothing leased on the hub (issue 27: every multi-node run ended with lease_expired 4).

* A learner stopping at ``max_steps`` leases exactly the batches it trains: none past its last step, so nothing is
  handed back or left to expire (the cause of the 4: each rank's prefetch thread leased one batch past the end and
  handed it back, which the hub counts in ``lease_expired``).
* A prefetcher closed while its long poll is being granted hands the grant back at once, by the request id the
  long poll carried, without waiting for the answer: even when the answer is never read (here a decode that does not
  return, as for a rank that exits right after its close), and however the grant and the close cross (repeated with
  random timings). The lease timeout is 300 s, so nothing in these tests comes back by expiry.
* The hub's half (ref_server/hub/leases.py): a request id released before its take grants nothing; released after,
  it hands back what was granted, every grant of a retried take included.
"""

import random
import threading
import time

import pytest

from learner import prefetch
from learner.delivery import DeliveryLedger
from learner.prefetch import BatchPrefetcher
from ref_server.hub.rollout_hub import RolloutHub
from shared.protocol.client import HubClient, RetryPolicy
from shared.protocol.records import TrainBatch
from tests.live_server import LiveServer, make_config
from tests.ref_server.helpers import make_group

from .test_prefetch import wait_until
from .test_publish_resume import fill_hub, learner_config, run_learner


@pytest.fixture
def live(tmp_path):
    with LiveServer(make_config(tmp_path, lease_timeout_s=300.0)) as server:
        yield server


def prefetcher(url, ledger, wait_s):
    return BatchPrefetcher(HubClient(url, retry=RetryPolicy(max_retry_s=30.0)), 2, wait_s, threading.Event(), ledger)


def no_failed_delivery(hub) -> bool:
    """A handed-back lease is no failed delivery: no queued group counts one (a lease expiry would)."""
    with hub.queue.cond:
        return all(entry.failures == 0 for entry in hub.queue.groups.values())


class StalledDecode:
    """TrainBatch as the prefetcher sees it, whose decode blocks from the ``stall_from``-th call until ``gate`` is set:
    the grant was written by the hub and is never read in time."""

    def __init__(self, stall_from: int) -> None:
        self.calls, self.stall_from = 0, stall_from
        self.entered, self.gate = threading.Event(), threading.Event()

    def from_bytes(self, data: bytes) -> TrainBatch:
        self.calls += 1
        if self.calls >= self.stall_from:
            self.entered.set()
            self.gate.wait(60)
        return TrainBatch.from_bytes(data)


@pytest.mark.slow
def test_a_grant_the_closing_prefetcher_never_reads_is_handed_back_at_once(live, monkeypatch):
    hub, client = live.state.hub, HubClient(live.url)
    stalled = StalledDecode(stall_from=2)
    monkeypatch.setattr(prefetch, "TrainBatch", stalled)
    groups = [make_group(seed=seed) for seed in range(4)]
    for group in groups[:2]:
        client.upload_group(group)
    ledger = DeliveryLedger(client, ack_on_checkpoint=False, lease_timeout_s=300.0)
    fetch = prefetcher(live.url, ledger, wait_s=5.0)
    try:
        training, _ = fetch.next()
        for group in groups[2:]:   # the long poll in flight is granted these; its answer is never read
            client.upload_group(group)
        wait_until(stalled.entered.is_set)
        assert hub.leased_depth() == 4
        started = time.monotonic()
        fetch.close(timeout_s=0.5)
        assert time.monotonic() - started < 3.0   # no waiting for the long poll's answer
        # at once: only the batch in training is still leased; the grant is queued again, first in line
        assert hub.leased_depth() == 2 and hub.depth() == 2 and no_failed_delivery(hub)
    finally:
        stalled.gate.set()
    assert client.get_batch(2).group_ids == [g.group_id for g in groups[2:]]
    assert training.group_ids == [g.group_id for g in groups[:2]]


@pytest.mark.slow
def test_a_close_crossing_the_grant_leaves_nothing_leased_whatever_the_timing(live):
    hub, client = live.state.hub, HubClient(live.url)
    rng = random.Random(27)
    seeds = iter(range(10_000))
    for _ in range(25):
        for _ in range(2):
            client.upload_group(make_group(seed=next(seeds)))
        fetch = prefetcher(live.url, DeliveryLedger(client, ack_on_checkpoint=False, lease_timeout_s=300.0), 2.0)
        training, _ = fetch.next()
        client.ack_batches([training.batch_id])           # trained: the hub holds nothing of it any more
        wait_until(lambda: hub.leased_depth() == 0)
        late = [make_group(seed=next(seeds)) for _ in range(2)]
        # the next batch arrives while the prefetcher's long poll waits, around the moment it is closed
        uploader = threading.Timer(rng.uniform(0.0, 0.06), lambda late=late: [client.upload_group(g) for g in late])
        uploader.start()
        time.sleep(rng.uniform(0.0, 0.06))
        fetch.close(timeout_s=0.2)
        uploader.join()
        assert hub.leased_depth() == 0 and hub.depth() == 2 and no_failed_delivery(hub), hub.counters
        assert client.get_batch(2).group_ids == [g.group_id for g in late]   # first in line, never trained
        client.ack_batches(list(hub.leases.held))
    assert hub.counters.consumed == 100 and hub.leased_depth() == 0 and hub.depth() == 0


def test_the_hub_grants_nothing_under_a_released_request_id_and_hands_back_what_it_granted():
    hub = RolloutHub(capacity=16, max_staleness=4, scorer=None, lease_timeout_s=300.0)
    for seed in range(6):
        hub.put(make_group(seed=seed).to_bytes())
    assert hub.release([], ["early"]) == {"early": "cancelled"}
    assert hub.take(2, request_id="early") is None and hub.leased_depth() == 0  # released before its grant
    granted = hub.take(2, request_id="late")
    retried = hub.take(2, request_id="late")   # the same call retried after its answer was lost
    assert granted is not None and retried is not None and hub.leased_depth() == 4
    assert hub.release([], ["late"]) == {"late": "released"}
    assert hub.leased_depth() == 0 and hub.depth() == 6
    assert hub.take(2, request_id="late") is None   # and grants nothing more under it
    with hub.queue.cond:
        assert all(entry.failures == 0 for entry in hub.queue.groups.values())   # handed back, not failed


@pytest.mark.slow
def test_a_learner_stopping_at_max_steps_leases_nothing_past_its_last_step(tiny_model_dir, tmp_path):
    with LiveServer(make_config(tmp_path, None, lease_timeout_s=300.0)) as live:
        fill_hub(live.url, tiny_model_dir, 6)   # more than the two steps take
        config = learner_config(tmp_path, live.url, tiny_model_dir, beta=0.0, max_steps=2)
        result = run_learner(config)
        assert result.returncode == 0, result.stderr[-3000:]
        stats = live.get("/v1/hub/stats").json()
    # the two trained batches were acknowledged; the third stayed queued, never leased, nothing expired
    assert (stats["leased"], stats["consumed"], stats["queue_depth"]) == (4, 4, 2), stats
    assert stats["lease_expired"] == 0 and stats["leased_groups"] == 0, stats
