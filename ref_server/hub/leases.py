"""The hub's leases: the learner's side of the shared :class:`ref_server.hub.queue.RolloutQueue`.

Delivery at least once: :meth:`Leases.take` *leases* the oldest ready groups to a batch id (they leave the queue,
spool files kept). The learner acknowledges the batch once its step is applied (:meth:`Leases.ack`); only then are
the groups and their spool files gone. A lease not acknowledged (or renewed, :meth:`Leases.renew`) within
``lease_timeout_s``, or handed back (:meth:`Leases.release`), returns its groups to the front of the queue. The
learner drops group ids it already trained on, which makes delivery exactly once.

Poison pills: a lease that expires while the learner has not marked it trained counts as a failed delivery of each
of its groups (a learner that crashes on a group never acknowledges it; a handed-back lease does not count). A group
with ``max_deliveries - 1`` failures is leased alone, so the good groups of its batches train and only the culprit
fails again; at ``max_deliveries`` failures it is quarantined (:meth:`RolloutQueue.quarantine_locked`), never
redelivered, counted (``quarantined``). Like a dead-letter queue with a redrive count. The counts are kept beside
the spool files, and a hub that shuts down cleanly counts the leases still held untrained as failed (a learner that
crashes stops ``grpo run``, hub included): restarts go on counting, so a group that crashes the learner on every
restart is quarantined too (:meth:`Leases.triage` at reload). A hub killed outright counts nothing for the leases it
held (the learner is not to blame).

Restarts: each lease is kept beside the spool files (:meth:`ref_server.hub.spool.RolloutSpool.write_lease`, at
take, renew and release; deleted at acknowledgement and expiry), and :meth:`Leases.restore` holds them again at
reload, each for a fresh ``lease_timeout_s`` (the hub's downtime is not the learner's, and a wall clock may jump
across a restart; the learner renews every third of the timeout anyway). So a batch the learner trained before the
restart and acknowledges after it is consumed (``acked``), never queued again or dropped as stale, and an untrained
one the learner goes on training is not handed to it twice. A restored lease that expires without a renewal since
the restart counts no failed delivery (the learner that held it may have gone with the hub); a clean shutdown keeps
only the trained leases' files (the untrained ones were counted failed, their groups are triaged at reload).

A new learner session (:meth:`Leases.hand_over`, at ``POST /v1/learner/session``): the leases held then are the
previous learner process's, and the new one will not train them, so they are not left to run out their timeout:
each is expired at once under the rules above (an untrained lease counts a failed delivery, so a group that crashes
the learner on every restart is still quarantined; a trained or restored one does not), and its groups are
delivered again. Only the leases a resuming learner presents as held by its checkpoint stay held (it acknowledges
them next). Exactly once still holds: a redelivered group its checkpoint holds is dropped by the learner's ledger.

A stopping learner hands back what it holds, including a lease whose grant has not reached it yet: each take may
carry the learner's own request id (:meth:`Leases.take` ``request_id``), and :meth:`Leases.release` may name request
ids. A request id released before its take granted anything is remembered, and that take grants nothing; one
released after its grant releases the lease granted to it. Both happen under the queue's lock, so however the long
poll and the release interleave, the lease comes back at once (not after the lease timeout, and not counted as a
failed delivery), even when the learner never reads the answer.

A take looks only at the groups it takes (and at any not-yet-scored ones ahead of them): their batch rows were laid
out when they became ready (:mod:`ref_server.hub.batching`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from ref_server.hub.batching import assemble_batch
from ref_server.hub.queue import QueuedGroup, RolloutQueue
from ref_server.hub.spool import SpooledLease
from shared.protocol.records import TrainBatch

log = logging.getLogger("grpo.ref_server.hub")


@dataclass
class Lease:
    groups: list[QueuedGroup]
    deadline: float
    trained: bool = False   # the learner trained it and holds it for its next checkpoint (pacing leaves it out)
    released: bool = False  # handed back by the learner (not a failed delivery)
    restored: bool = False  # held again at a restart and not renewed since: its expiry is no failed delivery
    request_id: str | None = None  # the learner's id for the take that granted it (release can name it)


class Leases:
    def __init__(self, queue: RolloutQueue, *, lease_timeout_s: float = 300.0, max_deliveries: int = 3) -> None:
        self.queue = queue
        self.lease_timeout_s = lease_timeout_s
        self.max_deliveries = max_deliveries
        # groups that failed this often are leased alone (with max_deliveries 1, none: the first failure quarantines)
        self._alone_after = max_deliveries - 1 if max_deliveries > 1 else None
        self.held: dict[str, Lease] = {}   # batch id -> lease, not yet acknowledged
        # batch ids acknowledged (-> None) or expired and requeued (-> their groups' sequence numbers), so that a
        # repeated or late acknowledgement is answered correctly
        self._finished: OrderedDict[str, list[int] | None] = OrderedDict()
        # request ids released before their take granted anything: that take grants nothing
        self._cancelled: OrderedDict[str, None] = OrderedDict()

    def take(self, num_groups: int, timeout: float = 0.0, min_version: int | None = None,
             request_id: str | None = None) -> TrainBatch | None:
        """Lease the ``num_groups`` oldest ready groups as one batch, waiting up to ``timeout`` s; None if not enough.

        ``min_version``: the learner will train this batch at a version that makes groups older than this stale;
        they are dropped (and counted) first, as a version report would drop them. ``request_id``: the learner's id
        for this take; None at once (now or later) once :meth:`release` named it.

        The groups stay spooled until :meth:`ack` names the batch id; an unacknowledged lease expires after
        ``lease_timeout_s`` and its groups go back to the front of the queue."""
        queue = self.queue
        deadline = time.monotonic() + timeout
        with queue.cond:
            while True:
                if request_id is not None and request_id in self._cancelled:
                    return None
                self.expire_locked()
                if min_version is not None:
                    queue.drop_stale_locked(min_version)
                chosen = queue.oldest_ready_locked(num_groups)
                if chosen is not None:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                queue.cond.wait(timeout=min(remaining, 1.0))
            for entry in chosen:
                del queue.groups[entry.seq]
            batch_id = uuid.uuid4().hex
            self.held[batch_id] = Lease(chosen, time.monotonic() + self.lease_timeout_s, request_id=request_id)
            self._persist_locked(batch_id)
            queue.counters.leased += len(chosen)
            queue.cond.notify_all()  # fewer queued groups: generators waiting for a budget may go on
        return assemble_batch([e.group for e in chosen], [e.rows for e in chosen], batch_id=batch_id)

    def ack(self, batch_ids: list[str]) -> dict[str, str]:
        """The learner applied these batches: their groups are consumed (spool files deleted).

        Per id: ``"acked"``; ``"already"`` (acknowledged before); ``"late"`` (the lease had expired: the groups
        still waiting in the queue are removed, those leased again stay with their new batch, which the learner
        acknowledges after dropping them as already trained); ``"unknown"``."""
        queue = self.queue
        answer = {}
        consumed: list[tuple[str, list[QueuedGroup], bool]] = []
        with queue.cond:
            for batch_id in batch_ids:
                lease = self.held.pop(batch_id, None)
                if lease is not None:
                    done = lease.groups
                    answer[batch_id] = "acked"
                elif batch_id in self._finished:
                    requeued = self._finished[batch_id] or []
                    done = [queue.groups.pop(seq) for seq in requeued if seq in queue.groups]
                    # groups of this lease dropped as stale since it expired: trained after all, so consumed
                    # (their files are gone already)
                    trained = [seq for seq in requeued if seq in queue.dropped_seqs]
                    for seq in trained:
                        del queue.dropped_seqs[seq]
                    queue.counters.dropped_stale -= len(trained)
                    queue.counters.consumed += len(trained)
                    answer[batch_id] = "late" if requeued else "already"
                else:
                    answer[batch_id] = "unknown"
                    continue
                queue.counters.consumed += len(done)
                consumed.append((batch_id, done, lease is not None))
                self._finish(batch_id, None)
            queue.cond.notify_all()
        # The files go after the lock (a batch's unlinks wait on the disk's journal: ~0.3 ms each, tens of ms for a
        # batch, which held every upload and lease before), and before the answer: an acknowledged batch is gone
        # from disk. These groups are out of the queue and the lease, so nothing else touches their files.
        for batch_id, done, leased in consumed:
            for entry in done:
                queue.unspool(entry)
            if leased:   # after its groups' files: a crash in between leaves a lease of none
                self._unpersist(batch_id)
        return answer

    def release(self, batch_ids: list[str], request_ids: list[str] = ()) -> dict[str, str]:
        """The learner hands back leases it will not train (it is stopping): their groups go back to the front of
        the queue now rather than after the lease timeout. Per batch id: ``"released"`` or ``"unknown"``. Per
        request id (of a take, :meth:`take`): ``"released"`` (the lease granted to it) or ``"cancelled"`` (nothing
        granted yet: that take grants nothing)."""
        with self.queue.cond:
            answer = {}
            named = [(batch_id, batch_id) for batch_id in batch_ids]
            for request_id in request_ids:  # a retried take may have been granted twice: every grant comes back
                granted = [(request_id, b) for b, lease in self.held.items() if lease.request_id == request_id]
                named += granted
                self._cancelled[request_id] = None   # and a take still waiting under it grants nothing
                if not granted:
                    answer[request_id] = "cancelled"
            while len(self._cancelled) > 10_000:
                self._cancelled.popitem(last=False)
            for name, batch_id in named:
                lease = self.held.get(batch_id)
                if lease is None:
                    answer[name] = "unknown"
                    continue
                lease.deadline = float("-inf")
                lease.released = True
                answer[name] = "released"
            self.expire_locked(reason="handed back")
        return answer

    def renew(self, batch_ids: list[str], trained: bool = False) -> dict[str, str]:
        """Extend these leases by ``lease_timeout_s`` from now (the learner holds them until its checkpoint).
        ``trained``: the learner has trained them (they are held only for the checkpoint), so they no longer count
        among the groups it will train before newly sampled ones (the generators' budget)."""
        answer = {}
        with self.queue.cond:
            self.expire_locked()
            for batch_id in batch_ids:
                lease = self.held.get(batch_id)
                if lease is not None:
                    lease.deadline = time.monotonic() + self.lease_timeout_s
                    lease.trained = lease.trained or trained
                    lease.restored = False
                    self._persist_locked(batch_id)
                answer[batch_id] = "renewed" if lease is not None else "unknown"
            if trained:
                self.queue.cond.notify_all()
        return answer

    def hand_over(self, keep: list[str] = ()) -> tuple[int, int]:
        """A new learner session registered: expire every held lease at once except those in ``keep`` (a resumed
        learner's checkpoint holds their groups; they are renewed, marked trained). Returns (groups released,
        leases kept)."""
        keep_ids = set(keep)
        with self.queue.cond:
            released = kept = 0
            now = time.monotonic()
            for batch_id, lease in self.held.items():
                if batch_id in keep_ids:
                    lease.deadline, lease.trained, lease.restored = now + self.lease_timeout_s, True, False
                    self._persist_locked(batch_id)
                    kept += 1
                else:
                    lease.deadline = float("-inf")
                    released += len(lease.groups)
            if released:
                self.expire_locked(reason="held by an earlier learner session")
            self.queue.cond.notify_all()
        return released, kept

    def leased_depth(self) -> int:
        """Groups handed to the learner and not yet acknowledged (leases past their deadline are expired first:
        a lease held again at a restart for a learner that is gone has no take or renewal to expire it)."""
        with self.queue.cond:
            self.expire_locked()
            return sum(len(lease.groups) for lease in self.held.values())

    def untrained_locked(self) -> int:
        """Leased groups the learner has not trained yet: the batch in training and the one it prefetched. A lease
        held again at a restart counts once its learner renews it (it may have gone with the hub: until then it must
        not hold the generators' budget for a whole lease timeout)."""
        return sum(len(lease.groups) for lease in self.held.values() if not (lease.trained or lease.restored))

    def expire_locked(self, reason: str = "") -> None:
        """Requeue the groups of every lease past its deadline (the caller holds the queue's lock)."""
        now = time.monotonic()
        expired = [batch_id for batch_id, lease in self.held.items() if lease.deadline <= now]
        if not expired:
            return
        requeued: list[QueuedGroup] = []
        for batch_id in expired:
            lease = self.held.pop(batch_id)
            blameless = lease.released or lease.trained or lease.restored
            back = lease.groups if blameless else self._failed_delivery(lease)
            requeued += back
            self._unpersist(batch_id)
            self.queue.counters.lease_expired += len(lease.groups)
            self._finish(batch_id, [e.seq for e in back])
            if reason:
                log.info("batch %s was %s: its %d groups are queued again", batch_id, reason, len(lease.groups))
            else:
                log.warning("batch %s was not acknowledged within %.1fs: its %d groups are queued again", batch_id,
                            self.lease_timeout_s, len(lease.groups))
        self.queue.requeue_locked(requeued)  # requeued groups may have gone stale while leased: dropped there
        self.queue.cond.notify_all()

    def _failed_delivery(self, lease: Lease) -> list[QueuedGroup]:
        """Count a failed delivery of each group of an expired, untrained lease; quarantine those that reached
        ``max_deliveries``. Returns the groups to queue again."""
        back = []
        for entry in lease.groups:
            entry.failures += 1
            if self.triage(entry, alone=len(lease.groups) == 1):
                self.queue.record_failures_locked(entry)
                back.append(entry)
        return back

    def triage(self, entry: QueuedGroup, alone: bool = False) -> bool:
        """After a failed delivery (or at reload): quarantine a group at ``max_deliveries`` failures (False), else
        mark it to be leased alone from ``max_deliveries - 1`` on; True while it may be delivered again. The caller
        holds the queue's lock (or nothing else runs yet, at reload)."""
        if entry.failures >= self.max_deliveries:
            self.queue.quarantine_locked(entry, f"{entry.failures} leases expired or were held at shutdown untrained "
                                                f"and unacknowledged{' (the last one alone)' if alone else ''}, "
                                                f"ref_server.max_deliveries is {self.max_deliveries}")
            return False
        if self._alone_after is not None and entry.failures >= self._alone_after:
            self.queue.suspects.add(entry.seq)   # leased alone from now on
        return True

    def close(self) -> None:
        """A clean shutdown: the leases still held untrained count as failed deliveries (recorded beside the spool
        files; the groups stay spooled and are triaged at the next start)."""
        with self.queue.cond:
            for batch_id, lease in self.held.items():
                if lease.trained and not lease.released:
                    continue   # its file stays: the learner acknowledges it after the restart
                self._unpersist(batch_id)
                if not (lease.released or lease.restored):
                    for entry in lease.groups:
                        entry.failures += 1
                        self.queue.record_failures_locked(entry)
            self.held.clear()

    def restore(self, spooled: list[SpooledLease], entries: dict[int, QueuedGroup]) -> set[int]:
        """At reload (nothing else runs yet): hold again the leases found beside the spool, over the reloaded groups
        ``entries`` (by sequence number), each for a fresh ``lease_timeout_s``. Returns the sequence numbers now held
        (the caller queues the others). A group gone (consumed just before a crash, or corrupt) or held by an earlier
        lease is left out of the lease; a lease left with no group is dropped (its file deleted)."""
        held: set[int] = set()
        deadline = time.monotonic() + self.lease_timeout_s
        for lease in spooled:
            groups = [entries[seq] for seq in lease.seqs if seq in entries and seq not in held]
            if len(groups) != len(lease.seqs):
                log.warning("lease %s names %d groups, %d of them spooled and not held by another lease", lease.batch_id,
                            len(lease.seqs), len(groups))
            if not groups:
                self._unpersist(lease.batch_id)
                continue
            held.update(entry.seq for entry in groups)
            self.held[lease.batch_id] = Lease(groups, deadline, trained=lease.trained, restored=True)
            self.queue.counters.leased += len(groups)   # per lifetime: leased = consumed + lease_expired + held
            self._persist_locked(lease.batch_id)   # its groups may be fewer now
        if self.held:
            log.info("restored %d leases (%d trained) of %d groups from the spool", len(self.held),
                     sum(lease.trained for lease in self.held.values()), len(held))
        return held

    def _persist_locked(self, batch_id: str) -> None:
        """Keep the lease beside the spool files (failure to write is logged: a restart then requeues its groups,
        as before leases were kept)."""
        spool = self.queue.spool
        lease = self.held[batch_id]
        if spool is None or not lease.groups or lease.groups[0].spool_path is None:
            return
        deadline_unix = time.time() + (lease.deadline - time.monotonic())
        try:
            spool.write_lease(SpooledLease(batch_id, [e.seq for e in lease.groups], deadline_unix, lease.trained))
        except OSError as exc:
            log.error("could not keep lease %s beside the spool (%s)", batch_id, exc)

    def _unpersist(self, batch_id: str) -> None:
        if self.queue.spool is None:
            return
        try:
            self.queue.spool.remove_lease(batch_id)
        except OSError as exc:   # a stale file: its groups are gone (acknowledged) or queued again (expired)
            log.error("could not delete the file of lease %s (%s)", batch_id, exc)

    def _finish(self, batch_id: str, requeued: list[int] | None) -> None:
        self._finished[batch_id] = requeued
        while len(self._finished) > 10_000:
            self._finished.popitem(last=False)
