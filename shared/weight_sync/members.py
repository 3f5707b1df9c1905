"""The weight sender's generators that hold a process group with it (rank 0 of the learner).

:class:`GroupMembers` runs the rendezvous with the hub in its own thread: it answers join requests (making sure
the relay holds the current version, then offering a group), drops members that stopped polling, and hands each
member that the hub reports waiting in the receive to that member's :class:`MemberLink`. A link forms its group in
its own thread and then serves one version at a time from the sender's buffer (:mod:`shared.weight_sync.sender`
owns the buffer, its version and the bookkeeping of who reads it; this module sees it only as the
:class:`shared.weight_sync.sender_state.SenderState` it is given, and never imports the sender). Any failure drops
the member, after at most ``weight_sync.timeout_s``.

A link serves a version only when its generator asks for it through the group's store (the generator sets the
next :func:`groups.request_key` as it enters the receive, after the hub told it a newer version is announced):
the link's thread waits on that key, so the transfer starts within a millisecond of the ask, and a generator that
is in an engine call is never sent anything. The hub only brokers joining, announcements and silent members.

A link's membership ends with the hub's: every answer to the rendezvous poll lists the members the hub holds for
this sender, and a link whose member is not among them (a hub that restarted and forgot it, a member that left) is
dropped at once. A link still forming its group waits for its generator in short slices (the generator's connection
shows in the link's store), so dropping it or closing the sender never waits out a group's timeout on a generator
that will not come.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import torch

from shared.protocol.client import HubError, HubUnavailable
from shared.protocol.weight_sync_messages import Offer, OfferPost, PendingJoin
from shared.weight_sync import groups
from shared.weight_sync.layout import SCALING_KEY, bucket_ranges
from shared.weight_sync.sender_state import SenderState

log = logging.getLogger("grpo.learner.weight_sync")
REQUEST_WAIT_S = 3600.0  # one store wait; a stopping link is woken at once by wake()
PEER_POLL_S = 0.05       # how often a link forming its group looks for its generator (and for a stop)


class MemberLink:
    """One generator's group: formed in its own thread (waiting for the generator to connect), then serving one
    version at a time from the shared buffer. Any failure drops the member; the thread then ends."""

    def __init__(self, sender: SenderState, member_id: str, request: PendingJoin) -> None:
        self.sender, self.member_id, self.request = sender, member_id, request
        self.stop = threading.Event()
        self.waiting_on: int | None = None  # the request number the thread waits for in the store (under mutex)
        self.mutex = threading.Lock()
        self.group = None
        self.sent_version = -1   # the version of the last transfer to this member
        self.alive = True
        self.dropped = False
        self.counted = False     # counted in the members metric (its group formed)
        cfg = sender.cfg
        self.via_ipc = request.transport == "ipc"
        self.backend = "gloo" if self.via_ipc else sender.backend
        world = 1 + request.workers
        self.store = groups.host_store(cfg.host, world, cfg.join_timeout_s)
        self.address = groups.store_address(cfg.host, self.store.port)
        self.world = world
        self.fingerprint = sender.layout.fingerprint()
        self.thread = threading.Thread(target=self._run, name=f"weight-sync-{member_id}", daemon=True)

    def offer(self, relay_version: int | None) -> Offer:
        cfg = self.sender.cfg
        return Offer(member_id=self.member_id, group_id=self.address, host=cfg.host, port=self.store.port,
                     world_size=self.world, first_rank=1, backend=self.backend,
                     transport=self.request.transport, relay_version=relay_version,
                     bucket_bytes=cfg.bucket_bytes, timeout_s=cfg.timeout_s,
                     ipc_handle=self.sender.ipc_handle() if self.via_ipc else None,
                     layout=self.sender.layout.to_json(), metadata=self.sender.metadata or None)

    def _run(self) -> None:
        cfg, sender = self.sender.cfg, self.sender
        if sender.buffer.device.type == "cuda":
            torch.cuda.set_device(sender.buffer.device)  # a new thread starts on GPU 0; NCCL uses the current one
        try:
            if not self._wait_for_peer():
                return
            self.group = groups.build_group(self.store, self.address, 0, self.world, self.backend, cfg.timeout_s)
            self.store.set_timeout(timedelta(seconds=cfg.timeout_s))
            with sender.lock:
                if self.dropped:  # dropped as silent while the group formed
                    return
                self.counted = True
                sender.counters.members += 1
            sender.member_state(self.member_id, "active")
            log.info("weight sync: %s joined (%s, %s, %d worker(s))", self.member_id, self.request.transport,
                     self.backend, self.world - 1)
            request = 1
            while self._wait_request(request):
                version = self._claim()
                if version is None:
                    break
                self._serve(version)
                request += 1
        except (RuntimeError, ConnectionError, TimeoutError, ValueError) as exc:
            self._drop(f"{type(exc).__name__}: {exc}")
        finally:
            self._teardown()
            self.alive = False

    def _wait_for_peer(self) -> bool:
        """Until the generator has connected to the link's store (True), or the link is stopped (False). The
        group's construction would block in C++ for the whole timeout on a generator that never comes (one told by
        a restarted hub to rejoin elsewhere), and nothing could wake it; this wait looks at :attr:`stop` every
        ``PEER_POLL_S``. The offered generator has ``join_timeout_s`` to come (it loads a version over HTTP first)."""
        deadline = time.monotonic() + self.sender.cfg.join_timeout_s
        while self.store.num_keys() == 0:   # a client's connection adds the store's first key
            if self.stop.is_set():
                return False
            if time.monotonic() > deadline:
                raise TimeoutError(f"the generator did not connect within {self.sender.cfg.join_timeout_s:.0f}s "
                                   "(weight_sync.join_timeout_s)")
            time.sleep(PEER_POLL_S)
        return not self.stop.is_set()

    def _teardown(self) -> None:
        """Shut the group down and drop it, then the store, in this thread (see :func:`groups.close_group`)."""
        group, self.group = self.group, None
        groups.close_group(group)
        del group
        self.store = None

    def _wait_request(self, request: int) -> bool:
        """Until the generator asks for its ``request``-th version (True) or the link is told to stop (False)."""
        with self.mutex:
            if self.stop.is_set():
                return False
            self.waiting_on = request
        key = groups.request_key(request)
        while True:
            try:  # the store's server wakes us the moment the key is set; no timeout passes in normal use
                self.store.wait([key], timedelta(seconds=REQUEST_WAIT_S))
                break
            except torch.distributed.DistStoreError:  # an hour without a request: wait on
                if self.stop.is_set():
                    return False
        with self.mutex:
            self.waiting_on = None
        if self.stop.is_set():
            return False
        self.store.delete_key(key)
        return True

    def wake(self) -> None:
        """Make the thread see :attr:`stop` (set it first) if it waits for a request: set the key it waits on,
        through a client of its own (the thread's client is busy in the wait)."""
        with self.mutex:
            request = self.waiting_on
        if request is None or not self.thread.is_alive():
            return
        try:
            client = groups.join_store(self.sender.cfg.host, self.address_port, self.world, 5.0)
            client.set(groups.request_key(request), b"stop")
        except RuntimeError as exc:  # the link's store is gone: its thread has ended meanwhile
            log.info("weight sync: waking %s's thread: %s", self.member_id, exc)

    @property
    def address_port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def _claim(self) -> int | None:
        """The buffer's version for this transfer, marked as read by us (no publish overwrites it meanwhile).
        Waits while the learner copies or the sender checks a new version; ``timeout_s`` without a version to
        send (every publish refused as NaN/inf) is a failure: the generator gave up waiting in the receive."""
        sender = self.sender
        deadline = time.monotonic() + sender.cfg.timeout_s
        with sender.lock:
            while sender.copying or sender.version is None or not sender.checked:
                if self.stop.is_set() or self.dropped:
                    return None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no version to send for {sender.cfg.timeout_s:.0f}s after the ask")
                sender.lock.wait(0.05)
            self.sent_version = sender.version
            sender.transfers.add(self.member_id)
            sender.version_sent = True
            return sender.version

    def _serve(self, version: int) -> None:
        """Header, buckets, completion: every operation posted at once (gloo runs them in order in its own
        threads), then waited for, so this thread needs the interpreter lock twice, not once per operation, while
        the learner's training thread holds it most of the time."""
        sender, cfg = self.sender, self.sender.cfg
        try:
            sender.wait_buffer_ready()
            header = groups.VersionHeader(version, sender.layout.total_bytes, cfg.bucket_bytes, self.fingerprint,
                                          self.via_ipc, sender.layout.kind,
                                          float(sender.metadata.get(SCALING_KEY, 0.0)))
            device = sender.buffer.device if self.backend == "nccl" else torch.device("cpu")
            works = [groups.start_broadcast(self.group, header.to_tensor().to(device))]
            if not self.via_ipc:
                works += [groups.start_broadcast(self.group, sender.buffer[begin:end])
                          for begin, end in bucket_ranges(sender.layout.total_bytes, cfg.bucket_bytes)]
            applied, agreement = groups.start_agreement(self.group, True, device)
            for work in works:
                groups.finish(work, cfg.timeout_s)
            groups.finish(agreement, cfg.timeout_s)
            if not self.via_ipc:
                with sender.lock:
                    sender.counters.group_bytes_sent += sender.layout.total_bytes
            if not bool(applied.item() == 1):
                raise RuntimeError(f"the generator refused version {version} (see its log)")
        finally:
            sender.transfer_done(self.member_id)
        sender.served(self.member_id, version)

    def _drop(self, reason: str) -> None:
        if self.dropped:
            return
        with self.sender.lock:
            self.dropped = True
            self.sender.counters.dropped += 1
            if self.counted:
                self.sender.counters.members -= 1
        log.warning("weight sync: dropping %s: %s", self.member_id, reason)
        self.sender.member_state(self.member_id, "dropped", reason=reason[:1900])


class GroupMembers:
    """The sender's members (one :class:`MemberLink` each) and the rendezvous thread that manages them."""

    def __init__(self, sender: SenderState) -> None:
        self.sender = sender
        self.links: dict[str, MemberLink] = {}
        self.retired: list[MemberLink] = []  # dropped links whose threads may still tear their groups down
        self.http_members = 0   # generators that joined over HTTP: the relay must get every version for them

    def alive(self) -> int:
        """Members whose group thread still runs."""
        return sum(1 for link in self.links.values() if link.alive)

    def close(self, timeout_s: float) -> None:
        """End every link's thread and wait (at most ``timeout_s`` in all) until each has torn its group down: a
        process that exits while a link thread still holds its group dies in ``std::terminate`` (status -6)."""
        links = list(self.links.values()) + self.retired
        for link in links:
            link.stop.set()
            link.wake()
        deadline = time.monotonic() + timeout_s
        for link in links:
            if link.thread.ident is not None:  # started (a link is started as soon as it is made)
                link.thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if link.thread.is_alive():
                log.warning("weight sync: %s's group thread still runs after %.0fs at close", link.member_id,
                            timeout_s)

    def rendezvous_loop(self) -> None:
        """Answer join requests (relay first, then an offer) and drop members that stopped polling the hub."""
        sender = self.sender
        while not sender.stopping.is_set():
            try:
                work = sender.client.sync_work(sender.sender_id, wait_s=sender.cfg.poll_s)
                self.http_members = work.http_members
                for member_id in work.silent:
                    self._drop_link(member_id, f"silent for more than {sender.cfg.member_idle_s:.0f}s")
                if work.members is not None:
                    held = set(work.members)
                    for member_id in [m for m in self.links if m not in held]:
                        self._drop_link(member_id, "the hub no longer holds it (the hub restarted, or it left)",
                                        tell_hub=False)
                for request in work.joins:
                    self._answer_join(request)
            except (HubError, HubUnavailable) as exc:
                if sender.stopping.is_set():
                    return
                log.warning("weight sync: rendezvous with the hub failed: %s", exc)
                if isinstance(exc, HubError) and exc.status == 409:
                    self._register_again()
                    continue
                sender.stopping.wait(1.0)

    def _register_again(self) -> None:
        """The hub does not know this sender (it restarted): register again. The members the old hub instance
        brokered are not the new one's: the next poll's member list drops their links."""
        try:
            self.sender.register()
            log.info("weight sync: registered again with the hub (it had forgotten this sender)")
        except (HubError, HubUnavailable) as exc:
            log.warning("weight sync: registering again failed: %s", exc)
            self.sender.stopping.wait(1.0)

    def _answer_join(self, request: PendingJoin) -> None:
        sender, member_id = self.sender, request.member_id
        if request.transport == "ipc" and sender.buffer.device.type != "cuda":
            sender.member_state(member_id, "dropped", reason="CUDA IPC needs the learner on a GPU")
            return
        wanted = "nccl" if request.transport == "collective" and sender.backend == "nccl" else "gloo"
        if request.transport == "collective" and wanted != sender.backend:
            sender.member_state(member_id, "dropped", reason=f"the learner's groups use {sender.backend}")
            return
        # the late joiner loads the current version over HTTP first: make sure the relay holds it
        with sender.lock:
            while sender.transfers or sender.copying or (sender.version is not None and not sender.checked):
                sender.lock.wait(0.1)
            version = sender.version
            upload = version is not None and (sender.relay_version is None or version > sender.relay_version)
            if upload:
                sender.transfers.add("relay")
        if upload:
            sender.upload_relay(version)
        link = MemberLink(sender, member_id, request)
        if member_id in self.links:   # never expected (ids carry the hub instance): keep the old thread closable
            self.retired.append(self.links[member_id])
        self.links[member_id] = link
        link.thread.start()
        sender.client.sync_offer(OfferPost(sender_id=sender.sender_id, offer=link.offer(sender.relay_version)))

    def _drop_link(self, member_id: str, reason: str, tell_hub: bool = True) -> None:
        """A member that stopped polling (died between transfers), or that the hub no longer holds: close its
        group, count it, tell the hub (when it still knows the member)."""
        sender = self.sender
        with sender.lock:
            if member_id in sender.transfers:  # mid-transfer: the transfer's timeout decides
                return
            link = self.links.pop(member_id, None)
        if link is None:
            return
        self.retired.append(link)
        with sender.lock:
            if link.dropped:
                return
            link.dropped, link.alive = True, False
            sender.counters.dropped += 1
            if link.counted:
                sender.counters.members -= 1
        link.stop.set()
        link.wake()  # its thread closes the group
        log.warning("weight sync: dropping %s: %s", member_id, reason)
        if tell_hub:
            sender.member_state(member_id, "dropped", reason=reason)
