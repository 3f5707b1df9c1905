"""Talking to the hub off the training thread: the next batch is leased while the current one trains, and version
reports go out without the training thread waiting for their answer.

:class:`BatchPrefetcher` keeps at most one batch ahead of training (so a batch is trained at most one version later
than it would be without prefetching). Exactly-once delivery is unchanged: the background thread only *leases* and
decodes; the training thread drops the groups it already trained on (:meth:`DeliveryLedger.fresh_part`) when it
takes the batch, after the previous batch is marked trained, exactly where it did before. A batch that was leased
and never trained (the learner stops) is handed back to the hub (``POST /v1/batch/release``), so its groups are
delivered again at once instead of after the lease timeout.

Each helper has its own :class:`HubClient` (a ``requests.Session`` is not meant to be shared between threads).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from learner.delivery import DeliveryLedger
from shared.client import HubClient, HubUnavailable
from shared.protocol import TrainBatch

log = logging.getLogger("grpo.learner")


@dataclass
class FetchedBatch:
    batch: TrainBatch
    fetch_s: float       # the HTTP long-poll (waiting for enough groups included), on the background thread
    decode_s: float      # safetensors bytes -> TrainBatch, on the background thread


class BatchPrefetcher:
    """Leases the next batch in a background thread; :meth:`next` hands it to the training thread."""

    def __init__(self, client: HubClient, num_groups: int, wait_s: float, stop: threading.Event,
                 ledger: DeliveryLedger, progress=None) -> None:
        self.client = client
        self.num_groups = num_groups
        self.wait_s = wait_s
        self.stop = stop
        self.ledger = ledger
        self.progress = progress          # called with a "waiting for ..." line while the hub has too few groups
        self._ready: queue.Queue[FetchedBatch | BaseException] = queue.Queue(maxsize=1)
        self._slot = threading.Semaphore(1)   # one batch ahead: fetched only once the previous one was taken
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batch-prefetch", daemon=True)
        self._started = False

    # -- the training thread ------------------------------------------------------------------------------
    def next(self) -> tuple[TrainBatch, FetchedBatch] | tuple[None, None]:
        """The next batch with untrained groups (and how it was fetched), or (None, None) once ``stop`` is set.

        Raises what the background thread raised (HubUnavailable: the hub stayed unreachable)."""
        if not self._started:
            self._started = True
            self._thread.start()
        while not self.stop.is_set():
            try:
                item = self._ready.get(timeout=0.1)
            except queue.Empty:
                continue
            self._slot.release()          # the background thread may lease the one after it now
            if isinstance(item, BaseException):
                raise item
            fresh = self.ledger.fresh_part(item.batch)   # after the previous batch was marked trained
            if fresh is not None:
                return fresh, item
        return None, None

    def close(self, timeout_s: float | None = None) -> None:
        """Stop fetching; a batch leased and not handed out goes back to the hub's queue."""
        self._closed.set()
        self.client.abort.set()
        self._slot.release()
        if self._started:
            self._thread.join(timeout=timeout_s if timeout_s is not None else self.wait_s + 10)
            if self._thread.is_alive():
                log.warning("the batch prefetch thread is still in a hub request; its lease will expire on the hub")
        while True:
            try:
                item = self._ready.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, FetchedBatch):
                self._release(item.batch.batch_id)
        self.client.close()

    # -- the background thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        started = time.monotonic()
        while not self._closed.is_set():
            self._slot.acquire()
            if self._closed.is_set():
                return
            try:
                fetched = self._fetch_until_ready(started)
            except HubUnavailable as exc:
                if not (self._closed.is_set() or self.stop.is_set()):
                    self._ready.put(exc)
                return
            except Exception as exc:  # noqa: BLE001 - handed to the training thread, which raises it
                self._ready.put(exc)
                return
            if fetched is None:
                return
            if self._closed.is_set():
                self._release(fetched.batch.batch_id)
                return
            self._ready.put(fetched)
            started = time.monotonic()

    def _fetch_until_ready(self, started: float) -> FetchedBatch | None:
        while not (self._closed.is_set() or self.stop.is_set()):
            t0 = time.perf_counter()
            response = self.client._request(  # noqa: SLF001 - the raw bytes, so that decoding is timed apart
                "GET", "/v1/batch", params={"num_groups": self.num_groups, "timeout": self.wait_s}, ok=(200, 204),
                timeout_s=self.client.timeout_s + self.wait_s)
            t1 = time.perf_counter()
            if response.status_code == 200:
                batch = TrainBatch.from_bytes(response.content)
                return FetchedBatch(batch, fetch_s=t1 - t0, decode_s=time.perf_counter() - t1)
            if self.progress is not None and not self._closed.is_set():
                stats = self.client.hub_stats()
                self.progress(f"waiting for {self.num_groups} groups: hub holds {stats['ready']} ready of "
                              f"{stats['queue_depth']} queued, waited {time.monotonic() - started:.0f}s")
        return None

    def _release(self, batch_id: str) -> None:
        """Hand an untrained lease back (one attempt: if it fails, the lease expires on the hub instead)."""
        try:
            response = self.client.session.post(f"{self.client.base_url}/v1/batch/release",
                                                json={"batch_ids": [batch_id]}, timeout=10)
            response.raise_for_status()
        except Exception as exc:  # noqa: BLE001 - logged; the hub's lease timeout returns the groups anyway
            log.warning("could not hand batch %s back to the hub (%s); its groups return after the lease timeout",
                        batch_id, exc)


class VersionReporter:
    """Reports the learner's version to the hub from a background thread: the training thread never waits for the
    answer. Only the newest pending version is sent (versions only grow; the hub wants the newest)."""

    def __init__(self, client: HubClient) -> None:
        self.client = client
        self._pending: int | None = None
        self._sent = -1
        self._cond = threading.Condition()
        self._closed = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="version-report", daemon=True)
        self._thread.start()

    def report(self, version: int) -> None:
        """Queue ``version`` (returns at once); raises the previous report's failure, if any."""
        if self.error is not None:
            raise self.error
        with self._cond:
            self._pending = version
            self._cond.notify()

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued version is sent (before the learner exits or checkpoints)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending is not None and self.error is None and time.monotonic() < deadline:
                self._cond.wait(timeout=0.1)
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=30)
        self.client.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return
                version = self._pending
            try:
                if version > self._sent:
                    self.client.report_version(version)
                    self._sent = version
            except Exception as exc:  # noqa: BLE001 - re-raised on the training thread at its next report
                self.error = exc
            with self._cond:
                if self._pending == version:
                    self._pending = None
                self._cond.notify_all()
                if self.error is not None:
                    return
