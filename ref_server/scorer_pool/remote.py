"""A reference scorer that joins a hub (``grpo scorer --hub URL``): it loads the reference model, registers, and pulls
scoring jobs (:mod:`ref_server.scorer_pool.routes`) until told to stop.

* ``concurrency`` job loops share one :class:`ref_server.scoring.scorer.ReferenceScorer`: while one loop waits for
  its result to be posted or its next job, another's rows are in the forward, and rows of jobs taken at the same
  time are micro-batched together.
* A heartbeat thread renews the scorer's leases every third of the hub's lease, so a job that takes long is not
  handed to another scorer; a scorer killed stops renewing and its jobs go back after one lease.
* The hub answering 404 for this scorer (it restarted, or it removed a scorer it had not heard from) means: register
  again. A hub that stays unreachable past ``retry_max_s`` ends the scorer (exit 1); a model the hub refuses (409)
  ends it at once (exit 2), and so does a hub that quarantined it for bad results (403, with the hub's reason).
* A job whose forward raises (out of memory on a long row, a device error) is reported to the hub, which requeues
  it for another scorer and counts it against the job and this scorer (a scorer whose every forward fails is
  quarantined, and then ends with the hub's reason); the scorer goes on with its next job.
* SIGTERM/SIGINT: the loops finish the jobs they hold, post them, and the scorer leaves (its nothing-left leases are
  dropped at once instead of after a lease).
"""

from __future__ import annotations

import logging
import threading
import time

from ref_server.scorer_pool.job_wire import decode_job, encode_result
from ref_server.scoring.scorer import ReferenceScorer
from shared.errors import UsageError
from shared.progress import READY, startup_phase
from shared.protocol.client import HubError
from shared.protocol.scorer_client import ScorerClient
from shared.protocol.wire import WireError

log = logging.getLogger("grpo.scorer")


class ScorerRefused(UsageError):
    """The hub refused this scorer (another model, or a hub that scores no reference); the message says why."""


