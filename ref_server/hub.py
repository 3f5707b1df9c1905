"""The rollout hub: a bounded FIFO of rollout groups between generators and the learner.

* Bounded: when ``capacity`` groups are held, :meth:`RolloutHub.put` raises :class:`HubFull` (HTTP 429).
* Reference logprobs are computed in the background as groups arrive (when a scorer is given), so a learner
  asking for a batch finds them attached.
* Staleness: the learner reports its version; groups sampled more than ``max_staleness`` versions earlier are
  dropped and counted, never silently.
* Spool: every accepted group is written to ``spool_dir`` before it is acknowledged and removed when it is handed
  to the learner, so a restart (clean or not) reloads what was accepted and not yet consumed.
* Duplicates: a group id seen recently is acknowledged again without being queued twice, so a generator may
  safely retry an upload whose answer it did not receive.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ref_server.scorer import ReferenceScorer, Row
from shared.protocol import RolloutGroup, TrainBatch
from shared.wire import WireError

log = logging.getLogger("grpo.ref_server.hub")


class HubFull(RuntimeError):
    """The queue holds ``capacity`` groups; retry after the learner has consumed some."""


@dataclass
class _Entry:
    seq: int
    group: RolloutGroup
    spool_path: Path | None
    ref_logprobs: list[torch.Tensor] | None = None
    ready: bool = False
    arrived: float = field(default_factory=time.monotonic)


@dataclass
class HubCounters:
    accepted: int = 0
    duplicates: int = 0
    dropped_stale: int = 0
    dropped_ref_failure: int = 0
    consumed: int = 0
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
        advantage: dict | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.scorer = scorer
        self.vocab_size = vocab_size
        self.advantage = advantage or {}
        self.counters = HubCounters()
        self.learner_version = 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._seen_limit = max(10_000, 4 * capacity)
        self._next_seq = 0
        self._cond = threading.Condition()
        self._on_change = on_change or (lambda: None)
        self.spool_dir = Path(spool_dir) if spool_dir else None
        if self.spool_dir is not None:
            self.spool_dir.mkdir(parents=True, exist_ok=True)
            self._reload_spool()

    # -- generators ---------------------------------------------------------------------------------------
    def put(self, data: bytes) -> dict:
        """Validate and enqueue one encoded group. Returns the answer for the generator (depth included)."""
        group = RolloutGroup.from_bytes(data).validate(self.vocab_size)
        with self._cond:
            if group.group_id in self._seen:
                self.counters.duplicates += 1
                return self._answer(accepted=True, duplicate=True)
            if self._is_stale(group.policy_version):
                self.counters.dropped_stale += 1
                self._remember(group.group_id)
                return self._answer(accepted=False, dropped="stale")
            if len(self._entries) >= self.capacity:
                self.counters.rejected_full += 1
                raise HubFull(f"rollout queue is full ({self.capacity} groups)")
            seq = self._next_seq
            self._next_seq += 1
            spool_path = self._spool(seq, group.group_id, data)
            entry = _Entry(seq, group, spool_path)
            self._entries[seq] = entry
            self._remember(group.group_id)
            self.counters.accepted += 1
        self._start_scoring(entry)
        return self._answer(accepted=True)

    # -- learner ------------------------------------------------------------------------------------------
    def report_version(self, version: int) -> int:
        """The learner's current policy version; drops what it makes stale. Returns how many were dropped."""
        with self._cond:
            if version < self.learner_version:
                raise ValueError(f"version {version} is older than the reported {self.learner_version}")
            self.learner_version = version
            dropped = self._drop_stale()
        return dropped

    def take(self, num_groups: int, timeout: float = 0.0) -> TrainBatch | None:
        """The ``num_groups`` oldest ready groups as one batch, waiting up to ``timeout`` s; None if not enough."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._drop_stale()
                ready = [e for e in self._entries.values() if e.ready]
                if len(ready) >= num_groups:
                    chosen = ready[:num_groups]
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(timeout=min(remaining, 1.0))
            for entry in chosen:
                del self._entries[entry.seq]
            self.counters.consumed += len(chosen)
        refs = [e.ref_logprobs for e in chosen] if self.scorer is not None else None
        batch = TrainBatch.from_groups([e.group for e in chosen],
                                       [torch.nn.utils.rnn.pad_sequence(r, batch_first=True) for r in refs]
                                       if refs is not None else None, **self.advantage)
        for entry in chosen:
            self._unspool(entry)
        self._on_change()
        return batch

    # -- state --------------------------------------------------------------------------------------------
    def depth(self) -> int:
        with self._cond:
            return len(self._entries)

    def ready_depth(self) -> int:
        with self._cond:
            return sum(1 for e in self._entries.values() if e.ready)

    def oldest_version(self) -> int | None:
        with self._cond:
            return min((e.group.policy_version for e in self._entries.values()), default=None)

    # -- internals ----------------------------------------------------------------------------------------
    def _answer(self, **fields) -> dict:
        return {**fields, "queue_depth": len(self._entries), "capacity": self.capacity,
                "learner_version": self.learner_version}

    def _remember(self, group_id: str) -> None:
        self._seen[group_id] = None
        while len(self._seen) > self._seen_limit:
            self._seen.popitem(last=False)

    def _is_stale(self, version: int) -> bool:
        return version < self.learner_version - self.max_staleness

    def _drop_stale(self) -> int:
        stale = [e for e in self._entries.values() if self._is_stale(e.group.policy_version)]
        for entry in stale:
            del self._entries[entry.seq]
            self._unspool(entry)
        if stale:
            self.counters.dropped_stale += len(stale)
            log.info("dropped %d groups older than version %d - %d", len(stale), self.learner_version,
                     self.max_staleness)
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
            self._mark_ready(entry, future.result())
            return
        log.error("reference scoring failed for group %s: %s; dropping it", entry.group.group_id, error)
        with self._cond:
            if self._entries.pop(entry.seq, None) is not None:
                self.counters.dropped_ref_failure += 1
                self._unspool(entry)

    def _mark_ready(self, entry: _Entry, ref_logprobs: list[torch.Tensor] | None) -> None:
        with self._cond:
            entry.ref_logprobs = ref_logprobs
            entry.ready = True
            self._cond.notify_all()
        self._on_change()

    def _spool(self, seq: int, group_id: str, data: bytes) -> Path | None:
        if self.spool_dir is None:
            return None
        path = self.spool_dir / f"{seq:012d}-{group_id}.group"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)  # a half-written spool file is never picked up: only complete renames count
        return path

    def _unspool(self, entry: _Entry) -> None:
        if entry.spool_path is not None:
            entry.spool_path.unlink(missing_ok=True)

    def _reload_spool(self) -> None:
        assert self.spool_dir is not None
        for tmp in self.spool_dir.glob("*.tmp"):
            tmp.unlink()
        files = sorted(self.spool_dir.glob("*.group"))
        pending: deque[_Entry] = deque()
        for path in files:
            try:
                int(path.name.split("-", 1)[0])
                group = RolloutGroup.from_bytes(path.read_bytes()).validate(self.vocab_size)
            except (WireError, ValueError, OSError) as exc:
                self.counters.spool_corrupt += 1
                bad = self.spool_dir / "corrupt"
                bad.mkdir(exist_ok=True)
                os.replace(path, bad / path.name)
                log.error("spool file %s is unreadable (%s); moved to %s", path.name, exc, bad)
                continue
            # Keep the spooled sequence number so that order survives any number of restarts.
            seq = int(path.name.split("-", 1)[0])
            self._next_seq = max(self._next_seq, seq + 1)
            entry = _Entry(seq, group, path)
            self._entries[seq] = entry
            self._remember(group.group_id)
            pending.append(entry)
        self.counters.spool_reloaded = len(pending)
        if pending:
            log.info("reloaded %d spooled groups from %s", len(pending), self.spool_dir)
        for entry in pending:
            self._start_scoring(entry)
