"""Talking to the hub off the training thread: the next batch is leased while the current one trains, and version
acknowledgements and version reports go out without the training thread waiting for their answer.

:class:`BatchPrefetcher` keeps at most one batch ahead of training. The staleness bound still holds for the batch
trained one step later than leased: the lease names the oldest version the learner can train at the version it
will hold by then (``min_version``), and the hub drops older groups first. Exactly-once delivery is unchanged: the background thread only *leases* and
decodes; the training thread drops the groups it already trained on (:meth:`DeliveryLedger.fresh_part`) when it
takes the batch, after the previous batch is marked trained, exactly where it did before.

Nothing leased is left to expire when the learner stops:

* no batch is leased past the last step (``max_batches``: a learner that stops at ``max_steps`` leases exactly the
  batches it trains, so the hub's books end with nothing leased and nothing expired);
* a batch leased and never trained (the learner is stopped) is handed back (``POST /v1/batch/release``) by
  :meth:`BatchPrefetcher.close`, and so is whatever the long poll in flight at that moment grants: every
  ``GET /v1/batch`` carries a fresh ``request_id``, which the release names. The hub then hands back the lease
  granted to it, or grants nothing under it later, whichever way the grant and the close cross
  (ref_server/hub/leases.py). The close does not wait for the long poll's answer, and a rank that exits right after
  its close leaves nothing behind.

Each helper has its own :class:`HubClient` (a ``requests.Session`` is not meant to be shared between threads).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from learner.delivery import DeliveryLedger
from shared.protocol.client import HubClient, HubUnavailable, RetryPolicy
from shared.protocol.records import TrainBatch

log = logging.getLogger("grpo.learner")


@dataclass
class FetchedBatch:
    batch: TrainBatch
    fetch_s: float       # the HTTP long-poll (waiting for enough groups included), on the background thread
    decode_s: float      # safetensors bytes -> TrainBatch, on the background thread


class BatchPrefetcher:
    """Leases the next batch in a background thread; :meth:`next` hands it to the training thread."""

    def __init__(self, client: HubClient, num_groups: int, wait_s: float, stop: threading.Event,
                 ledger: DeliveryLedger, progress=None, *, max_staleness: int | None = None, start_version: int = 0,
                 version_after_batch: Callable[[], int] | None = None, max_batches: int | None = None) -> None:
        """``max_staleness``: leases ask only for groups within it at the version the batch will be trained at:
        ``start_version`` for the first batch, then ``version_after_batch()`` (asked by the training thread when it
        takes a batch: the version it will hold once that batch is trained, when the next one trains).
        ``max_batches``: the most batches the learner will train (``max_steps`` less the steps done; None: no end):
        none is leased past them (:meth:`set_aside` gives one back)."""
        self.client = client
        self.max_staleness = max_staleness
        self.version_after_batch = version_after_batch
        self._train_version = start_version   # the version the next leased batch will be trained at
        self.num_groups = num_groups
        self.wait_s = wait_s
        self.stop = stop
        self.ledger = ledger
        self.progress = progress          # called with a "waiting for ..." line while the hub has too few groups
        self._ready: queue.Queue[FetchedBatch | BaseException] = queue.Queue(maxsize=1)
        self._slot = threading.Semaphore(1)   # one batch ahead: fetched only once the previous one was taken
        self._closed = threading.Event()
        self.max_batches = max_batches
        self._handed = 0                      # batches handed to the training thread (less those set aside)
        # one lock orders the close against the background thread: the request id of the long poll in flight, the
        # hand-over of a leased batch, the wait for a batch to be wanted
        self._lock = threading.Condition()
        self._in_flight: str | None = None    # request_id of the GET /v1/batch under way
        self._consumer_waiting = threading.Event()  # the training thread is blocked in next(): worth a message
        self._thread = threading.Thread(target=self._run, name="batch-prefetch", daemon=True)
        self._started = False

    # -- the training thread ------------------------------------------------------------------------------
    def next(self, wait_s: float | None = None) -> tuple[TrainBatch, FetchedBatch] | tuple[None, None] | None:
        """The next batch with untrained groups (and how it was fetched), or (None, None) once ``stop`` is set;
        None when none came within ``wait_s`` (ask again).

        Raises what the background thread raised (HubUnavailable: the hub stayed unreachable)."""
        if not self._started:
            self._started = True
            self._thread.start()
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while not self.stop.is_set():
            try:
                item = self._ready.get(timeout=0.1)
            except queue.Empty:
                self._consumer_waiting.set()
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            self._consumer_waiting.clear()
            if isinstance(item, BaseException):
                self._slot.release()
                raise item
            fresh = self.ledger.fresh_part(item.batch)   # after the previous batch was marked trained
            if fresh is not None and self.version_after_batch is not None:
                self._train_version = self.version_after_batch()  # before the next lease is asked for
            if fresh is not None:
                with self._lock:
                    self._handed += 1   # before the slot: the background thread asks whether another is wanted
            self._slot.release()          # the background thread may lease the one after it now
            if fresh is not None:
                return fresh, item
        return None, None

    def min_version(self) -> int | None:
        """The oldest policy version the next leased batch may hold (None: no bound asked for)."""
        if self.max_staleness is None:
            return None
        return max(0, self._train_version - self.max_staleness)

    def give_back(self, batch: TrainBatch) -> None:
        """A batch handed out by :meth:`next` that will not be trained (another rank stopped): back to the hub."""
        self._release([batch.batch_id], [])
        self.set_aside()

    def set_aside(self) -> None:
        """A batch handed out by :meth:`next` will not be trained (it cannot be): one more is wanted."""
        with self._lock:
            self._handed -= 1
            self._lock.notify_all()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop fetching. A batch leased and not handed out goes back to the hub's queue, and so does whatever the
        long poll in flight is granted (released by its request id, at once: no waiting for its answer)."""
        with self._lock:
            self._closed.set()
            in_flight, self._in_flight = self._in_flight, None
            leased = []
            while True:
                try:
                    item = self._ready.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, FetchedBatch):
                    leased.append(item.batch.batch_id)
            self._lock.notify_all()
        self.client.abort.set()
        self._slot.release()
        if leased or in_flight is not None:
            self._release(leased, [in_flight] if in_flight is not None else [])
        if self._started:
            self._thread.join(timeout=timeout_s)  # only tidiness: nothing it can still be granted stays leased
            if self._thread.is_alive():
                log.info("the batch prefetch thread is still in a hub request (its grant was handed back)")
        self.client.close()

    # -- the background thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        started = time.monotonic()
        while not self._closed.is_set():
            self._slot.acquire()
            if not self._wanted():
                return
            try:
                fetched = self._fetch_until_ready(started)
            except Exception as exc:  # noqa: BLE001 - handed to the training thread, which raises it
                if not (self._closed.is_set() or (isinstance(exc, HubUnavailable) and self.stop.is_set())):
                    self._ready.put(exc)
                return
            if fetched is None:
                return
            with self._lock:   # handed over, or (closed meanwhile) already handed back by its request id
                self._in_flight = None
                if self._closed.is_set():
                    return
                self.ledger.leased(fetched.batch.batch_id)  # renewed until it is trained or handed back
                self._ready.put_nowait(fetched)   # room: the slot was free
            started = time.monotonic()

    def _wanted(self) -> bool:
        """Wait until another batch is wanted (not past ``max_batches``); False once closed."""
        with self._lock:
            while not self._closed.is_set() and self.max_batches is not None and self._handed >= self.max_batches:
                self._lock.wait(0.5)
            return not self._closed.is_set()

    def _fetch_until_ready(self, started: float) -> FetchedBatch | None:
        """The next batch, its request id still in flight (the caller hands it over under the lock); None once
        closed or stopped."""
        while not self.stop.is_set():
            request_id = uuid.uuid4().hex
            with self._lock:
                if self._closed.is_set():
                    return None
                self._in_flight = request_id   # from here a close releases whatever this request is granted
            t0 = time.perf_counter()
            data = self.client.lease_batch(self.num_groups, wait_s=self.wait_s, min_version=self.min_version(),
                                           request_id=request_id)  # the bytes: decoding is timed apart
            t1 = time.perf_counter()
            if data is not None:
                batch = TrainBatch.from_bytes(data)
                return FetchedBatch(batch, fetch_s=t1 - t0, decode_s=time.perf_counter() - t1)
            with self._lock:
                self._in_flight = None
            if self.progress is not None and self._consumer_waiting.is_set() and not self._closed.is_set():
                stats = self.client.hub_stats()
                self.progress(f"waiting for {self.num_groups} groups: hub holds {stats['ready']} ready of "
                              f"{stats['queue_depth']} queued, waited {time.monotonic() - started:.0f}s"
                              + scoring_waits(stats))
        return None

    def _release(self, batch_ids: list[str], request_ids: list[str]) -> None:
        """Hand untrained leases back, by batch id and by the request id of a long poll in flight (one attempt: if
        it fails, the leases expire on the hub instead). Its own client: the background thread may still be in a
        request on the prefetcher's."""
        for batch_id in batch_ids:
            self.ledger.forget(batch_id)
        try:
            with self.client.sibling(timeout_s=10, retry=RetryPolicy(max_retry_s=0)) as client:
                client.release_batches(batch_ids, request_ids)
        except Exception as exc:  # noqa: BLE001 - logged; the hub's lease timeout returns the groups anyway
            log.warning("could not hand batches %s (requests %s) back to the hub (%s); their groups return after "
                        "the lease timeout", batch_ids, request_ids, exc)


