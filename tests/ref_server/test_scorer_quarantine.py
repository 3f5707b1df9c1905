"""Hostile scorers against a real hub (uvicorn on 127.0.0.1, ``local_scoring: false``), speaking the scorer HTTP
protocol by hand (ref_server/scorer_pool/routes.py): bad results do not send a job round forever.

* A scorer that sends ``ref_server.scorer_max_bad_results`` bad results (NaN, the wrong shape, a result for a job it
  does not hold) is quarantined: its next call and a new registration under its name are refused 403 with the
  reason, it leaves the pool, the job it held goes to another scorer at once, and /metrics counts it.
* A job that fails ``ref_server.scoring_job_max_failures`` times on scorers fails its waiting request with the
  reasons (a /v1/logprobs request answers 503 naming the setting; a group is dropped, counted
  ``dropped_ref_failure``) instead of being handed out again.
"""

import threading
import time

import pytest
import requests
import torch

from ref_server.scorer_pool.job_wire import decode_job, encode_result
from tests.ref_server.helpers import make_group

pytestmark = pytest.mark.slow
REQUEST = {"input_ids": [[1, 2, 3, 4, 5], [1, 2, 3]], "prompt_lengths": [2, 1]}


class HandScorer:
    """A scorer client speaking the protocol with plain HTTP calls."""

    def __init__(self, live, name: str) -> None:
        self.live = live
        answer = live.post("/v1/scorers", json={"name": name, "vocab_size": live.state.vocab_size})
        assert answer.status_code == 200, answer.text
        self.id = answer.json()["scorer_id"]

    def work(self, wait_s: float = 10.0) -> requests.Response:
        return self.live.get(f"/v1/scorers/{self.id}/work", params={"wait_s": wait_s})

    def take(self):
        response = self.work()
        assert response.status_code == 200, (response.status_code, response.text)
        return decode_job(response.content)

    def post(self, job_id: str, rows: list[torch.Tensor]) -> requests.Response:
        return self.live.post(f"/v1/scorers/{self.id}/results/{job_id}", data=encode_result(job_id, rows),
                              headers={"Content-Type": "application/octet-stream"})


def valid(job, value: float = -0.5) -> list[torch.Tensor]:
    return [torch.full((r.tokens - r.prompt_length,), value) for r in job.rows]


def nan_rows(job) -> list[torch.Tensor]:
    rows = valid(job)
    rows[0][0] = float("nan")
    return rows


def short_rows(job) -> list[torch.Tensor]:
    return [row[:-1] for row in valid(job)]


