"""The rollout hub: a bounded FIFO of rollout groups between generators and the learner.

* Bounded: when ``capacity`` groups are held, :meth:`RolloutHub.put` raises :class:`HubFull` (HTTP 429).
* Reference logprobs are computed in the background as groups arrive (when a scorer is given), so a learner
  asking for a batch finds them attached.
* Staleness: the learner reports its version; groups sampled more than ``max_staleness`` versions earlier are
  dropped and counted, never silently. A lease may also name the oldest version it can train (``min_version``:
  the learner leases a batch one step ahead, so it knows the version it will train it at). Generators are paced
  so that they do not sample groups that could only go stale (:meth:`RolloutHub.budget`, ref_server/pacing.py).
* Validation: a group that could not join a batch is refused at upload (a temperature other than the hub's, a
  policy version the learner has not published, unsafe ids, non-finite values), so it can never take other groups
  down with it.
* Delivery at least once: :meth:`RolloutHub.take` *leases* groups to a batch id. The learner acknowledges the batch
  once its step is applied (:meth:`RolloutHub.ack`); only then are the groups and their spool files gone. A lease
  not acknowledged (or renewed) within ``lease_timeout_s`` returns its groups to the front of the queue. The
  learner drops group ids it already trained on, which makes delivery exactly once.
* Spool: every accepted group is written to ``spool_dir`` before it is acknowledged to the generator and deleted
  on the learner's acknowledgement (or a staleness drop), so a restart (clean or not) reloads every group that was
  accepted and not yet trained on, leased ones included, in its order (file layout, commit by rename, corrupt
  files: ref_server/spool.py).
* Duplicates: a group id seen recently is acknowledged again without being queued twice, so a generator may
  safely retry an upload whose answer it did not receive.
* Cost: the lock is never held across disk writes (an upload's spool file is written and fsynced before it takes
  the lock, and only renamed under it), and no call the learner makes every step does work proportional to the
  queue: staleness drops pop a heap ordered by policy version, and :meth:`take` looks only at the groups it takes
  (and at any not-yet-scored ones ahead of them).
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ref_server.batching import GroupRows, assemble_batch
from ref_server.pacing import groups_wanted
from ref_server.scorer import ReferenceScorer, Row
from ref_server.spool import RolloutSpool
from shared.protocol.records import ProtocolError, RolloutGroup, TrainBatch

log = logging.getLogger("grpo.ref_server.hub")


class HubFull(RuntimeError):
    """The queue holds ``capacity`` groups; retry after the learner has consumed some."""


class GroupRejected(ValueError):
    """A well-formed group that this hub cannot batch (HTTP 422); the message says why."""


@dataclass
class _Entry:
    seq: int
    group: RolloutGroup
    spool_path: Path | None
    rows: GroupRows | None = None     # the group laid out as batch rows, set when it becomes ready
    ready: bool = False


@dataclass
class _Lease:
    entries: list[_Entry]
    deadline: float
    trained: bool = False   # the learner trained it and holds it for its next checkpoint (pacing leaves it out)


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


class RolloutHub:
    def __init__(
        self,
        *,
        capacity: int,
        max_staleness: int,
        scorer: ReferenceScorer | None,
        vocab_size: int | None = None,
        spool_dir: str | Path | None = None,
        temperature: float | None = None,
        lease_timeout_s: float = 300.0,
        published_version: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.scorer = scorer
        self.vocab_size = vocab_size
        # None: groups of any temperature are accepted, and a batch takes the oldest groups of one temperature
        self.temperature = temperature
        self.lease_timeout_s = lease_timeout_s
        self._published_version = published_version
        self.counters = HubCounters()
        self.learner_version = 0
        self.groups_per_step: int | None = None   # the learner's global batch in groups, from its version reports
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._leases: dict[str, _Lease] = {}
        # batch ids acknowledged (-> None) or expired and requeued (-> their groups' sequence numbers), so that a
        # repeated or late acknowledgement is answered correctly
        self._finished: OrderedDict[str, list[int] | None] = OrderedDict()
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._seen_limit = max(10_000, 4 * capacity)
        self._next_seq = 0
        self._reserved = 0            # uploads admitted and still writing their spool file (count against capacity)
        # (policy_version, seq) of queued groups, oldest version on top: staleness drops pop from here. Entries of
        # groups taken, acknowledged or already dropped are skipped when they surface (a requeued lease pushes again)
        self._by_version: list[tuple[int, int]] = []
        self._cond = threading.Condition()
        self.spool = RolloutSpool(spool_dir) if spool_dir else None
        if self.spool is not None:
            self._reload_spool()

    # -- generators ---------------------------------------------------------------------------------------
    def put(self, data: bytes) -> dict:
        """Validate and enqueue one encoded group. Returns the answer for the generator (depth included)."""
        return self._enqueue(RolloutGroup.from_bytes(data).validate(self.vocab_size), data)

    def put_many(self, messages: list[bytes]) -> list[dict]:
        """Enqueue several encoded groups, in order, with one answer each. Every group is decoded and validated
        before any is queued: a bad one (a ValueError naming its index) queues none. A full queue raises HubFull
        after the groups before it were queued; a retry of the same request answers those as duplicates."""
        groups = []
        for i, data in enumerate(messages):
            try:
                group = RolloutGroup.from_bytes(data).validate(self.vocab_size)
                with self._cond:
                    self._check_batchable(group)
            except ValueError as exc:
                raise type(exc)(f"group {i} of {len(messages)} (none queued): {exc}") from None
            groups.append(group)
        return [self._enqueue(group, data) for group, data in zip(groups, messages)]

    def _enqueue(self, group: RolloutGroup, data: bytes) -> dict:
        with self._cond:
            if group.group_id in self._seen:
                self.counters.duplicates += 1
                return self._answer(accepted=True, duplicate=True)
            self._check_batchable(group)
            if self._is_stale(group.policy_version):
                self.counters.refused_stale += 1
                self._remember(group.group_id)
                return self._answer(accepted=False, dropped="stale")
            if len(self._entries) + self._reserved >= self.capacity:
                self.counters.rejected_full += 1
                raise HubFull(f"rollout queue is full ({self.capacity} groups)")
            self._reserved += 1
            self._remember(group.group_id)  # a retry arriving while this one writes is answered as a duplicate
        try:
            written = self._spool_write(group.group_id, data)  # the slow part (fsync), outside the lock
        except BaseException:
            with self._cond:
                self._reserved -= 1
                self._seen.pop(group.group_id, None)
            raise
        with self._cond:
            self._reserved -= 1
            seq = self._next_seq
            self._next_seq += 1
            spool_path = self.spool.commit(written, seq, group.group_id) if written is not None else None
            entry = _Entry(seq, group, spool_path)
            self._entries[seq] = entry
            heapq.heappush(self._by_version, (group.policy_version, seq))
            if len(self._by_version) > 2 * len(self._entries) + 64:  # mostly groups gone since: rebuild (amortised)
                self._by_version = [(e.group.policy_version, e.seq) for e in self._entries.values()]
                heapq.heapify(self._by_version)
            self.counters.accepted += 1
        self._start_scoring(entry)
        return self._answer(accepted=True)

    # -- learner ------------------------------------------------------------------------------------------
    def report_version(self, version: int, groups_per_step: int | None = None) -> int:
        """The learner's current policy version (and its global batch in groups, which paces the generators);
        drops what it makes stale. Returns how many were dropped."""
        with self._cond:
            if version < self.learner_version:
                raise ValueError(f"version {version} is older than the reported {self.learner_version}")
            self.learner_version = version
            if groups_per_step is not None:
                self.groups_per_step = groups_per_step
            dropped = self._drop_stale()
            self._cond.notify_all()  # generators waiting for a budget
        return dropped

    def budget(self, policy_version: int, wait_s: float = 0.0) -> dict:
        """How many groups sampled at ``policy_version`` the learner can still train within ``max_staleness``
        (:func:`ref_server.pacing.groups_wanted`); waits up to ``wait_s`` while that is 0 and the learner's version
        stays the same (a new version means new weights for the generator, which changes its answer).

        ``wanted`` is None while the learner has not said how many groups a step takes (any number, up to the
        queue's capacity, is welcome then)."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            seen_version = self.learner_version
            while True:
                wanted = self._wanted(policy_version)
                remaining = deadline - time.monotonic()
                if wanted != 0 or self.learner_version != seen_version or remaining <= 0:
                    return {"wanted": wanted, "learner_version": self.learner_version,
                            "groups_per_step": self.groups_per_step, "queue_depth": len(self._entries)}
                self._cond.wait(timeout=min(remaining, 1.0))

    def take(self, num_groups: int, timeout: float = 0.0, min_version: int | None = None) -> TrainBatch | None:
        """Lease the ``num_groups`` oldest ready groups as one batch, waiting up to ``timeout`` s; None if not enough.

        ``min_version``: the learner will train this batch at a version that makes groups older than this stale;
        they are dropped (and counted) first, as a version report would drop them.

        The groups stay spooled until :meth:`ack` names the batch id; an unacknowledged lease expires after
        ``lease_timeout_s`` and its groups go back to the front of the queue."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._expire_leases()
                if min_version is not None:
                    self._drop_stale(min_version)
                chosen = self._oldest_ready(num_groups)
                if chosen is not None:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(timeout=min(remaining, 1.0))
            for entry in chosen:
                del self._entries[entry.seq]
            batch_id = uuid.uuid4().hex
            self._leases[batch_id] = _Lease(chosen, time.monotonic() + self.lease_timeout_s)
            self.counters.leased += len(chosen)
            self._cond.notify_all()  # fewer queued groups: generators waiting for a budget may go on
        return assemble_batch([e.group for e in chosen], [e.rows for e in chosen], batch_id=batch_id)

    def ack(self, batch_ids: list[str]) -> dict[str, str]:
        """The learner applied these batches: their groups are consumed (spool files deleted).

        Per id: ``"acked"``; ``"already"`` (acknowledged before); ``"late"`` (the lease had expired: the groups
        still waiting in the queue are removed, those leased again stay with their new batch, which the learner
        acknowledges after dropping them as already trained); ``"unknown"``."""
        answer = {}
        with self._cond:
            for batch_id in batch_ids:
                lease = self._leases.pop(batch_id, None)
                if lease is not None:
                    done = lease.entries
                    answer[batch_id] = "acked"
                elif batch_id in self._finished:
                    requeued = self._finished[batch_id] or []
                    done = [self._entries.pop(seq) for seq in requeued if seq in self._entries]
                    answer[batch_id] = "late" if requeued else "already"
                else:
                    answer[batch_id] = "unknown"
                    continue
                for entry in done:
                    self._unspool(entry)
                self.counters.consumed += len(done)
                self._finish(batch_id, None)
            self._cond.notify_all()
        return answer

    def release(self, batch_ids: list[str]) -> dict[str, str]:
        """The learner hands back leases it will not train (it is stopping): their groups go back to the front of
        the queue now rather than after the lease timeout. Per id: ``"released"`` or ``"unknown"``."""
        with self._cond:
            answer = {}
            for batch_id in batch_ids:
                lease = self._leases.get(batch_id)
                if lease is None:
                    answer[batch_id] = "unknown"
                    continue
                lease.deadline = float("-inf")
                answer[batch_id] = "released"
            self._expire_leases(reason="handed back")
        return answer

    def renew(self, batch_ids: list[str], trained: bool = False) -> dict[str, str]:
        """Extend these leases by ``lease_timeout_s`` from now (the learner holds them until its checkpoint).
        ``trained``: the learner has trained them (they are held only for the checkpoint), so they no longer count
        among the groups it will train before newly sampled ones (:meth:`budget`)."""
        answer = {}
        with self._cond:
            self._expire_leases()
            for batch_id in batch_ids:
                lease = self._leases.get(batch_id)
                if lease is not None:
                    lease.deadline = time.monotonic() + self.lease_timeout_s
                    lease.trained = lease.trained or trained
                answer[batch_id] = "renewed" if lease is not None else "unknown"
            if trained:
                self._cond.notify_all()
        return answer

    # -- state --------------------------------------------------------------------------------------------
    def depth(self) -> int:
        with self._cond:
            return len(self._entries)

    def ready_depth(self) -> int:
        with self._cond:
            return sum(1 for e in self._entries.values() if e.ready)

    def leased_depth(self) -> int:
        """Groups handed to the learner and not yet acknowledged."""
        with self._cond:
            return sum(len(lease.entries) for lease in self._leases.values())

    # -- internals ----------------------------------------------------------------------------------------
    def _answer(self, **fields) -> dict:
        return {**fields, "queue_depth": len(self._entries), "capacity": self.capacity,
                "learner_version": self.learner_version}

    def _remember(self, group_id: str) -> None:
        self._seen[group_id] = None
        while len(self._seen) > self._seen_limit:
            self._seen.popitem(last=False)

    def _same_temperature(self, group: RolloutGroup) -> bool:
        """Whether ``group`` was sampled at the temperature this hub batches (any, when it was not told one)."""
        return self.temperature is None or group.sampling.temperature == self.temperature

    def _check_batchable(self, group: RolloutGroup) -> None:
        """Refuse what could not join a batch with the others, naming why (checked under the lock)."""
        if not self._same_temperature(group):
            self.counters.rejected += 1
            raise GroupRejected(f"group sampled at temperature {group.sampling.temperature}, but this hub batches "
                                f"groups sampled at {self.temperature} (generator.sampling.temperature in the ref "
                                "server's config)")
        newest = max(self.learner_version, self._published_version() or 0)
        if group.policy_version > newest:
            self.counters.rejected += 1
            raise GroupRejected(f"policy_version {group.policy_version} is newer than any version the learner has "
                                f"published ({newest})")

    def _oldest_ready(self, num_groups: int) -> list[_Entry] | None:
        """The oldest ready groups of one temperature (the oldest group's), or None if there are too few."""
        chosen: list[_Entry] = []
        for entry in self._entries.values():
            if entry.ready and (not chosen or entry.group.sampling.temperature ==
                                chosen[0].group.sampling.temperature):
                chosen.append(entry)
                if len(chosen) == num_groups:
                    return chosen
        return None

    def _expire_leases(self, reason: str = "") -> None:
        now = time.monotonic()
        expired = [batch_id for batch_id, lease in self._leases.items() if lease.deadline <= now]
        if not expired:
            return
        for batch_id in expired:
            lease = self._leases.pop(batch_id)
            for entry in lease.entries:
                self._entries[entry.seq] = entry
                heapq.heappush(self._by_version, (entry.group.policy_version, entry.seq))
            self.counters.lease_expired += len(lease.entries)
            self._finish(batch_id, [e.seq for e in lease.entries])
            if reason:
                log.info("batch %s was %s: its %d groups are queued again", batch_id, reason, len(lease.entries))
            else:
                log.warning("batch %s was not acknowledged within %.1fs: its %d groups are queued again", batch_id,
                            self.lease_timeout_s, len(lease.entries))
        # back in arrival order, so the requeued groups are the next batch
        self._entries = OrderedDict(sorted(self._entries.items()))
        self._drop_stale()  # requeued groups may have gone stale while leased
        self._cond.notify_all()

    def _finish(self, batch_id: str, requeued: list[int] | None) -> None:
        self._finished[batch_id] = requeued
        while len(self._finished) > 10_000:
            self._finished.popitem(last=False)

    def _wanted(self, policy_version: int) -> int | None:
        if self.groups_per_step is None:
            return None
        # leases not yet trained: the learner's batch in training and the one it prefetched
        leased = sum(len(lease.entries) for lease in self._leases.values() if not lease.trained)
        return groups_wanted(generator_version=policy_version, learner_version=self.learner_version,
                             leased_groups=leased, queued_groups=len(self._entries) + self._reserved,
                             groups_per_step=self.groups_per_step, max_staleness=self.max_staleness)

    def _stale_floor(self, min_version: int | None = None) -> int:
        """The oldest version not stale: the learner's minus ``max_staleness`` (or a lease's own ``min_version``)."""
        floor = self.learner_version - self.max_staleness
        return floor if min_version is None else max(floor, min_version)

    def _is_stale(self, version: int) -> bool:
        return version < self._stale_floor()

    def _drop_stale(self, min_version: int | None = None) -> int:
        """Drop queued groups older than the staleness bound (and than ``min_version``, a lease's own bound)."""
        floor = self._stale_floor(min_version)
        stale = []
        while self._by_version and self._by_version[0][0] < floor:
            _, seq = heapq.heappop(self._by_version)
            entry = self._entries.pop(seq, None)
            if entry is not None:  # else taken, acknowledged or dropped since it was pushed
                stale.append(entry)
                self._unspool(entry)
        if stale:
            self.counters.dropped_stale += len(stale)
            log.info("dropped %d groups older than version %d (learner at version %d, max_staleness %d)",
                     len(stale), floor, self.learner_version, self.max_staleness)
        return len(stale)

    def _start_scoring(self, entry: _Entry) -> None:
        if self.scorer is None:
            self._mark_ready(entry, None)
            return
        group = entry.group
        prompt = group.prompt_ids.tolist()
        rows = [Row(prompt + group.completion_ids[i, :int(n)].tolist(), len(prompt))
                for i, n in enumerate(group.completion_lengths)]
        future = self.scorer.submit(rows, group.sampling.temperature)
        future.add_done_callback(lambda f: self._scored(entry, f))

    def _scored(self, entry: _Entry, future) -> None:
        error = future.exception()
        if error is None:
            result = future.result()
            if all(bool(torch.isfinite(r).all()) for r in result):
                self._mark_ready(entry, result)
                return
            error = ValueError("reference logprobs are not finite")
        log.error("reference scoring failed for group %s: %s; dropping it", entry.group.group_id, error)
        with self._cond:
            if self._entries.pop(entry.seq, None) is not None:
                self.counters.dropped_ref_failure += 1
                self._unspool(entry)

    def _mark_ready(self, entry: _Entry, ref_logprobs: list[torch.Tensor] | None) -> None:
        rows = GroupRows.of(entry.group, ref_logprobs)  # in the uploading or scoring thread, not in take()
        with self._cond:
            entry.rows = rows
            entry.ready = True
            self._cond.notify_all()

    def _spool_write(self, group_id: str, data: bytes) -> Path | None:
        """The group's bytes, durable on disk under a temporary name (None without a spool); the slow part of an
        upload, called outside the lock."""
        return self.spool.write(group_id, data) if self.spool is not None else None

    def _unspool(self, entry: _Entry) -> None:
        if entry.spool_path is not None:
            self.spool.remove(entry.spool_path)

    def _check_reloaded(self, group: RolloutGroup) -> None:
        """A spooled group this hub can still batch (its vocabulary and temperature may have changed since)."""
        group.validate(self.vocab_size)
        if not self._same_temperature(group):
            raise ProtocolError(f"sampled at temperature {group.sampling.temperature}, the hub now batches "
                                f"{self.temperature}")

    def _reload_spool(self) -> None:
        """Queue the spooled groups again in their order, each under the sequence number it was spooled with."""
        assert self.spool is not None
        found = self.spool.reload(self._check_reloaded)
        self.counters.spool_corrupt += found.corrupt
        pending: list[_Entry] = []
        for spooled in found.groups:
            self._next_seq = max(self._next_seq, spooled.seq + 1)
            entry = _Entry(spooled.seq, spooled.group, spooled.path)
            self._entries[spooled.seq] = entry
            heapq.heappush(self._by_version, (spooled.group.policy_version, spooled.seq))
            self._remember(spooled.group.group_id)
            pending.append(entry)
        self.counters.spool_reloaded = len(pending)
        if pending:
            log.info("reloaded %d spooled groups from %s", len(pending), self.spool.directory)
        for entry in pending:
            self._start_scoring(entry)