class HubCalls:
    """Hub calls whose answer the training thread does not need right away (acknowledgements, lease renewals,
    version reports), made in order by one background thread with its own client.

    A call that fails is raised on the training thread at its next :meth:`submit` or :meth:`flush`, so a hub
    that stays unreachable still stops the learner, one step later instead of in the middle of one."""

    def __init__(self, client: HubClient) -> None:
        self.client = client
        self._calls: queue.Queue = queue.Queue()
        self._idle = threading.Condition()
        self._pending = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hub-calls", daemon=True)
        self._thread.start()

    def submit(self, call) -> None:
        """Queue ``call(client)``; returns at once."""
        self._raise()
        with self._idle:
            self._pending += 1
        self._calls.put(call)

    def flush(self, timeout_s: float = 60.0) -> None:
        """Wait until every queued call is made (before a checkpoint or the learner's exit)."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._pending and self.error is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{self._pending} hub calls still queued after {timeout_s:.0f}s")
                self._idle.wait(timeout=min(remaining, 0.5))
        self._raise()

    def close(self) -> None:
        self._calls.put(None)
        self._thread.join(timeout=30)
        self.client.close()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            if self.error is None:  # after a failure the rest is dropped: the training thread raises it
                try:
                    call(self.client)
                except Exception as exc:  # noqa: BLE001 - re-raised on the training thread
                    self.error = exc
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()


def scoring_waits(stats: dict) -> str:
    """What the hub's unready groups wait for, from its stats (``scoring_pools``; absent on an older hub): e.g.
    "; 12 wait for the teacher's logprobs (no scorer for 40s)" ('' when nothing waits)."""
    parts = []
    for role, pool in (stats.get("scoring_pools") or {}).items():
        if pool.get("groups"):
            who = f"no scorer for {pool['down_s']:.0f}s" if pool.get("down_s") else f"scoring: {pool['scoring']}"
            parts.append(f"; {pool['groups']} wait for the {role}'s logprobs ({who})")
    return "".join(parts)