def in_background(fn):
    """Run ``fn`` in a thread; the returned list gets its result."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


def metric(live, event: str) -> float:
    for line in live.get("/metrics").text.splitlines():
        if line.startswith(f'grpo_scoring_jobs{{event="{event}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no grpo_scoring_jobs metric for {event}")


def test_a_scorer_sending_bad_results_is_quarantined_and_its_job_goes_to_another(server_factory):
    live = server_factory(local_scoring=False, scorer_max_bad_results=3, scoring_job_max_failures=10,
                          scorer_wait_s=60.0)
    hostile = HandScorer(live, "hostile")
    waiting, answer = in_background(lambda: live.post("/v1/logprobs", json=REQUEST))
    job = hostile.take()
    assert hostile.post(job.job_id, nan_rows(job)).status_code == 422        # bad result 1: back in the queue
    job = hostile.take()                                                     # the same job, handed out again
    assert hostile.post(job.job_id, short_rows(job)).status_code == 422      # bad result 2
    job = hostile.take()
    not_held = f"{job.job_id}x"                                              # bad result 3: a job it does not hold
    refused = hostile.post(not_held, valid(job))
    assert refused.status_code == 404, refused.text
    # quarantined: every call from now on is refused with the reason, a new registration under its name too
    for response in (hostile.work(wait_s=0), hostile.post(job.job_id, valid(job)),
                     live.post(f"/v1/scorers/{hostile.id}/heartbeat"),
                     live.post("/v1/scorers", json={"name": "hostile", "vocab_size": live.state.vocab_size})):
        assert response.status_code == 403, response.text
        detail = response.json()["detail"]
        assert "quarantined" in detail and "ref_server.scorer_max_bad_results is 3" in detail, detail
    assert live.state.scorer.scorers() == 0 and metric(live, "scorers_quarantined") == 1
    assert metric(live, "results_refused") == 3
    # the job it held went back at once (its lease is 30 s): another scorer gets it and answers the waiting request
    honest = HandScorer(live, "honest")
    again = honest.take()
    assert again.job_id == job.job_id
    assert honest.post(again.job_id, valid(again, -0.25)).json() == {"status": "scored"}
    waiting.join(timeout=30)
    assert answer[0].status_code == 200, answer[0].text
    assert answer[0].json()["logprobs"] == [[-0.25] * 3, [-0.25] * 2]
    assert metric(live, "jobs_given_up") == 0


def test_a_job_failing_on_every_scorer_fails_its_request_instead_of_going_round(server_factory):
    live = server_factory(local_scoring=False, scorer_max_bad_results=100, scoring_job_max_failures=3,
                          scorer_wait_s=60.0)
    scorers = [HandScorer(live, f"broken-{i}") for i in range(3)]
    waiting, answer = in_background(lambda: live.post("/v1/logprobs", json=REQUEST))
    for scorer in scorers:                       # each scorer gets the job once and fails it
        job = scorer.take()
        assert scorer.post(job.job_id, nan_rows(job)).status_code == 422
    waiting.join(timeout=30)
    assert answer[0].status_code == 503, answer[0].text
    detail = answer[0].json()["detail"]
    assert "failed 3 times on joined scorers (ref_server.scoring_job_max_failures is 3)" in detail, detail
    assert "finite" in detail, detail   # the reasons come with it
    assert scorers[0].work(wait_s=0.5).status_code == 204     # not handed out again
    # a group whose scoring fails the same way is dropped with the reason, counted, and never delivered
    group = make_group(seed=0)
    assert live.post("/v1/rollouts", data=group.to_bytes(),
                     headers={"Content-Type": "application/octet-stream"}).status_code == 200
    for scorer in scorers:
        job = scorer.take()
        assert scorer.post(job.job_id, short_rows(job)).status_code == 422
    deadline = time.monotonic() + 10
    while (stats := live.get("/v1/hub/stats").json())["dropped_ref_failure"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)   # the failed job's request is failed off the pool's lock
    assert stats["dropped_ref_failure"] == 1 and stats["queue_depth"] == 0 and stats["leased_groups"] == 0, stats
    assert metric(live, "jobs_given_up") == 2 and metric(live, "scorers_quarantined") == 0
    assert live.state.scorer.scorers() == 3


class NaNModel:
    """A reference model gone bad (what a broken GPU or a wrong dtype gives): every logprob NaN."""

    vocab_size = None   # set from the hub

    def score(self, rows, temperature=1.0, timeout=None, top_k=0):
        return [torch.full((r.tokens - r.prompt_length,), float("nan")) for r in rows]


def test_grpo_scorers_loop_stops_with_the_hubs_reason_once_quarantined(server_factory):
    """RemoteScorer (what `grpo scorer` runs) over a model that answers NaN: the hub quarantines it after three
    results and it stops with the hub's reason (exit 2 in the CLI) instead of scoring on."""
    from ref_server.scorer_pool.remote import RemoteScorer, ScorerRefused
    from shared.protocol.scorer_client import ScorerClient

    live = server_factory(local_scoring=False, scorer_max_bad_results=3, scoring_job_max_failures=10,
                          scorer_wait_s=60.0)
    model = NaNModel()
    model.vocab_size = live.state.vocab_size
    worker = RemoteScorer(ScorerClient(live.url), model, name="nan-scorer", identity={}, concurrency=1, poll_s=0.5)
    waiting, _ = in_background(lambda: live.post("/v1/logprobs", json=REQUEST))
    stop = threading.Event()
    failed: list = []
    thread = threading.Thread(target=lambda: failed.append(_raised(worker.run, stop)), daemon=True)
    thread.start()
    thread.join(timeout=30)
    stop.set()
    assert not thread.is_alive()
    assert isinstance(failed[0], ScorerRefused), failed
    assert "quarantined" in str(failed[0]) and "not finite" in str(failed[0]), failed[0]
    assert metric(live, "scorers_quarantined") == 1 and metric(live, "results_refused") == 3
    assert live.state.scorer.queue_depth() == 1   # the job waits for a scorer that works


