"""Rank 0's background transfers of the learner's send buffer.

:class:`shared.weight_sync.publisher.WeightPublisher` (every rank) copies the policy into one flat send buffer on
rank 0 and returns: the learner's stall per publish is that copy. :class:`WeightSender` (rank 0) then moves the
buffer in background threads:

* to the HTTP relay (a safetensors stream: header + buffer), when no generator holds a group, when some
  generator only uses HTTP, when a late joiner needs the current version first, and at the end of the run;
* through a process group per generator (:mod:`shared.weight_sync.members`, built with
  :mod:`shared.weight_sync.groups`: gloo on CPU, NCCL on GPU), to each member that asks for it (through its group's
  store, as it enters the receive), in buckets of ``weight_sync.bucket_mb``;
* through CUDA IPC (the buffer's handle, opened once by the generator) when they share a GPU: the group then only
  carries the header and the completion step.

One version is in flight at most: while any transfer reads the buffer, a publish is skipped and counted (the next
one carries newer weights); a version overwritten before anyone received it is counted as superseded. A member
whose transfer fails or times out is dropped (counted) after at most ``weight_sync.timeout_s``; it rejoins through
the hub, loading the current version over HTTP first. Non-finite weights are never published (counted).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable

import torch

from shared.config.schema.weight_sync import WeightSyncConfig
from shared.errors import ServiceError
from shared.protocol.client import HubClient, HubError, HubUnavailable
from shared.protocol.weight_sync_messages import Announcement, MemberReport, SenderInfo
from shared.weight_sync.ipc import device_uuid, export_handle
from shared.weight_sync.layout import Layout
from shared.weight_sync.members import GroupMembers
from shared.weight_sync.sender_state import SyncCounters

log = logging.getLogger("grpo.learner.weight_sync")


class WeightsRefusedError(ServiceError):
    """The hub refused the learner's own weights (not its session, a version out of bounds or not newer than the
    relay's, tensors that are not the registered layout's): the generators would never get them."""


class SafetensorsStream:
    """A safetensors file (header + buffer) as a seekable stream for ``requests`` (no file on disk; a GPU buffer
    is copied to the host one chunk at a time)."""

    def __init__(self, header: bytes, buffer: torch.Tensor, chunk_bytes: int = 16 * 2**20) -> None:
        self.header, self.buffer, self.chunk_bytes = header, buffer, chunk_bytes
        self.position = 0
        self._chunk_start, self._chunk = -1, b""

    def __len__(self) -> int:
        return len(self.header) + self.buffer.numel()

    def seek(self, position: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.position, 2: len(self)}[whence]
        self.position = base + position
        return self.position

    def tell(self) -> int:
        return self.position

    def read(self, size: int | None = -1) -> bytes:
        left = len(self) - self.position
        size = left if size is None or size < 0 else min(size, left)
        if size <= 0:
            return b""
        if self.position < len(self.header):
            out = self.header[self.position:self.position + size]
        else:
            offset = self.position - len(self.header)
            if not self._chunk_start <= offset < self._chunk_start + len(self._chunk):
                self._chunk_start = offset
                self._chunk = self.buffer[offset:offset + self.chunk_bytes].cpu().numpy().tobytes()
            inside = offset - self._chunk_start
            out = self._chunk[inside:inside + size]
        self.position += len(out)
        return out


class WeightSender:
    """Rank 0's background transfers of the send buffer (see the module docstring); its members see it as a
    :class:`shared.weight_sync.sender_state.SenderState`."""

    def __init__(self, client_factory: Callable[[], HubClient], cfg: WeightSyncConfig, layout: Layout,
                 buffer: torch.Tensor, relay_version: int | None, metadata: dict[str, str] | None = None) -> None:
        self.client_factory, self.cfg, self.layout, self.buffer = client_factory, cfg, layout, buffer
        self.metadata = dict(metadata or {})     # written into each relay upload's header (what the file holds)
        self._local = threading.local()   # one HubClient per thread: a requests session is not thread-safe
        self.aborting = False
        self._clients: list[HubClient] = []
        self.backend = "nccl" if buffer.device.type == "cuda" else "gloo"
        self.counters = SyncCounters()
        self.lock = threading.Condition()
        self.version: int | None = None          # the version the buffer holds (complete)
        self.checked = False                     # ... and found finite: only then is it sent anywhere
        self.copying = False
        self.transfers: set[str] = set()         # who reads the buffer now ("relay" or member ids)
        self.version_sent = False                # a transfer of the buffer's version started ("superseded")
        self.published_at: dict[int, float] = {}  # the buffer's version -> when it was complete
        self.relay_version = relay_version
        self.relay_uploaded_at = time.monotonic()   # relay_every_s counts from here, then from each upload
        self.highest_sent: int | None = None     # the newest version this sender itself sent to the relay
        self.announced: int | None = None
        self.error: WeightsRefusedError | None = None   # the hub refused our weights: raised at the next publish
        self.ready_event: torch.cuda.Event | None = None
        self._ipc_handle: dict | None = None
        self.stopping = threading.Event()
        self.sender_id = f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.groups_enabled = cfg.transport != "http"
        self.members = GroupMembers(self) if self.groups_enabled else None  # generators holding a group
        self._threads = [threading.Thread(target=self._version_loop, name="weight-sync-versions", daemon=True)]
        if self.groups_enabled:
            self.register()
            self._threads.append(threading.Thread(target=self.members.rendezvous_loop, name="weight-sync-rendezvous",
                                                  daemon=True))
        for thread in self._threads:
            thread.start()

    @property
    def client(self) -> HubClient:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = self.client_factory()
            with self.lock:
                self._clients.append(client)
                if self.aborting:
                    client.abort.set()
        return client

    def register(self) -> None:
        cfg = self.cfg
        self.client.sync_register_sender(SenderInfo(
            sender_id=self.sender_id, host=cfg.host, backend=self.backend,
            device_uuid=device_uuid(self.buffer.device), layout=self.layout.to_json(),
            bucket_bytes=cfg.bucket_bytes, timeout_s=cfg.timeout_s, member_idle_s=cfg.member_idle_s))

    # -- called by the learner (rank 0) ---------------------------------------------------------------------
    def begin_copy(self) -> bool:
        """May the learner overwrite the buffer now? False (counted) while a transfer reads it."""
        with self.lock:
            if self.transfers:
                self.counters.skipped_busy += 1
                return False
            self.copying = True
            return True

    def end_copy(self, version: int, stall_s: float) -> None:
        """The buffer holds ``version`` (not yet checked for NaN/inf: the version thread does that next)."""
        with self.lock:
            self.copying = False
            self.counters.last_stall_s = stall_s
            if self.version is not None and self.checked and not self.version_sent:
                self.counters.superseded += 1
            self.version, self.checked, self.version_sent = version, False, False
            self.published_at = {version: time.perf_counter()}
            if self.buffer.device.type == "cuda":
                self.ready_event = torch.cuda.Event()
                self.ready_event.record()
            self.lock.notify_all()

    def _buffer_finite(self) -> bool:
        """NaN/inf anywhere in the buffer? One min/max pass (NaN propagates through both, inf shows in one)."""
        self.wait_buffer_ready()
        if not self.layout.tensors or self.layout.total_bytes == 0:
            return True
        values = self.buffer.view(self.layout.tensors[0].torch_dtype)
        return bool(torch.isfinite(torch.stack(torch.aminmax(values))).all().item())

    def _check(self, version: int) -> None:
        """Refuse (count, never serve) a version holding NaN/inf; the caller added "check" to the transfers."""
        try:
            finite = self._buffer_finite()
        finally:
            with self.lock:
                self.transfers.discard("check")
                if self.version == version:
                    if finite:
                        self.checked = True
                        self.counters.published += 1
                    else:
                        self.counters.refused_nonfinite += 1
                        self.version = None  # nothing to serve until the next publish
                self.lock.notify_all()
        if not finite:
            log.warning("weights of version %d hold NaN/inf: not published (training goes on)", version)

    def wait_idle(self, timeout_s: float) -> bool:
        """Until no transfer reads the buffer and the newest version went where it goes (True), or timeout."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while self.transfers or (self.error is None and self.version is not None
                                     and (not self.checked or self._pending(self.version))):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.lock.wait(min(remaining, 0.1))
        return True

    def upload_final(self) -> None:
        """The buffer's version onto the relay (the run's last weights stay downloadable)."""
        with self.lock:
            version = self.version
            if version is None or not self.checked or (self.relay_version is not None
                                                       and version <= self.relay_version):
                return
            self.transfers.add("relay")
        self.upload_relay(version)
        if self.error is not None:
            raise self.error

    def abort_requests(self) -> None:
        """From now on every hub request is tried once (a service shutting down does not wait out the retry
        budget of a hub that is gone), like the learner's own client after SIGTERM."""
        with self.lock:
            self.aborting = True
            for client in self._clients:
                client.abort.set()

    def close(self) -> None:
        self.stopping.set()
        self.abort_requests()
        with self.lock:
            self.lock.notify_all()
        for thread in self._threads:
            thread.join(timeout=self.cfg.poll_s + 5)
        if self.members is not None:
            # a link still forming its group waits for its generator at most join_timeout_s; one serving a
            # version at most timeout_s per collective: wait a bounded time for the usual case
            self.members.close(timeout_s=self.cfg.timeout_s + 5)
        if self.groups_enabled:
            try:  # one attempt: a hub that is gone has forgotten us anyway
                self.client.sync_unregister_sender(self.sender_id)
            except (HubError, HubUnavailable) as exc:
                log.warning("weight sync: could not unregister from the hub: %s", exc)
        with self.lock:
            for client in self._clients:
                client.close()

    # -- shared with the member threads ---------------------------------------------------------------------
    def ipc_handle(self) -> dict:
        if self._ipc_handle is None:
            self._ipc_handle = export_handle(self.buffer)
        return self._ipc_handle

    def wait_buffer_ready(self) -> None:
        if self.ready_event is not None:
            self.ready_event.synchronize()

    def transfer_done(self, who: str) -> None:
        with self.lock:
            self.transfers.discard(who)
            self.lock.notify_all()

    def served(self, member_id: str, version: int) -> None:
        with self.lock:
            self.counters.served += 1
            if version in self.published_at:
                self.counters.last_transfer_s = time.perf_counter() - self.published_at[version]
        self.member_state(member_id, "served", version=version)

    def member_state(self, member_id: str, state: str, *, reason: str | None = None,
                     version: int | None = None) -> None:
        try:
            self.client.sync_member_state(member_id, MemberReport(sender_id=self.sender_id, state=state,
                                                                  reason=reason, version=version))
        except (HubError, HubUnavailable) as exc:
            log.warning("weight sync: could not tell the hub %s is %s: %s", member_id, state, exc)

    # -- background -----------------------------------------------------------------------------------------
    def _relay_wanted(self) -> bool:
        return self.members is None or self.members.http_members > 0 or self.members.alive() == 0

    def _relay_due(self, version: int) -> bool:
        """Does ``version`` go onto the relay: someone reads it there, or ``relay_every_versions`` /
        ``relay_every_s`` (the evaluator follows the relay) passed since the last upload?"""
        if self.relay_version is not None and version <= self.relay_version:
            return False
        if self._relay_wanted():
            return True
        every, every_s = self.cfg.relay_every_versions, self.cfg.relay_every_s
        return ((every is not None and version >= (self.relay_version or 0) + every)
                or (every_s is not None and time.monotonic() - self.relay_uploaded_at >= every_s))

    def _pending(self, version: int) -> bool:
        """Does ``version`` still have to be uploaded or announced?"""
        relay = self._relay_due(version)
        announce = self.groups_enabled and (self.announced is None or version > self.announced)
        return relay or announce

    def _version_loop(self) -> None:
        """Each new buffer version: onto the relay when someone needs it there, then announced to members."""
        while not self.stopping.is_set():
            with self.lock:
                while not self.stopping.is_set() and (self.copying or self.version is None or (
                        self.checked and not self._pending(self.version))):
                    self.lock.wait(0.5)
                if self.stopping.is_set() or self.error is not None:
                    return
                version, need_check = self.version, not self.checked
                upload = not need_check and self._relay_due(version)
                if need_check or upload:  # both read the buffer: no publish overwrites it meanwhile
                    self.transfers.add("check" if need_check else "relay")
            if need_check:
                self._check(version)
                continue
            try:
                if upload:
                    self.upload_relay(version)
                if self.error is not None:
                    return
                if self.groups_enabled and (self.announced is None or version > self.announced):
                    announcement = Announcement(sender_id=self.sender_id, version=version)
                    try:
                        self.client.sync_announce(announcement)
                    except HubError as exc:
                        if exc.status != 409:
                            raise
                        self.register()  # the hub forgot us (restarted): register again, then announce
                        self.client.sync_announce(announcement)
                    with self.lock:
                        self.announced = version
                        self.lock.notify_all()
                if self.error is not None:
                    return
            except (HubError, HubUnavailable) as exc:
                log.warning("weight sync: version %d not delivered to the hub: %s", version, exc)
                self.stopping.wait(1.0)

    def _superseded_by_own(self, version: int, current: int | None) -> bool:
        """A 409 for ``version`` that means done: the relay's ``current`` version is this one (an earlier attempt of
        this upload landed, its answer lost and the request sent again, e.g. across a hub restart) or a newer one
        this sender itself sent (the retry arrived after it). A relay ahead of everything this sender sent (a
        resumed learner behind the relay, another learner's weights) is a refusal."""
        return current is not None and self.highest_sent is not None and version <= current <= self.highest_sent

    def upload_relay(self, version: int) -> None:
        """Upload ``version`` from the buffer (the caller added "relay" to the transfers). A refusal is kept in
        :attr:`error` (the learner raises it at its next publish), never taken for "already there"."""
        started = time.perf_counter()
        try:
            self.wait_buffer_ready()
            with self.lock:
                self.version_sent = self.version_sent or version == self.version
                self.highest_sent = max(self.highest_sent or 0, version)
            header = self.layout.safetensors_header(self.metadata | {"grpo_version": str(version)})
            self.client.upload_weights_stream(version, SafetensorsStream(header, self.buffer))
            with self.lock:
                self.relay_version = version
                self.relay_uploaded_at = time.monotonic()
                self.counters.relay_uploads += 1
                if version in self.published_at:
                    self.counters.last_transfer_s = time.perf_counter() - self.published_at[version]
            log.info("weight sync: version %d on the relay (%.2fs)", version, time.perf_counter() - started)
        except HubError as exc:
            current = self.client.weights_version() if exc.status == 409 else None
            if not self._superseded_by_own(version, current):
                refused = WeightsRefusedError(f"the hub refused weights version {version}: {exc.detail}")
                log.error("weight sync: %s", refused)
                with self.lock:  # raised on the learner's thread at its next publish (every rank stops)
                    self.error = refused
                    self.lock.notify_all()
                return
            with self.lock:
                self.relay_version = max(self.relay_version or 0, current)
                if current > version:
                    self.counters.relay_superseded += 1
            if current > version:
                log.info("weight sync: version %d was superseded on the relay by this learner's version %d",
                         version, current)
        finally:
            self.transfer_done("relay")
