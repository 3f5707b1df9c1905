"""The scorer pool: the hub's one front for reference scoring, whoever does it.

The hub's intake and the scoring routes call :meth:`ScorerPool.submit` exactly as they called the
:class:`ref_server.scoring.scorer.ReferenceScorer` (rows -> a Future of per-row tensors). Behind it is a queue of
scoring jobs taken by

* the hub's own ReferenceScorer (``ref_server.local_scoring``): a dispatcher thread hands it jobs while it holds
  less than two micro-batches' worth of tokens, so it batches as before and leaves the rest to joined scorers;
* joined scorers (``grpo scorer --hub URL``, :mod:`ref_server.scorer_pool.remote`), which pull jobs over HTTP
  (:mod:`ref_server.scorer_pool.routes`). Each job is leased to one scorer for ``lease_s`` seconds, renewed by its
  heartbeat; a lease that expires (the scorer was killed, hung or left) puts the job back at the front of the queue
  for another.

Exactly once: a job's Future is resolved by the first valid result; a later or duplicate result (a scorer whose
lease had expired answering after all) is acknowledged and ignored. A result is checked where it enters
(:func:`ref_server.scorer_pool.job_wire.check_result`); a bad one is refused and its job goes back to the queue.

Bad scorers and bad jobs do not go round forever: a scorer that sends ``max_bad_results`` bad results (wrong
shapes, NaN, a result for a job it does not hold) is quarantined (:class:`ref_server.scorer_pool.records.Quarantine`):
dropped from the pool, its leases back in the queue for the others, and refused (403 with the reason) on its next
call and when it registers again under its name. A job that failed ``job_max_failures`` times on joined scorers
(bad results, leases that expired) fails its Future with the reasons: the hub drops the group (counted
``dropped_ref_failure``), a route answers 503 with them.
With no local scoring and no scorer registered (none joined, or every one killed: their leases expire and the jobs
go back to the queue), jobs wait: the hub's groups stay queued, unready (never leased without these logprobs), the
routes answer 503 after ``ref_server.scorer_wait_s`` (:meth:`ScorerPool.wait_s`), and every ``scorer_wait_s`` of it
the log warns (:meth:`ScorerPool.expire`; ``down_warnings``, :meth:`ScorerPool.health`); a scorer that joins takes
the waiting jobs at once. One rule for both pools: the teacher's (``role="teacher"``) is this class too.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from ref_server.scorer_pool.job_wire import BadResult, JobSpec, check_result
from ref_server.scorer_pool.jobs import ScoringJobs, resolve_future
from ref_server.scorer_pool.records import (
    LOCAL,
    Job,
    JoinedScorer,
    NoScorer,
    Quarantine,
    ScorerQuarantined,
    UnknownJob,
    UnknownScorer,
)
from ref_server.scoring.scorer import ReferenceScorer, ScorerBusy, ScoringError

__all__ = ["LOCAL", "NoScorer", "ScorerPool", "ScorerQuarantined", "UnknownJob", "UnknownScorer"]
log = logging.getLogger("grpo.ref_server.pool")


class ScorerPool(ScoringJobs):
    def __init__(self, *, local: ReferenceScorer | None, vocab_size: int | None, lease_s: float = 30.0,
                 wait_s: float = 60.0, max_jobs: int = 1024, clock: Callable[[], float] = time.monotonic,
                 reaper: bool = True, max_bad_results: int = 3, job_max_failures: int = 4,
                 role: str = "reference") -> None:
        """``reaper``: a thread calls :meth:`expire` a few times a second (tests with a ``clock`` of their own call
        it themselves). ``max_bad_results``: bad results before a scorer is quarantined; ``job_max_failures``: failed
        attempts (bad results, expired leases) before a job fails. ``role``: the model it scores, ``reference`` or
        ``teacher`` (for the messages)."""
        super().__init__(max_jobs=max_jobs, job_max_failures=job_max_failures, clock=clock)
        self.local = local
        self.max_bad_results = max_bad_results
        self.quarantine = Quarantine()
        self.vocab_size = vocab_size
        self.lease_s = lease_s
        self._wait_s = wait_s
        self._scorers: dict[str, JoinedScorer] = {}
        self._local_tokens = 0
        self._closed = False
        self.role = role
        self._down_since: float | None = None   # since when no scorer can take the jobs that wait (None: not down)
        self._next_warning = 0.0
        self._threads = [threading.Thread(target=self._reap, name="scorer-pool-leases", daemon=True)] if reaper else []
        if local is not None:
            self._threads.append(threading.Thread(target=self._dispatch_local, name="scorer-pool-local",
                                                  daemon=True))
        for thread in self._threads:
            thread.start()

    # -- the ReferenceScorer interface (intake, routes) ------------------------------------------------------
    async def result(self, future: Future):
        """The Future's rows, awaited on the event loop; with no local scoring, :class:`NoScorer` after ``wait_s``
        (the job is cancelled)."""
        wait = self.wait_s()
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), wait)
        except TimeoutError:
            future.cancel()
            raise NoScorer(f"no {self.role} scorer answered within {wait:.0f}s (scoring: {self.status()}, "
                           f"{self.queue_depth()} jobs waiting)") from None

    def wait_s(self) -> float | None:
        """How long a route waits for a result: unbounded with local scoring (as before), else scorer_wait_s."""
        return None if self.local is not None else self._wait_s

    @property
    def forward_batches(self) -> int:
        """Forward passes of the hub's own scorer (0 without local scoring)."""
        return self.local.forward_batches if self.local is not None else 0

    def scorers(self) -> int:
        return len(self._scorers)

    def status(self) -> str:
        """``local``, ``local + N joined``, ``N joined`` or ``no scorer`` (healthz, metrics)."""
        joined = len(self._scorers)
        if self.local is not None:
            return f"local + {joined} joined" if joined else "local"
        return f"{joined} joined" if joined else "no scorer"

    def health(self) -> dict:
        """Who scores (:meth:`status`), the jobs waiting for a scorer and how long the oldest has waited, and since
        when nobody could take them (``down_s``, 0 while up): /healthz, /v1/hub/stats."""
        with self.cond:
            down_s = 0.0 if self._down_since is None else max(self.clock() - self._down_since, 0.0)
        return {"scoring": self.status(), "jobs_waiting": self.queue_depth(),
                "oldest_job_wait_s": round(self.oldest_wait_s(), 1), "down_s": round(down_s, 1)}

    def close(self) -> None:
        """Stop handing out work. Pending Futures stay unresolved: the hub's groups stay spooled for its restart."""
        with self.cond:
            self._closed = True
            self.cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=5)
        if self.local is not None:
            self.local.close()

    # -- joined scorers --------------------------------------------------------------------------------------
    def register(self, name: str) -> str:
        """A new scorer's id; :class:`ScorerQuarantined` for a name quarantined before."""
        with self.cond:
            self.quarantine.check_name(name)
            scorer_id = f"{self._prefix}-s{next(self._ids)}"
            self._scorers[scorer_id] = JoinedScorer(scorer_id, name, self.clock())
            self.counters.scorers_joined += 1
            self.cond.notify_all()
        log.info("scorer %s joined as %s (%d joined)", name, scorer_id, len(self._scorers))
        return scorer_id

    def owns(self, scorer_id: str) -> bool:
        """Whether this pool gave out ``scorer_id`` (each pool's ids carry its own random prefix): the routes find a
        joined scorer's pool, the reference's or the teacher's, by it."""
        return scorer_id.startswith(f"{self._prefix}-s")

    def heartbeat(self, scorer_id: str) -> int:
        """The scorer is alive: its leases run another ``lease_s``. Returns how many jobs it holds."""
        with self.cond:
            scorer = self._scorer(scorer_id)
            now = self.clock()
            scorer.last_seen = now
            for job_id in scorer.jobs:
                self._jobs[job_id].deadline = now + self.lease_s
            return len(scorer.jobs)

    def leave(self, scorer_id: str) -> int:
        """The scorer stops: its leased jobs go back to the front of the queue at once. Returns how many."""
        with self.cond:
            scorer = self._scorers.pop(scorer_id, None)
            if scorer is None:
                return 0
            jobs = list(scorer.jobs)
            for job_id in jobs:
                self._requeue(self._jobs[job_id])
        log.info("scorer %s (%s) left; %d jobs back in the queue", scorer.name, scorer_id, len(jobs))
        return len(jobs)

    def take(self, scorer_id: str, wait_s: float) -> JobSpec | None:
        """The oldest waiting job, leased to this scorer; None when none came within ``wait_s``."""
        deadline = self.clock() + wait_s
        with self.cond:
            while True:
                scorer = self._scorer(scorer_id)
                scorer.last_seen = self.clock()
                if self._waiting and not self._closed:
                    job = self._jobs[self._waiting.popleft()]
                    self._lease(job, scorer_id)
                    scorer.jobs.add(job.spec.job_id)
                    return job.spec
                remaining = deadline - self.clock()
                if remaining <= 0 or self._closed:
                    return None
                self.cond.wait(min(remaining, 0.5))

    def release(self, scorer_id: str, job_id: str) -> None:
        """Hand a leased job back unscored (its scorer's HTTP client left before reading it)."""
        with self.cond:
            job = self._jobs.get(job_id)
            if job is not None and job.holder == scorer_id:
                self._requeue(job)

    def finish(self, scorer_id: str, job_id: str, data: bytes) -> str:
        """A scorer's result for a job: ``scored`` (it resolved the job), ``duplicate`` (already scored: ignored).
        :class:`BadResult` (the job goes back to the queue) or :class:`UnknownJob`."""
        with self.cond:
            job = self._jobs.get(job_id)
            self.quarantine.check_id(scorer_id)
            if job is None:
                if job_id in self._done:
                    self.counters.results_duplicate += 1
                    return "duplicate"
                # from before a hub restart, the scorer is unknown too (404: it registers again): not its fault
                problem = f"no scoring job {job_id!r} (unknown, or from before a hub restart)"
                self._bad_result(scorer_id, problem)
                raise UnknownJob(problem)
            if scorer_id not in job.holders:
                problem = f"scoring job {job_id!r} was never leased to scorer {scorer_id!r}"
                self._bad_result(scorer_id, problem)
                raise UnknownJob(problem)
        try:  # the tensor checks outside the lock: the other scorers keep taking and finishing jobs meanwhile
            rows = check_result(data, job.completion_lengths, job.spec.top_k, self.vocab_size)
        except BadResult as exc:
            with self.cond:
                if self._jobs.get(job_id) is job and job.holder == scorer_id:
                    self._requeue(job, failure=f"scorer {scorer_id}: {exc}")
                self._bad_result(scorer_id, f"job {job_id}: {exc}")
            raise
        with self.cond:
            if self._jobs.get(job_id) is not job:  # another result won while this one was checked
                self.counters.results_duplicate += 1
                return "duplicate"
            self._retire(job_id, job)
            self.counters.jobs_scored += 1
        resolve_future(job.future, rows)
        return "scored"

    def fail(self, scorer_id: str, job_id: str, reason: str) -> str:
        """The scorer could not score a job it holds (its forward raised: out of memory, a device error): the job
        goes back to the queue at once, the failure counted against it (``job_max_failures``: a job that fails
        everywhere is given up, not handed round) and against the scorer as a bad result (a scorer whose every
        forward fails is quarantined). ``requeued``, or ``unknown`` for a job it does not hold (finished, expired
        or reassigned meanwhile: nothing to do)."""
        with self.cond:
            self._scorer(scorer_id)   # quarantined: 403; unknown: 404 (register again)
            job = self._jobs.get(job_id)
            if job is None or job.holder != scorer_id:
                return "unknown"
            self.counters.jobs_failed_by_scorer += 1
            self._requeue(job, failure=f"scorer {scorer_id} could not score it: {reason}")
            self._bad_result(scorer_id, f"job {job_id}: could not score it: {reason}", refused=False)
            return "requeued"

    def bad_result(self, scorer_id: str, problem: str) -> None:
        """A result the route refused before it reached :meth:`finish` (it names another job than its path)."""
        with self.cond:
            self._bad_result(scorer_id, problem)

    # -- inside ----------------------------------------------------------------------------------------------
    def _bad_result(self, scorer_id: str, problem: str, refused: bool = True) -> None:
        """Under the lock: count a bad result (``refused``: a result sent, else a job it reported it could not
        score) against a registered scorer; quarantine it at ``max_bad_results``."""
        self.counters.results_refused += refused
        scorer = self._scorers.get(scorer_id)
        if scorer is None:
            return
        scorer.bad_results += 1
        if scorer.bad_results < self.max_bad_results:
            return
        reason = (f"{scorer.bad_results} bad results (ref_server.scorer_max_bad_results is {self.max_bad_results}),"
                  f" the last: {problem}")
        self.quarantine.add(scorer, reason)
        del self._scorers[scorer_id]
        self.counters.scorers_quarantined += 1
        held = list(scorer.jobs)
        for job_id in held:
            self._requeue(self._jobs[job_id])
        log.error("scorer %s (%s) quarantined: %s; its %d jobs go to the others", scorer.name, scorer_id, reason,
                  len(held))

    def _scorer(self, scorer_id: str) -> JoinedScorer:
        self.quarantine.check_id(scorer_id)
        scorer = self._scorers.get(scorer_id)
        if scorer is None:
            raise UnknownScorer(f"no scorer {scorer_id!r} is registered (register again)")
        return scorer

    def _unlease(self, job: Job) -> None:
        """Under the lock: the job is no longer held by its scorer."""
        scorer = self._scorers.get(job.holder or "")
        if scorer is not None:
            scorer.jobs.discard(job.spec.job_id)
        super()._unlease(job)

    def expire(self) -> int:
        """Leases past their deadline go back to the queue; scorers silent for ``lease_s`` are removed. Returns
        the number of jobs put back."""
        now = self.clock()
        with self.cond:
            for scorer in [s for s in self._scorers.values() if now - s.last_seen > self.lease_s]:
                del self._scorers[scorer.scorer_id]
                self.counters.scorers_lost += 1
                log.warning("scorer %s (%s) silent for %.0fs: removed", scorer.name, scorer.scorer_id, self.lease_s)
            overdue = [j for j in self._jobs.values() if j.holder not in (None, LOCAL) and j.deadline < now]
            for job in overdue:
                log.warning("scoring job %s: lease of %s expired; back in the queue", job.spec.job_id, job.holder)
                self._requeue(job, failure=f"the lease of scorer {job.holder} expired")
            self._watch_down(now)
            return len(overdue)

    def _watch_down(self, now: float) -> None:
        """Under the lock: jobs that wait with no scorer to take them are not dropped, and not silent either: a
        warning when it starts lasting and every ``wait_s`` after (a route's request gives up after as long), a
        line when a scorer is back."""
        down = self.local is None and not self._scorers and bool(self._waiting)
        if not down:
            if self._down_since is not None and self._scorers:
                log.warning("a %s scorer is back after %.0fs without one; it takes the %d jobs waiting", self.role,
                            now - self._down_since, len(self._waiting))
                self._down_since = None
            elif not self._waiting:
                self._down_since = None
            return
        if self._down_since is None:
            self._down_since, self._next_warning = now, now + self._wait_s
        if now < self._next_warning:
            return
        self._next_warning = now + self._wait_s
        self.counters.down_warnings += 1
        oldest = min(self._jobs[job_id].submitted for job_id in self._waiting)
        log.warning("no %s scorer for %.0fs: %d scoring jobs wait, the oldest for %.0fs; the hub's groups wait for "
                    "them (none is leased without these logprobs, none dropped): start `grpo scorer%s --hub URL`",
                    self.role, now - self._down_since, len(self._waiting), now - oldest,
                    " --teacher" if self.role == "teacher" else "")

    def _reap(self) -> None:
        tick = min(self.lease_s / 4, 0.5)
        while True:
            with self.cond:
                if self._closed:
                    return
            self.expire()
            time.sleep(tick)

    def _dispatch_local(self) -> None:
        """Hand waiting jobs to the hub's own scorer while it holds less than two micro-batches of tokens."""
        local = self.local
        assert local is not None
        budget = 2 * local.batch_tokens
        while True:
            with self.cond:
                while not self._closed and not (self._waiting and (self._local_tokens == 0
                                                                   or self._local_tokens < budget)):
                    self.cond.wait(0.5)
                if self._closed:
                    return
                job = self._jobs[self._waiting.popleft()]
                self._lease(job, LOCAL)
                self._local_tokens += job.tokens
            spec = job.spec
            try:
                future = local.submit(spec.rows, spec.temperature, spec.top_k)
            except ScorerBusy as exc:  # cannot happen below the budget; fail the job rather than lose it silently
                future = Future()
                future.set_exception(ScoringError(str(exc)))
            future.add_done_callback(lambda f, job=job: self._local_done(job, f))

    def _local_done(self, job: Job, future: Future) -> None:
        error = future.exception()
        with self.cond:
            self._local_tokens -= job.tokens
            self.cond.notify_all()
            if self._jobs.get(job.spec.job_id) is not job:  # cancelled meanwhile, or scored by a joined scorer
                return
            del self._jobs[job.spec.job_id]
            job.holder = None
            self._remember(job.spec.job_id)
            if error is None:
                self.counters.jobs_scored += 1
            else:
                self.counters.jobs_failed += 1
        if error is None:
            resolve_future(job.future, future.result())
        else:
            resolve_future(job.future, error=error)
