"""The one queue the hub's two halves share: the groups in arrival order, the lock and condition both halves wait
on, the counters, the spool, and the learner's version with the staleness drops it causes.

:class:`ref_server.hub.intake.Intake` adds groups to it (uploads, spool reloads) and
:class:`ref_server.hub.leases.Leases` takes them out as batches and puts expired leases back. Methods whose name
says "locked" (and the attributes both halves use: ``groups``, ``reserved``, ``cond``) are for callers that hold
``cond``; the others take it themselves.

Staleness drops pop a heap ordered by policy version, so a version report or a lease's ``min_version`` never does
work proportional to the queue: entries of groups taken, acknowledged or already dropped are skipped when they
surface (a requeued lease pushes its groups again).
"""

from __future__ import annotations

import heapq
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from ref_server.hub.batching import GroupRows
from ref_server.hub.spool import RolloutSpool
from shared.protocol.records import RolloutGroup

log = logging.getLogger("grpo.ref_server.hub")
DROPPED_SEQS_KEPT = 100_000   # seqs of stale-dropped groups remembered for late acknowledgements


@dataclass
class QueuedGroup:
    """An accepted group: its queue position (``seq``, also its spool file's), and its batch rows once ready."""

    seq: int
    group: RolloutGroup
    spool_path: Path | None
    rows: GroupRows | None = None     # the group laid out as batch rows, set when it becomes ready
    ready: bool = False
    failures: int = 0                 # its leases that expired untrained and unacknowledged (ref_server.hub.leases)


@dataclass
class HubCounters:
    accepted: int = 0
    duplicates: int = 0
    rejected: int = 0
    refused_stale: int = 0        # stale already when uploaded: never accepted
    dropped_stale: int = 0        # accepted, then made stale by the learner's progress while queued
    dropped_ref_failure: int = 0
    leased: int = 0
    consumed: int = 0
    lease_expired: int = 0
    rejected_full: int = 0
    spool_reloaded: int = 0
    spool_corrupt: int = 0
    quarantined: int = 0          # failed delivery too often (ref_server.max_deliveries): moved aside, never redelivered