class RemoteScorer:
    def __init__(self, client: ScorerClient, scorer: ReferenceScorer, *, name: str, identity: dict,
                 concurrency: int = 2, poll_s: float = 5.0) -> None:
        self.client = client
        self.scorer = scorer
        self.name = name
        self.identity = identity
        self.concurrency = concurrency
        self.poll_s = poll_s
        self.scorer_id: str | None = None
        self.lease_s = 30.0
        self.jobs_scored = 0
        self.jobs_failed = 0   # jobs whose forward raised, reported to the hub
        self.tokens_scored = 0
        self.registrations = 0
        self._lock = threading.Lock()

    # -- registration ----------------------------------------------------------------------------------------
    def register(self, stale_id: str | None = None) -> str:
        """This scorer's id with the hub, registering (again) unless another loop already replaced ``stale_id``."""
        with self._lock:
            if self.scorer_id is not None and self.scorer_id != stale_id:
                return self.scorer_id
            try:
                answer = self.client.register(self.name, self.scorer.vocab_size, self.identity)
            except HubError as exc:
                if exc.status in (403, 404, 409):
                    raise self._refused(exc) from None
                raise
            self.scorer_id, self.lease_s = answer["scorer_id"], float(answer["lease_s"])
            self.registrations += 1
            log.info("joined the hub at %s as %s (hub instance %s, lease %.0fs)%s", self.client.base_url,
                     self.scorer_id, answer["hub_instance"], self.lease_s,
                     "" if self.registrations == 1 else " again")
            if self.registrations == 1:
                startup_phase(log, READY)
            return self.scorer_id

    def _refused(self, exc: HubError) -> ScorerRefused:
        return ScorerRefused(f"the hub at {self.client.base_url} refused this scorer: {exc.detail}")

    def leave(self) -> None:
        with self._lock:
            scorer_id, self.scorer_id = self.scorer_id, None
        if scorer_id is None:
            return
        try:
            self.client.leave(scorer_id)
            log.info("left the hub (%d jobs, %d tokens scored)", self.jobs_scored, self.tokens_scored)
        except (HubError, ConnectionError) as exc:  # the hub drops us after a lease anyway
            log.warning("could not leave the hub: %s", exc)

    # -- the loops -------------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Score jobs until ``stop``; then leave. Errors of the loops (hub unreachable, refused) are raised here."""
        self.register()
        errors: list[BaseException] = []

        def guarded(fn):
            def body():
                try:
                    fn(stop)
                except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it
                    errors.append(exc)
                    stop.set()
            return body

        threads = [threading.Thread(target=guarded(self._jobs_loop), name=f"scorer-jobs-{i}", daemon=True)
                   for i in range(self.concurrency)]
        threads.append(threading.Thread(target=guarded(self._heartbeat_loop), name="scorer-heartbeat", daemon=True))
        for thread in threads:
            thread.start()
        while not stop.wait(0.5):
            pass
        for thread in threads:
            thread.join(timeout=self.poll_s + 60)
        self.leave()
        if errors:
            raise errors[0]

    def _heartbeat_loop(self, stop: threading.Event) -> None:
        while not stop.wait(self.lease_s / 3):
            scorer_id = self.register()
            try:
                self.client.heartbeat(scorer_id)
            except HubError as exc:
                if exc.status == 403:   # quarantined for bad results: the hub says why
                    raise self._refused(exc) from None
                if exc.status != 404:
                    raise
                log.warning("the hub does not know this scorer any more (restarted?): registering again")
                self.register(scorer_id)

    def _jobs_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            scorer_id = self.register()
            try:
                data = self.client.next_job(scorer_id, self.poll_s)
            except HubError as exc:
                if exc.status == 403:
                    raise self._refused(exc) from None
                if exc.status != 404:
                    raise
                self.register(scorer_id)
                continue
            if data is not None:
                self._score(scorer_id, data)

    def _score(self, scorer_id: str, data: bytes) -> None:
        try:
            job = decode_job(data)
        except WireError as exc:
            log.error("the hub sent a job this scorer cannot read: %s", exc)
            return  # its lease expires and another scorer takes it
        started = time.perf_counter()
        try:
            rows = self.scorer.score(job.rows, job.temperature, top_k=job.top_k)
        except Exception as exc:  # noqa: BLE001 - out of memory on a long row, a device error: this job only
            self._failed(scorer_id, job.job_id, exc)
            return
        body = encode_result(job.job_id, rows)
        try:
            answer = self.client.post_result(scorer_id, job.job_id, body)
        except HubError as exc:  # 404: the hub restarted (the job is in its spool again); 422: a bug here
            if exc.status == 403:
                raise self._refused(exc) from None
            log.warning("result of job %s not taken: %s", job.job_id, exc)
            return
        tokens = sum(r.tokens - r.prompt_length for r in job.rows)
        with self._lock:
            self.jobs_scored += 1
            self.tokens_scored += tokens
        log.debug("job %s: %d rows, %d tokens in %.3fs: %s", job.job_id, len(job.rows), tokens,
                  time.perf_counter() - started, answer.get("status"))


    def _failed(self, scorer_id: str, job_id: str, exc: Exception) -> None:
        """Tell the hub at once (the job goes to another scorer; the hub counts it, and quarantines a scorer whose
        every forward fails), and go on with the next job."""
        reason = f"{type(exc).__name__}: {exc}"
        log.exception("job %s: scoring failed (%s); reported to the hub, going on", job_id, reason)
        try:
            status = self.client.fail_job(scorer_id, job_id, reason)
        except HubError as exc:
            if exc.status == 403:
                raise self._refused(exc) from None
            log.warning("failure of job %s not taken: %s (its lease expires instead)", job_id, exc)
            return
        with self._lock:
            self.jobs_failed += 1
        log.debug("job %s: the hub says %s", job_id, status)


def run_scorer(config, hub_url: str, name: str, device: str | None = None, concurrency: int = 2, *,
               teacher: bool = False) -> None:
    """``grpo scorer``: load ref_server.model (``teacher``: ref_server.teacher_model, and join the teacher's pool) on
    ``device``, join the hub at ``hub_url``, score until SIGTERM/SIGINT."""

    from ref_server.scorer_pool.job_wire import model_identity
    from ref_server.scoring.loading import ModelLoadError, load_reference_scorer
    from shared.protocol.client import service_client, stop_on_signals

    cfg = config.ref_server
    folder, key = (cfg.teacher_model, "ref_server.teacher_model") if teacher else (cfg.model, "ref_server.model")
    if folder is None:
        raise ModelLoadError(f"grpo scorer{' --teacher' if teacher else ''} needs its model: {key} (or --model)")
    startup_phase(log, f"loading the {'teacher' if teacher else 'reference'} model {folder}")
    scorer, _ = load_reference_scorer(cfg, device, model_dir=folder)
    client = service_client(hub_url, cfg.resolved_token(), config.learner.retry_max_s, ScorerClient)
    stop = threading.Event()
    stop_on_signals(stop, client, "finishing the jobs held, then leaving the hub")
    identity = {**model_identity(folder), "role": "teacher" if teacher else "reference"}
    worker = RemoteScorer(client, scorer, name=name, identity=identity, concurrency=concurrency)
    try:
        worker.run(stop)
    finally:
        scorer.close()
        client.close()
