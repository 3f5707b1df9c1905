"""The hub's intake: generators' uploads into the shared :class:`ref_server.hub.queue.RolloutQueue`.

* Validation: a group that could not join a batch is refused at upload (a temperature other than the hub's, a
  policy version the learner has not published, unsafe ids, values not finite in float32), so it can never take
  other groups down with it; in a batch upload it is refused alone (its own answer says why) and the others are
  queued. A group already stale when uploaded is answered ``dropped: stale`` and never queued.
* Bounded: when ``capacity`` groups are held, :meth:`Intake.put` raises :class:`HubFull` (HTTP 429), before the
  group is decoded when its id (read from the header alone) is not one already seen.
* Duplicates: a group id seen recently is acknowledged again without being queued twice, so a generator may
  safely retry an upload whose answer it did not receive.
* Spool: every accepted group is written to the spool before it is acknowledged to the generator; the files of
  one upload are written and fsynced together (a group commit: one wait for the disk per request) before the upload
  takes the lock, and only renamed under it. At start-up
  :meth:`Intake.reload_spool` queues the spooled groups again, in their order.
* Reference logprobs are computed in the background as groups arrive (when a scorer is given), and so are the
  teacher's (on-policy distillation, when a teacher scorer is given; the same pool as the reference's when they are
  one model: scored once); each group is laid out as batch rows once both are in (:mod:`ref_server.hub.batching`),
  so a lease finds them ready.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch

from ref_server.hub.batching import GroupRows
from ref_server.hub.queue import QueuedGroup, RolloutQueue
from ref_server.hub.spool import SpooledLease
from ref_server.scoring.context import ContextTooLong, check_group
from ref_server.scoring.scorer import ReferenceScorer, Row, TopRow
from shared.protocol import strict_json
from shared.protocol.errors import ProtocolError
from shared.protocol.records import RolloutGroup
from shared.protocol.token_versions import newest_version
from shared.protocol.wire import JSON_KEY, WireError, read_header

log = logging.getLogger("grpo.ref_server.hub")


class HubFull(RuntimeError):
    """The queue holds ``capacity`` groups; retry after the learner has consumed some."""


class GroupRejected(ValueError):
    """A well-formed group that this hub cannot batch (HTTP 422); the message says why."""


class Intake:
    def __init__(self, queue: RolloutQueue, *, scorer: ReferenceScorer | None, vocab_size: int | None = None,
                 published_version: Callable[[], int | None] = lambda: None, max_context: int | None = None,
                 teacher: ReferenceScorer | None = None, teacher_top_k: int = 0) -> None:
        """``teacher_top_k`` >= 1: the teacher also gives its top-k next tokens at every completion position (top-k
        distillation; the ref server reads it from the config it was started with, ``algorithm.distill``:
        ``GRPOConfig.algorithm.distill_top_k``), 0: only the sampled tokens' logprobs."""
        self.queue = queue
        self.max_context = max_context
        self.scorer = scorer
        self.teacher = teacher
        self.teacher_top_k = teacher_top_k if teacher is not None else 0
        self.vocab_size = vocab_size
        self._published_version = published_version
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._seen_limit = max(10_000, 4 * queue.capacity)
        self._next_seq = 0
        # Decode + validation and the row layout run one upload at a time. They are GIL-bound (dozens of small torch
        # ops, each releasing and retaking the GIL), so the threads of one process gain nothing from running them in
        # parallel, and on several cores they pay for it: ~200 context switches and 2-4x the CPU per group measured
        # with 40 uploads at once on 2 cores (docs/hub-capacity.md). Waiting on this lock costs no CPU. None: no gate.
        self.cpu_gate: threading.Lock | None = threading.Lock()
        # groups submitted to each model's scorer and not answered yet (a scorer pool with nobody to score waits)
        self._unscored = {"reference": 0, "teacher": 0}
        self._unscored_lock = threading.Lock()

    # -- uploads ------------------------------------------------------------------------------------------
    def put(self, data: bytes) -> dict:
        """Validate and enqueue one encoded group. Returns the answer for the generator (depth included); a refused
        group raises (WireError: not a group; ProtocolError, GroupRejected: a group the hub cannot take), counted in
        ``rejected``."""
        try:
            self._refuse_if_full(data)
            group = self._decode(data)
            with self.queue.cond:
                refused = self._admit(group)
        except ValueError:
            with self.queue.cond:
                self.queue.counters.rejected += 1
            raise
        if refused is not None:
            return refused
        return self._spool_and_queue([(group, data)])[0]

    def put_many(self, messages: list[bytes]) -> list[dict]:
        """Enqueue several encoded groups, in order, with one answer each. A bad group is refused alone: its answer
        is ``{"accepted": false, "refused": reason, "status": 400 or 422}`` (counted in ``rejected``) and the
        others are queued. A full queue raises HubFull after the groups before it were queued; a retry of the same
        request answers those as duplicates.

        The groups admitted are spooled together (one group commit: one wait for the disk per request) and queued
        in their order before any of them is answered as accepted."""
        answers: list[dict | None] = [None] * len(messages)
        admitted: list[tuple[int, RolloutGroup, bytes]] = []
        full: HubFull | None = None
        for i, data in enumerate(messages):
            try:
                self._refuse_if_full(data)
                group = self._decode(data)
                with self.queue.cond:
                    answers[i] = self._admit(group)
            except HubFull as exc:
                full = exc
                break
            except ValueError as exc:  # WireError, ProtocolError, GroupRejected: this group only
                with self.queue.cond:
                    self.queue.counters.rejected += 1
                log.warning("upload: group %d of %d refused: %s", i, len(messages), exc)
                answers[i] = self._answer(accepted=False, refused=str(exc)[:500],
                                          status=400 if isinstance(exc, WireError) else 422)
                continue
            if answers[i] is None:
                admitted.append((i, group, data))
        if admitted:
            queued = self._spool_and_queue([(group, data) for _, group, data in admitted])
            for (i, _, _), answer in zip(admitted, queued):
                answers[i] = answer
        if full is not None:
            raise full
        return answers

    def _decode(self, data: bytes) -> RolloutGroup:
        with self._gate():
            return RolloutGroup.from_bytes(data, self.vocab_size)  # validated once (it was twice: ~0.9 ms a group)

    def _gate(self) -> AbstractContextManager:
        return self.cpu_gate if self.cpu_gate is not None else nullcontext()

    def _refuse_if_full(self, data: bytes) -> None:
        """HubFull before the group is decoded (~1 ms of CPU for 16 x 512 tokens) when the queue is full, unless the
        group is one already seen (a retry: :meth:`_admit` answers it as a duplicate). Reads only the header."""
        queue = self.queue
        with queue.cond:
            if len(queue.groups) + queue.reserved < queue.capacity:
                return
        group_id = _group_id_in_header(data)
        with queue.cond:
            if len(queue.groups) + queue.reserved >= queue.capacity and group_id not in self._seen:
                queue.counters.rejected_full += 1
                raise HubFull(f"rollout queue is full ({queue.capacity} groups)")

    def _spool_and_queue(self, admitted: list[tuple[RolloutGroup, bytes]]) -> list[dict]:
        """Spool ``admitted`` (groups :meth:`_admit` reserved a place for) in one group commit, outside the lock, then
        queue them in order under it; their answers (each with the depth just after it was queued). A spool error
        frees their places and is raised: none of them is queued."""
        queue = self.queue
        try:
            written = self._spool_write([(group.group_id, data) for group, data in admitted])
        except BaseException:
            with queue.cond:
                queue.reserved -= len(admitted)
                for group, _ in admitted:
                    self._seen.pop(group.group_id, None)
            raise
        entries, answers = [], []
        with queue.cond:
            queue.reserved -= len(admitted)
            for k, (group, _) in enumerate(admitted):
                seq = self._next_seq
                self._next_seq += 1
                spool_path = queue.spool.commit(written[k], seq, group.group_id) if written is not None else None
                entry = QueuedGroup(seq, group, spool_path)
                queue.add_locked(entry)
                queue.counters.accepted += 1
                entries.append(entry)
                answers.append(self._answer(accepted=True))
        for entry in entries:
            self._start_scoring(entry)
        return answers

    def _admit(self, group: RolloutGroup) -> dict | None:
        """Under the lock: the answer for a group not to be queued (a duplicate, stale already), or None when it
        may be, with a place reserved for it. Raises :class:`GroupRejected` or :class:`HubFull`."""
        queue = self.queue
        if group.group_id in self._seen:
            queue.counters.duplicates += 1
            return self._answer(accepted=True, duplicate=True)
        self._check_batchable(group)
        if queue.is_stale(group.policy_version):
            queue.counters.refused_stale += 1
            self._remember(group.group_id)
            return self._answer(accepted=False, dropped="stale")
        if len(queue.groups) + queue.reserved >= queue.capacity:
            queue.counters.rejected_full += 1
            raise HubFull(f"rollout queue is full ({queue.capacity} groups)")
        queue.reserved += 1
        self._remember(group.group_id)  # a retry arriving while this one writes is answered as a duplicate
        return None

    def _answer(self, **fields) -> dict:
        queue = self.queue
        return {**fields, "queue_depth": len(queue.groups), "capacity": queue.capacity,
                "learner_version": queue.learner_version}

    def _remember(self, group_id: str) -> None:
        self._seen[group_id] = None
        while len(self._seen) > self._seen_limit:
            self._seen.popitem(last=False)

    def _check_batchable(self, group: RolloutGroup) -> None:
        """Refuse what could not join a batch with the others, naming why (checked under the lock)."""
        queue = self.queue
        if not queue.same_temperature(group):
            raise GroupRejected(f"group sampled at temperature {group.sampling.temperature}, but this hub batches "
                                f"groups sampled at {queue.temperature} (generator.sampling.temperature in the ref "
                                "server's config)")
        try:  # the rule /v1/logprobs applies: a row longer than the model's context is never queued
            check_group(self.max_context, group)
        except ContextTooLong as exc:  # counted in ``rejected`` by the caller (trust-numbers' put/put_many)
            raise GroupRejected(str(exc)) from None
        newest = max(queue.learner_version, self._published_version() or 0)
        sampled = newest_version(group)  # its newest token's version (policy_version, the oldest, without them)
        if sampled > newest:
            what = "policy_version" if group.token_versions is None else "token version"
            raise GroupRejected(f"{what} {sampled} is newer than any version the learner has published ({newest})")

    def _spool_write(self, groups: list[tuple[str, bytes]]) -> list[Path] | None:
        """The groups' bytes, durable on disk under temporary names after one wait for the disk (None without a
        spool); the slow part of an upload, called outside the lock."""
        spool = self.queue.spool
        return spool.write_many(groups) if spool is not None else None

    # -- reference logprobs and batch rows, in the background ---------------------------------------------
    def _start_scoring(self, entry: QueuedGroup) -> None:
        """Submit the group's rows to the reference scorer and the teacher's (one submission when they are one
        pool); the group is laid out when every submission is answered."""
        scorers = list(dict.fromkeys(s for s in (self.scorer, self.teacher) if s is not None))  # distinct, in order
        if not scorers:
            self._mark_ready(entry, None)
            return
        group = entry.group
        prompt = group.prompt_ids.tolist()
        rows = [Row(prompt + group.completion_ids[i, :int(n)].tolist(), len(prompt))
                for i, n in enumerate(group.completion_lengths)]
        # the teacher's submission asks for its top-k (one submission when it is the reference's pool: the reference
        # logprobs are then the TopRows' own, the same logits expression)
        futures = {id(s): s.submit(rows, group.sampling.temperature, *([self.teacher_top_k] if s is self.teacher
                                                                        and self.teacher_top_k else []))
                   for s in scorers}
        remaining, lock = [len(futures)], threading.Lock()
        for role, scorer in (("reference", self.scorer), ("teacher", self.teacher)):
            if scorer is not None:  # counted down before the group is laid out (callbacks run in their order)
                self._count_unscored(role, 1)
                futures[id(scorer)].add_done_callback(lambda _, role=role: self._count_unscored(role, -1))

        def answered(_) -> None:
            with lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            self._scored(entry, futures.get(id(self.scorer)), futures.get(id(self.teacher)))

        for future in futures.values():
            future.add_done_callback(answered)

    def _count_unscored(self, role: str, change: int) -> None:
        with self._unscored_lock:
            self._unscored[role] += change

    def unscored(self) -> dict[str, int]:
        """Groups waiting for each model's logprobs (``reference``, ``teacher``): submitted, not answered yet."""
        with self._unscored_lock:
            return dict(self._unscored)

    def _scored(self, entry: QueuedGroup, reference, teacher) -> None:
        """Both Futures answered (None: that model is not scored): the group's rows, or the group dropped."""
        results, error = [], None
        for what, future in (("reference", reference), ("teacher", teacher)):
            if future is None:
                results.append(None)
            elif (error := future.exception()) is not None:
                error = f"{what}: {error}"
                break
            elif not all(_finite(r) for r in future.result()):
                error = f"{what} logprobs are not finite"
                break
            else:
                results.append(future.result())
        if results and results[0] and isinstance(results[0][0], TopRow):  # the reference is the teacher's pool
            results[0] = [row.logprobs for row in results[0]]
        if error is None:
            self._mark_ready(entry, *results)
            return
        log.error("scoring failed for group %s: %s; dropping it", entry.group.group_id, error)
        queue = self.queue
        with queue.cond:
            if queue.groups.pop(entry.seq, None) is not None:
                queue.counters.dropped_ref_failure += 1
                queue.unspool(entry)

    def _mark_ready(self, entry: QueuedGroup, ref_logprobs: list[torch.Tensor] | None,
                    teacher_logprobs: list[torch.Tensor] | None = None) -> None:
        with self._gate():
            rows = GroupRows.of(entry.group, ref_logprobs, teacher_logprobs)  # in the uploading or scoring thread, not in a lease
        self.queue.mark_ready(entry, rows)

    # -- restart ------------------------------------------------------------------------------------------
    def reload_spool(self, triage: Callable[[QueuedGroup], bool] = lambda entry: True,
                     restore: Callable[[list[SpooledLease], dict[int, QueuedGroup]], set[int]] = lambda *_: set(),
                     ) -> None:
        """Queue the spooled groups again in their order, each under the sequence number it was spooled with and
        with the failed deliveries recorded for it, except those ``restore(leases, entries)`` holds again in the
        leases found beside them (it returns their sequence numbers; :meth:`ref_server.hub.leases.Leases.restore`);
        ``triage(entry)`` False: not queued (quarantined). ``spool_reloaded`` counts the groups queued or held."""
        queue = self.queue
        assert queue.spool is not None
        found = queue.spool.reload(self._check_reloaded)
        queue.counters.spool_corrupt += found.corrupt
        entries: dict[int, QueuedGroup] = {}
        for spooled in found.groups:
            self._next_seq = max(self._next_seq, spooled.seq + 1)
            entries[spooled.seq] = QueuedGroup(spooled.seq, spooled.group, spooled.path, failures=spooled.failures)
            self._remember(spooled.group.group_id)
        held = restore(found.leases, entries)
        pending: list[QueuedGroup] = []
        for seq, entry in entries.items():
            if seq in held:
                pending.append(entry)   # leased: its rows are laid out for when the lease expires
            elif triage(entry):
                queue.add_locked(entry)
                pending.append(entry)
        queue.counters.spool_reloaded = len(pending)
        if pending:
            log.info("reloaded %d spooled groups (%d of them leased) from %s", len(pending), len(held),
                     queue.spool.directory)
        for entry in pending:
            self._start_scoring(entry)

    def _check_reloaded(self, group: RolloutGroup) -> None:
        """A spooled group this hub can still batch (its vocabulary and temperature may have changed since)."""
        group.validate(self.vocab_size)
        if not self.queue.same_temperature(group):
            raise ProtocolError(f"sampled at temperature {group.sampling.temperature}, the hub now batches "
                                f"{self.queue.temperature}")


def _finite(row: torch.Tensor | TopRow) -> bool:
    """A scored row's logprobs (and top-k logprobs) all finite."""
    if isinstance(row, TopRow):
        return bool(torch.isfinite(row.logprobs).all() and torch.isfinite(row.top_logprobs).all())
    return bool(torch.isfinite(row).all())


def _group_id_in_header(data: bytes) -> str | None:
    """The group id in an encoded group's header (its JSON fields), without decoding the tensors; None when the
    header does not hold one (the full decode then says why)."""
    try:
        fields = strict_json.loads((read_header(data).get("__metadata__") or {}).get(JSON_KEY, "{}"))
    except (WireError, strict_json.StrictJSONError, AttributeError, TypeError):
        return None
    group_id = fields.get("group_id") if isinstance(fields, dict) else None
    return group_id if isinstance(group_id, str) else None