class RolloutQueue:
    """Accepted groups not leased, oldest first, bounded by ``capacity`` (uploads still writing their spool file,
    ``reserved``, count against it)."""

    def __init__(self, *, capacity: int, max_staleness: int, temperature: float | None = None,
                 spool_dir: str | Path | None = None) -> None:
        self.capacity = capacity
        self.max_staleness = max_staleness
        # None: groups of any temperature are accepted, and a batch takes the oldest groups of one temperature
        self.temperature = temperature
        self.counters = HubCounters()
        self.learner_version = 0
        self.groups_per_step: int | None = None   # the learner's global batch in groups, from its version reports
        self.groups: OrderedDict[int, QueuedGroup] = OrderedDict()
        self.reserved = 0            # uploads admitted and still writing their spool file (count against capacity)
        # seqs of groups to be leased alone (their deliveries failed repeatedly); gone ones are dropped lazily
        self.suspects: set[int] = set()
        # (policy_version, seq) of queued groups, oldest version on top: staleness drops pop from here
        self._by_version: list[tuple[int, int]] = []
        # seqs of the groups dropped as stale, newest last (bounded): a late acknowledgement of an expired lease
        # whose groups were dropped since counts them as consumed, not dropped (the learner trained them)
        self.dropped_seqs: OrderedDict[int, None] = OrderedDict()
        self.cond = threading.Condition()
        self.spool = RolloutSpool(spool_dir) if spool_dir else None

    # -- state --------------------------------------------------------------------------------------------
    def depth(self) -> int:
        with self.cond:
            return len(self.groups)

    def ready_depth(self) -> int:
        with self.cond:
            return sum(1 for e in self.groups.values() if e.ready)

    def same_temperature(self, group: RolloutGroup) -> bool:
        """Whether ``group`` was sampled at the temperature this hub batches (any, when it was not told one)."""
        return self.temperature is None or group.sampling.temperature == self.temperature

    # -- groups in and out (the caller holds cond) ---------------------------------------------------------
    def add_locked(self, entry: QueuedGroup) -> None:
        """Queue a newly accepted (or reloaded) group at the back."""
        self.groups[entry.seq] = entry
        heapq.heappush(self._by_version, (entry.group.policy_version, entry.seq))
        if len(self._by_version) > 2 * len(self.groups) + 64:  # mostly groups gone since: rebuild (amortised)
            self._by_version = [(e.group.policy_version, e.seq) for e in self.groups.values()]
            heapq.heapify(self._by_version)

    def requeue_locked(self, entries: list[QueuedGroup]) -> None:
        """Put leased groups back, in arrival order among the queued ones (so they are the next batch), then drop
        those that went stale while leased."""
        for entry in entries:
            self.groups[entry.seq] = entry
            heapq.heappush(self._by_version, (entry.group.policy_version, entry.seq))
        self.groups = OrderedDict(sorted(self.groups.items()))
        self.drop_stale_locked()

    def oldest_ready_locked(self, num_groups: int) -> list[QueuedGroup] | None:
        """The oldest ready groups of one temperature (the oldest group's), or None if there are too few.

        A queued ``suspects`` group (its deliveries failed repeatedly) that is ready comes first and alone (a batch
        of one), so that the group that keeps crashing its consumer is told apart from the good groups it was
        batched with."""
        for seq in sorted(self.suspects):
            entry = self.groups.get(seq)
            if entry is None:   # leased (a new failure adds it again), consumed or dropped
                self.suspects.discard(seq)
            elif entry.ready:
                return [entry]
        chosen: list[QueuedGroup] = []
        for entry in self.groups.values():
            if entry.ready and (not chosen or entry.group.sampling.temperature ==
                                chosen[0].group.sampling.temperature):
                chosen.append(entry)
                if len(chosen) == num_groups:
                    return chosen
        return None

    def mark_ready(self, entry: QueuedGroup, rows: GroupRows) -> None:
        """The group's batch rows are laid out (reference logprobs attached): a lease may take it."""
        with self.cond:
            entry.rows = rows
            entry.ready = True
            self.cond.notify_all()

    def quarantine_locked(self, entry: QueuedGroup, reason: str) -> None:
        """Take a group out of delivery for good (it is not queued): its spool file moves to the spool's
        ``quarantine/`` folder with the reason beside it (kept across restarts, never reloaded); counted."""
        self.counters.quarantined += 1
        where = None
        if entry.spool_path is not None:
            try:
                where = self.spool.quarantine(entry.spool_path, reason)
            except OSError as exc:  # a spool file gone or a full disk must not fail the lease request that expired it
                log.error("could not move %s to the spool's quarantine folder (%s)", entry.spool_path, exc)
        log.error("group %s quarantined (%s)%s", entry.group.group_id, reason, f": moved to {where}" if where else "")

    def record_failures_locked(self, entry: QueuedGroup) -> None:
        """Keep the group's failed deliveries beside its spool file (a restart goes on counting from there)."""
        if entry.spool_path is None:
            return
        try:
            self.spool.set_failures(entry.spool_path, entry.failures)
        except OSError as exc:  # the count then restarts at the last one written: logged, not fatal
            log.error("could not record the failed deliveries of %s (%s)", entry.spool_path.name, exc)

    def unspool(self, entry: QueuedGroup) -> None:
        """Delete the group's spool file (it was consumed or dropped)."""
        if entry.spool_path is not None:
            self.spool.remove(entry.spool_path)

    # -- the learner's version and staleness ---------------------------------------------------------------
    def report_version(self, version: int, groups_per_step: int | None = None) -> int:
        """The learner's current policy version (and its global batch in groups, which paces the generators);
        drops what it makes stale. Returns how many were dropped."""
        with self.cond:
            if version < self.learner_version:
                raise ValueError(f"version {version} is older than the reported {self.learner_version}")
            self.learner_version = version
            if groups_per_step is not None:
                self.groups_per_step = groups_per_step
            dropped = self.drop_stale_locked()
            self.cond.notify_all()  # generators waiting for a budget
        return dropped

    def stale_floor(self, min_version: int | None = None) -> int:
        """The oldest version not stale: the learner's minus ``max_staleness`` (or a lease's own ``min_version``)."""
        floor = self.learner_version - self.max_staleness
        return floor if min_version is None else max(floor, min_version)

    def is_stale(self, version: int) -> bool:
        return version < self.stale_floor()

    def drop_stale_locked(self, min_version: int | None = None) -> int:
        """Drop queued groups older than the staleness bound (and than ``min_version``, a lease's own bound)."""
        floor = self.stale_floor(min_version)
        stale = []
        while self._by_version and self._by_version[0][0] < floor:
            _, seq = heapq.heappop(self._by_version)
            entry = self.groups.pop(seq, None)
            if entry is not None:  # else taken, acknowledged or dropped since it was pushed
                stale.append(entry)
                self.unspool(entry)
                self.dropped_seqs[seq] = None
        while len(self.dropped_seqs) > DROPPED_SEQS_KEPT:
            self.dropped_seqs.popitem(last=False)
        if stale:
            self.counters.dropped_stale += len(stale)
            log.info("dropped %d groups older than version %d (learner at version %d, max_staleness %d)",
                     len(stale), floor, self.learner_version, self.max_staleness)
        return len(stale)