def _raised(fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc
    return None


def test_a_job_a_scorer_cannot_score_is_reported_and_goes_to_another_at_once(server_factory):
    live = server_factory(local_scoring=False, scorer_max_bad_results=2, scoring_job_max_failures=10,
                          scorer_wait_s=60.0)
    failing, honest = HandScorer(live, "failing"), HandScorer(live, "honest")
    waiting, answer = in_background(lambda: live.post("/v1/logprobs", json=REQUEST))
    job = failing.take()
    report = live.post(f"/v1/scorers/{failing.id}/jobs/{job.job_id}/failed", json={"reason": "out of memory"})
    assert report.json() == {"status": "requeued"}
    # not after a lease (30 s): the other scorer has it now, and answers the waiting request
    again = honest.take()
    assert again.job_id == job.job_id and honest.post(again.job_id, valid(again)).json() == {"status": "scored"}
    waiting.join(timeout=30)
    assert answer[0].status_code == 200 and metric(live, "jobs_failed_by_scorer") == 1
    assert metric(live, "results_refused") == 0   # a report is no refused result
    assert live.post(f"/v1/scorers/{failing.id}/jobs/{job.job_id}/failed",
                     json={"reason": "late"}).json() == {"status": "unknown"}   # it holds that job no more
    for body in ({}, {"reason": ""}, {"reason": "x" * 2001}, {"reason": "oom", "extra": 1}):
        assert live.post(f"/v1/scorers/{failing.id}/jobs/{job.job_id}/failed", json=body).status_code == 422, body
    # a scorer whose every forward fails is quarantined like one sending bad results (max_bad_results 2)
    waiting, answer = in_background(lambda: live.post("/v1/logprobs", json=REQUEST))
    job = failing.take()
    assert live.post(f"/v1/scorers/{failing.id}/jobs/{job.job_id}/failed", json={"reason": "device error"}).json() \
        == {"status": "requeued"}
    refused = failing.work(wait_s=0)
    assert refused.status_code == 403 and "could not score it: device error" in refused.json()["detail"]
    again = honest.take()
    assert honest.post(again.job_id, valid(again)).json() == {"status": "scored"}
    waiting.join(timeout=30)
    assert answer[0].status_code == 200 and metric(live, "scorers_quarantined") == 1


class OutOfMemoryOnLongRows:
    """A reference model that runs out of memory on rows of more than 4 tokens (and scores the others)."""

    vocab_size = None

    def score(self, rows, temperature=1.0, timeout=None, top_k=0):
        if any(r.tokens > 4 for r in rows):
            raise RuntimeError("CUDA out of memory (a stand-in)")
        return [torch.full((r.tokens - r.prompt_length,), -0.5) for r in rows]


def test_grpo_scorers_loop_reports_a_job_it_cannot_score_and_goes_on(server_factory):
    """RemoteScorer (what `grpo scorer` runs) over a model that fails on long rows: it reports each failure, stays
    joined and scores the next jobs; the job that fails everywhere is given up with the reason, not handed round."""
    from ref_server.scorer_pool.remote import RemoteScorer
    from shared.protocol.scorer_client import ScorerClient

    live = server_factory(local_scoring=False, scorer_max_bad_results=100, scoring_job_max_failures=2,
                          scorer_wait_s=60.0)
    model = OutOfMemoryOnLongRows()
    model.vocab_size = live.state.vocab_size
    worker = RemoteScorer(ScorerClient(live.url), model, name="oom-scorer", identity={}, concurrency=1, poll_s=0.5)
    stop = threading.Event()
    failed: list = []
    thread = threading.Thread(target=lambda: failed.append(_raised(worker.run, stop)), daemon=True)
    thread.start()
    try:
        long_rows = live.post("/v1/logprobs", json=REQUEST)              # a row of 5 tokens: fails twice
        assert long_rows.status_code == 503 and "CUDA out of memory" in long_rows.json()["detail"], long_rows.text
        short = live.post("/v1/logprobs", json={"input_ids": [[1, 2, 3]], "prompt_lengths": [1]})
        assert short.status_code == 200 and short.json()["logprobs"] == [[-0.5, -0.5]]
        deadline = time.monotonic() + 10   # the worker counts a job after the hub has taken its answer
        while (worker.jobs_failed, worker.jobs_scored) != (2, 1) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert thread.is_alive() and worker.jobs_failed == 2 and worker.jobs_scored == 1
        assert metric(live, "jobs_failed_by_scorer") == 2 and metric(live, "jobs_given_up") == 1
    finally:
        stop.set()
        thread.join(timeout=30)
    assert failed == [None]
