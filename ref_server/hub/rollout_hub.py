"""The rollout hub as its routes, the server's state and the tests call it: one queue, its intake and its leases.

:class:`RolloutHub` builds a :class:`RolloutQueue` and the two halves over it (:class:`Intake`: uploads;
:class:`Leases`: batches for the learner), reloads the spool, and answers the generators' pacing question
(:meth:`RolloutHub.budget`), which needs both halves: the groups queued and those leased and not yet trained.
It is the hub's one front: the routes (ref_server/hub/routes.py, the relay's session routes), the metrics and
the health check call its methods, never ``hub.intake``, ``hub.leases`` or ``hub.queue``
(tests/ref_server/test_layout.py holds this).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from ref_server.hub.intake import Intake
from ref_server.hub.leases import Leases
from ref_server.hub.pacing import groups_wanted
from ref_server.hub.queue import HubCounters, RolloutQueue
from ref_server.scoring.scorer import ReferenceScorer
from shared.protocol.records import TrainBatch


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
        max_deliveries: int = 3,
        published_version: Callable[[], int | None] = lambda: None,
        max_context: int | None = None,
        teacher: ReferenceScorer | None = None,
        teacher_top_k: int = 0,
    ) -> None:
        self.queue = RolloutQueue(capacity=capacity, max_staleness=max_staleness, temperature=temperature,
                                  spool_dir=spool_dir)
        self.intake = Intake(self.queue, scorer=scorer, vocab_size=vocab_size, published_version=published_version,
                             max_context=max_context, teacher=teacher, teacher_top_k=teacher_top_k)
        self.leases = Leases(self.queue, lease_timeout_s=lease_timeout_s, max_deliveries=max_deliveries)
        if self.queue.spool is not None:
            self.intake.reload_spool(self.leases.triage, self.leases.restore)

    # -- generators ---------------------------------------------------------------------------------------
    def put(self, data: bytes) -> dict:
        return self.intake.put(data)

    def put_many(self, messages: list[bytes]) -> list[dict]:
        return self.intake.put_many(messages)

    def budget(self, policy_version: int, wait_s: float = 0.0) -> dict:
        """How many groups sampled at ``policy_version`` the learner can still train within ``max_staleness``
        (:func:`ref_server.hub.pacing.groups_wanted`); waits up to ``wait_s`` while that is 0 and the learner's
        version stays the same (a new version means new weights for the generator, which changes its answer).

        ``wanted`` is None while the learner has not said how many groups a step takes (any number, up to the
        queue's capacity, is welcome then)."""
        queue = self.queue
        deadline = time.monotonic() + wait_s
        with queue.cond:
            seen_version = queue.learner_version
            while True:
                wanted = self._wanted_locked(policy_version)
                remaining = deadline - time.monotonic()
                if wanted != 0 or queue.learner_version != seen_version or remaining <= 0:
                    return {"wanted": wanted, "learner_version": queue.learner_version,
                            "groups_per_step": queue.groups_per_step, "queue_depth": len(queue.groups)}
                queue.cond.wait(timeout=min(remaining, 1.0))

    def _wanted_locked(self, policy_version: int) -> int | None:
        queue = self.queue
        if queue.groups_per_step is None:
            return None
        return groups_wanted(generator_version=policy_version, learner_version=queue.learner_version,
                             leased_groups=self.leases.untrained_locked(),
                             queued_groups=len(queue.groups) + queue.reserved,
                             groups_per_step=queue.groups_per_step, max_staleness=queue.max_staleness)

    # -- learner ------------------------------------------------------------------------------------------
    def report_version(self, version: int, groups_per_step: int | None = None, reset: bool = False) -> int:
        """The learner's version (never lower than the last, :class:`ValueError`), or with ``reset`` (a learner
        registering: ref_server/session_routes.py) any version, also a lower one. Returns the groups made stale."""
        queue = self.queue
        if reset:
            with queue.cond:
                queue.learner_version = min(queue.learner_version, version)  # report_version takes it from there
        return queue.report_version(version, groups_per_step)

    def take(self, num_groups: int, timeout: float = 0.0, min_version: int | None = None,
             request_id: str | None = None) -> TrainBatch | None:
        return self.leases.take(num_groups, timeout, min_version, request_id)

    def ack(self, batch_ids: list[str]) -> dict[str, str]:
        return self.leases.ack(batch_ids)

    def release(self, batch_ids: list[str], request_ids: list[str] = ()) -> dict[str, str]:
        return self.leases.release(batch_ids, request_ids)

    def renew(self, batch_ids: list[str], trained: bool = False) -> dict[str, str]:
        return self.leases.renew(batch_ids, trained)

    def hand_over(self, keep: list[str] = ()) -> tuple[int, int]:
        """A new learner session: the leases of the previous one are released at once, but ``keep``."""
        return self.leases.hand_over(keep)

    def close(self) -> None:
        """A clean shutdown: leases still held untrained count as failed deliveries (ref_server/hub/leases.py)."""
        self.leases.close()

    # -- state --------------------------------------------------------------------------------------------
    def depth(self) -> int:
        return self.queue.depth()

    def ready_depth(self) -> int:
        return self.queue.ready_depth()

    def leased_depth(self) -> int:
        return self.leases.leased_depth()

    def unscored(self) -> dict[str, int]:
        """Groups waiting for each model's logprobs (``reference``, ``teacher``), unready meanwhile."""
        return self.intake.unscored()

    @property
    def counters(self) -> HubCounters:
        return self.queue.counters

    @property
    def learner_version(self) -> int:
        return self.queue.learner_version

    @property
    def groups_per_step(self) -> int | None:
        return self.queue.groups_per_step

    @property
    def capacity(self) -> int:
        return self.queue.capacity

    @property
    def max_staleness(self) -> int:
        return self.queue.max_staleness

    @property
    def teacher_top_k(self) -> int:
        """The teacher's top-k the hub adds to every batch (algorithm.distill.mode topk_forward_kl); 0: none."""
        return self.intake.teacher_top_k

    @property
    def temperature(self) -> float | None:
        return self.queue.temperature

    @property
    def lease_timeout_s(self) -> float:
        return self.leases.lease_timeout_s
