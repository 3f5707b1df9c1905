"""What the scorer pool (:mod:`ref_server.scorer_pool.pool`) keeps: its jobs, its joined scorers, its counters, its
errors, and the scorers it stopped trusting (:class:`Quarantine`)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from ref_server.scorer_pool.job_wire import JobSpec
from ref_server.scoring.scorer import ScoringError

LOCAL = "local"


class UnknownScorer(KeyError):
    """A scorer id this hub does not know (never registered, left, silent past its lease, or the hub restarted)."""


class ScorerQuarantined(PermissionError):
    """A scorer the hub refuses for good: it sent too many bad results (HTTP 403 with the reason)."""


class NoScorer(ScoringError):
    """No scorer answered a route's request in time (none joined, or all busy): HTTP 503 with Retry-After."""


class UnknownJob(KeyError):
    """A result for a job this hub does not know (or never leased to that scorer)."""


@dataclass
class Job:
    spec: JobSpec
    future: Future
    completion_lengths: list[int]
    holder: str | None = None          # the scorer holding its lease (LOCAL: the hub's own), None: waiting
    deadline: float = 0.0
    holders: set[str] = field(default_factory=set)  # every scorer it was ever leased to: whose results count
    failures: list[str] = field(default_factory=list)  # bad results and expired leases, each with its reason
    submitted: float = 0.0             # the pool's clock when it was submitted (how long it has waited, in health)

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.spec.rows)


@dataclass
class JoinedScorer:
    scorer_id: str
    name: str
    last_seen: float
    jobs: set[str] = field(default_factory=set)
    bad_results: int = 0


@dataclass
class PoolCounters:
    jobs_submitted: int = 0
    jobs_scored: int = 0            # Futures resolved with a result (each exactly once)
    jobs_failed: int = 0            # local scoring failed (out of memory on a single row, ...)
    jobs_given_up: int = 0          # failed ref_server.scoring_job_max_failures times on joined scorers: failed
    jobs_cancelled: int = 0         # a route stopped waiting for it
    jobs_requeued: int = 0          # leases expired, scorers left, bad results: the job went back for another
    results_duplicate: int = 0      # a result for a job already scored: acknowledged, ignored
    results_refused: int = 0        # results that did not fit their job, or for a job the scorer did not hold
    jobs_failed_by_scorer: int = 0  # a joined scorer reported it could not score a job it held (its forward raised)
    scorers_joined: int = 0
    scorers_lost: int = 0           # removed after a lease's worth of silence
    scorers_quarantined: int = 0    # refused for good after ref_server.scorer_max_bad_results bad results
    down_warnings: int = 0          # "no scorer while jobs wait" logged (every ref_server.scorer_wait_s of it)


class Quarantine:
    """Scorers refused for good, by id and by name (a scorer that registers again under its name is refused too:
    the operator restarts it under another ``--id`` once it is fixed, or restarts the hub). Bounded: the oldest
    entries go first."""

    MAX_ENTRIES = 4096

    def __init__(self) -> None:
        self._reasons: dict[str, str] = {}   # scorer id or "name:<name>" -> why

    def add(self, scorer: JoinedScorer, reason: str) -> None:
        self._reasons[scorer.scorer_id] = reason
        self._reasons[f"name:{scorer.name}"] = reason
        while len(self._reasons) > self.MAX_ENTRIES:
            del self._reasons[next(iter(self._reasons))]

    def check_id(self, scorer_id: str) -> None:
        if (reason := self._reasons.get(scorer_id)) is not None:
            raise ScorerQuarantined(f"scorer {scorer_id} is quarantined: {reason}")

    def check_name(self, name: str) -> None:
        if (reason := self._reasons.get(f"name:{name}")) is not None:
            raise ScorerQuarantined(f"scorer name {name!r} is quarantined: {reason}")
