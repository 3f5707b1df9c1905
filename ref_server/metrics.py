"""Prometheus metrics of the reference server (one registry per app, so tests can run several apps)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from ref_server.scorer_pool.pool import ScorerPool
    from ref_server.state import ServerState

_ENDPOINTS = {"/healthz", "/metrics", "/v1/logprobs", "/v1/rollouts", "/v1/batch", "/v1/batch/ack",
              "/v1/batch/renew", "/v1/learner/version", "/v1/hub/stats", "/v1/weights", "/v1/completions",
              "/v1/models", "/tokenizer_info", "/tokenize", "/detokenize", "/v1/scorers", "/v1/curriculum"}


class ServerMetrics:
    def __init__(self, state: ServerState) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("grpo_ref_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=self.registry)
        self.latency = Histogram("grpo_ref_request_seconds", "Request latency by endpoint", ["endpoint"],
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
                                 registry=self.registry)
        self.refused = Counter("grpo_ref_requests_refused", "Requests the guard refused or lost, by reason: too_large "
                               "(413), body_timeout (408), bad_json (400), disconnected (client left mid-body: 499)",
                               ["reason"], registry=self.registry)
        self.tokens_scored = Counter("grpo_ref_tokens_scored", "Completion tokens given a reference logprob",
                                     registry=self.registry)
        gauges = {
            "grpo_hub_queue_depth": ("Rollout groups held by the hub", state.hub.depth),
            "grpo_hub_ready_groups": ("Groups with reference logprobs attached", state.hub.ready_depth),
            "grpo_hub_leased_groups": ("Groups leased to the learner, not yet acknowledged", state.hub.leased_depth),
            "grpo_learner_version": ("Policy version last reported by the learner",
                                     lambda: state.hub.learner_version),
            "grpo_weights_version": ("Newest published weights version (-1: none)",
                                     lambda: -1 if state.weights.current is None else state.weights.current),
            "grpo_curriculum_skipped_share": ("Share of the prompts generators drew that the curriculum passed over "
                                              "(generator.curriculum, every generator reporting to this hub)",
                                              state.curriculum.skipped_share),
            "grpo_curriculum_prompts_drawn": ("Prompts the generators drew (curriculum reports)",
                                              lambda: state.curriculum.drawn),
            "grpo_curriculum_prompts_skipped": ("Of them, passed over (solved always or never lately)",
                                                lambda: state.curriculum.skipped),
            "grpo_curriculum_prompts_tracked": ("Prompts in the hub's pass-rate table", state.curriculum.tracked),
            "grpo_curriculum_prompts_settled": ("Of them, settled: solved always or never in their last "
                                                "appearances", state.curriculum.settled_count),
        }
        for name, (doc, fn) in gauges.items():
            Gauge(name, doc, registry=self.registry).set_function(fn)
        counters = state.hub.counters
        hub_events = Gauge("grpo_hub_groups", "Rollout groups by what happened to them", ["event"],
                           registry=self.registry)
        for event in ("accepted", "duplicates", "rejected", "refused_stale", "dropped_stale", "dropped_ref_failure", "leased",
                      "consumed", "lease_expired", "rejected_full", "spool_reloaded", "spool_corrupt",
                      "quarantined"):
            hub_events.labels(event=event).set_function(lambda e=event: getattr(counters, e))

        self._pool_gauges("", "Reference", state.scorer, lambda: state.hub.unscored()["reference"])
        if state.teacher is not None:
            self._pool_gauges("teacher_", "Teacher", state.teacher, lambda: state.hub.unscored()["teacher"])

    def _pool_gauges(self, prefix: str, role: str, pool: ScorerPool | None, unscored) -> None:
        """One scorer pool's gauges, the reference's (``grpo_scorers_joined``, ...) or the teacher's
        (``grpo_teacher_scorers_joined``, ...): the same names and meanings for both, the same rule behind them."""
        gauges = {
            "scorer_queue_depth": ("Scoring requests waiting for the model", lambda: pool.queue_depth() if pool else 0),
            "scorers_joined": ("Scorers registered with the hub (grpo scorer)", lambda: pool.scorers() if pool else 0),
            "scoring_jobs_leased": ("Scoring jobs held by a scorer, not yet answered",
                                    lambda: pool.leased() if pool else 0),
            "no_scorer": ("1 while scoring is needed and nobody can do it (no local scoring, no scorer joined): "
                          "groups wait", lambda: int(pool is not None and pool.status() == "no scorer")),
            "scoring_oldest_job_seconds": ("Seconds the oldest scoring job waiting for a scorer has waited",
                                           lambda: pool.oldest_wait_s() if pool else 0.0),
            "hub_unscored_groups": ("The hub's groups waiting for this model's logprobs (unready meanwhile)",
                                    unscored),
        }
        for name, (doc, fn) in gauges.items():
            Gauge(f"grpo_{prefix}{name}", f"{role}: {doc}", registry=self.registry).set_function(fn)
        if pool is None:
            return
        jobs = Gauge(f"grpo_{prefix}scoring_jobs", f"{role} scoring jobs (ref_server/scorer_pool/pool.py) by what "
                     "happened", ["event"], registry=self.registry)
        for event in ("jobs_submitted", "jobs_scored", "jobs_failed", "jobs_given_up", "jobs_cancelled",
                      "jobs_requeued", "results_duplicate", "results_refused", "jobs_failed_by_scorer",
                      "scorers_joined", "scorers_lost", "scorers_quarantined", "down_warnings"):
            jobs.labels(event=event).set_function(lambda e=event: getattr(pool.counters, e))

    def observe(self, path: str, status: int, started: float) -> None:
        """One answered request; ``status`` 499 is a client that left before its answer (never counted as 5xx)."""
        endpoint = ("/v1/weights" if path.startswith("/v1/weights") else "/v1/scorers" if path.startswith("/v1/scorers")
                    else path if path in _ENDPOINTS else "other")
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
        self.latency.labels(endpoint=endpoint).observe(time.perf_counter() - started)

    def render(self) -> bytes:
        return generate_latest(self.registry)
