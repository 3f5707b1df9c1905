"""The scorer pool's jobs (:class:`ScoringJobs`): queued, leased, requeued, given up, each resolved once."""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError

from ref_server.scorer_pool.job_wire import JobSpec
from ref_server.scorer_pool.records import Job, PoolCounters
from ref_server.scoring.scorer import Row, ScorerBusy, ScoringError

log = logging.getLogger("grpo.ref_server.pool")


class ScoringJobs:
    """The pool's jobs: waiting (oldest first) or leased to one holder, each resolved exactly once (scored, failed,
    given up or cancelled); what :class:`ref_server.scorer_pool.pool.ScorerPool` hands to its scorers. The caller of a
    method named ``_x`` holds ``cond``."""

    def __init__(self, *, max_jobs: int, job_max_failures: int, clock: Callable[[], float]) -> None:
        self.max_jobs = max_jobs
        self.job_max_failures = job_max_failures
        self.clock = clock
        self.counters = PoolCounters()
        self.cond = threading.Condition()
        self._jobs: dict[str, Job] = {}
        self._waiting: deque[str] = deque()
        self._done: OrderedDict[str, None] = OrderedDict()  # recently scored or cancelled ids: late results
        self._ids = itertools.count()
        self._prefix = secrets.token_hex(4)

    def submit(self, rows: list[Row], temperature: float = 1.0, top_k: int = 0) -> Future:
        future: Future = Future()
        if not rows:
            future.set_result([])
            return future
        with self.cond:
            if len(self._jobs) >= self.max_jobs:
                raise ScorerBusy(f"{self.max_jobs} scoring jobs are already queued or leased")
            job_id = f"{self._prefix}-{next(self._ids)}"
            job = Job(JobSpec(job_id, rows, temperature, top_k), future,
                      [r.tokens - r.prompt_length for r in rows], submitted=self.clock())
            self._jobs[job_id] = job
            self._waiting.append(job_id)
            self.counters.jobs_submitted += 1
            self.cond.notify_all()
        # a caller that stops waiting cancels the Future (a route's deadline, a client that hung up): the job leaves
        future.add_done_callback(lambda f: self._forget(job_id) if f.cancelled() else None)
        return future

    def score(self, rows: list[Row], temperature: float = 1.0, timeout: float | None = None, top_k: int = 0):
        return self.submit(rows, temperature, top_k).result(timeout=timeout)

    def _forget(self, job_id: str) -> None:
        """A cancelled job leaves the queue (a result still in flight is acknowledged, ignored)."""
        with self.cond:
            job = self._jobs.get(job_id)
            if job is None:
                return
            self._retire(job_id, job)
            self.counters.jobs_cancelled += 1

    def queue_depth(self) -> int:
        """Jobs waiting for a scorer (not leased)."""
        return len(self._waiting)

    def oldest_wait_s(self) -> float:
        """Seconds since the oldest job still waiting for a scorer was submitted (0 when none waits)."""
        with self.cond:
            oldest = min((self._jobs[job_id].submitted for job_id in self._waiting), default=None)
            return 0.0 if oldest is None else max(self.clock() - oldest, 0.0)

    def leased(self) -> int:
        return len(self._jobs) - len(self._waiting)

    def _lease(self, job: Job, holder: str) -> None:
        job.holder = holder
        job.holders.add(holder)
        job.deadline = self.clock() + self.lease_s

    def _unlease(self, job: Job) -> None:
        """Under the lock: the job is no longer held."""
        job.holder = None

    def _retire(self, job_id: str, job: Job) -> None:
        """Under the lock: a job scored or cancelled leaves the pool, waiting or leased, and is remembered as done
        (a late result for it is acknowledged and ignored)."""
        del self._jobs[job_id]
        if job.holder is None:
            self._waiting.remove(job_id)
        else:
            self._unlease(job)
        self._remember(job_id)

    def _requeue(self, job: Job, failure: str | None = None) -> None:
        """Under the lock: a leased job back at the front of the queue, for any scorer. ``failure``: why its
        attempt failed; at ``job_max_failures`` of them the job fails instead (its caller gets the reasons)."""
        self._unlease(job)
        if failure is not None:
            job.failures.append(failure)
            if len(job.failures) >= self.job_max_failures:
                self._give_up(job)
                return
        self._waiting.appendleft(job.spec.job_id)
        self.counters.jobs_requeued += 1
        self.cond.notify_all()

    def _give_up(self, job: Job) -> None:
        """Under the lock: fail a job that failed on scorers ``job_max_failures`` times, rather than loop."""
        job_id = job.spec.job_id
        del self._jobs[job_id]
        self._remember(job_id)
        self.counters.jobs_given_up += 1
        error = ScoringError(f"scoring job {job_id} failed {len(job.failures)} times on joined scorers "
                             f"(ref_server.scoring_job_max_failures is {self.job_max_failures}): "
                             + "; ".join(job.failures[-3:]))
        log.error("%s", error)
        # resolved off the lock: its callbacks (the hub's intake) take the queue's lock
        threading.Thread(target=resolve_future, args=(job.future, None, error), daemon=True).start()

    def _remember(self, job_id: str) -> None:
        self._done[job_id] = None
        while len(self._done) > 4 * self.max_jobs:
            self._done.popitem(last=False)


def resolve_future(future: Future, rows=None, error: BaseException | None = None) -> None:
    """Resolve a job's Future unless its caller cancelled it meanwhile (then nobody waits for it)."""
    try:
        if error is None:
            future.set_result(rows)
        else:
            future.set_exception(error)
    except InvalidStateError:
        pass
