"""Joined scorers for real: a hub (real uvicorn) with ``local_scoring: false`` and ``grpo scorer`` subprocesses on the
tiny model. Reference logprobs equal a local ReferenceScorer's; a scorer killed while it holds jobs loses nothing
and nothing is delivered twice; a scorer joining mid-run takes the waiting work at once; /v1/logprobs is answered by
a scorer, and with none a 503 with the reason comes after the bounded wait."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import requests
import torch

from ref_server.scoring.scorer import ReferenceScorer, Row
from shared.protocol.client import HubClient
from shared.protocol.scorer_client import ScorerClient
from tests import service_forks as forks
from tests.ref_server.conftest import PINNED
from tests.ref_server.helpers import make_group

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def start_scorer(url: str, model_dir, name: str, log_dir: Path, *extra: str) -> subprocess.Popen:
    log = open(log_dir / f"{name}.log", "w")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return forks.popen([forks.GRPO, "scorer", "--hub", url, "--model", str(model_dir),
                             "--id", name, "--device", "cpu", "--threads", "1", "--set", "ref_server.dtype=float32",
                             *extra], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def stop(process: subprocess.Popen) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    return process.wait(timeout=30)


def expected_ref(direct: ReferenceScorer, group) -> list[torch.Tensor]:
    prompt = group.prompt_ids.tolist()
    rows = [Row(prompt + group.completion_ids[i, :int(n)].tolist(), len(prompt))
            for i, n in enumerate(group.completion_lengths)]
    return direct.score(rows, group.sampling.temperature, timeout=60)


def consume(client: HubClient, count: int, timeout: float) -> dict:
    """A learner-like consumer: batches until ``count`` groups, acknowledged; group id -> its rows' ref logprobs."""
    seen: dict[str, list[torch.Tensor]] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < count and time.monotonic() < deadline:
        batch = client.get_batch(4, wait_s=2.0)
        if batch is None:
            continue
        for g, group_id in enumerate(batch.group_ids):
            assert group_id not in seen, f"group {group_id} delivered twice"
            rows = (batch.group_index == g).nonzero().flatten().tolist()
            seen[group_id] = [batch.ref_logprobs[r, :int(batch.completion_lengths[r])] for r in rows]
        client.ack_batches([batch.batch_id])
    return seen


def test_two_scorers_score_like_local_and_one_killed_mid_run_loses_nothing(server_factory, tiny_model, tiny_model_dir,
                                                                           tmp_path):
    live = server_factory(local_scoring=False, scorer_lease_s=2.0, queue_capacity=64)
    pool = live.state.scorer
    health = live.get("/healthz").json()   # no scorer yet: the reference model is loaded nowhere
    assert (health["scoring"], health["reference_model_loaded"], health["reference_model_configured"]) == \
        ("no scorer", False, True)
    scorers = [start_scorer(live.url, tiny_model_dir, name, tmp_path) for name in ("s-a", "s-b")]
    direct = ReferenceScorer(tiny_model, vocab_size=tiny_model.config.vocab_size, max_context=512)
    client = HubClient(live.url)
    try:
        wait_for(lambda: pool.scorers() == 2, 300, "two scorers to join")  # ~5 s on an idle machine
        health = live.get("/healthz").json()
        assert (health["scoring"], health["reference_model_loaded"]) == ("2 joined", True)
        groups = [make_group(seed=i, group_size=8, prompt=tuple(range(1, 33)), lengths=(60, 50, 40, 64, 55, 45, 30, 64))
                  for i in range(24)]
        for group in groups[:12]:
            client.upload_group(group)
        # SIGKILL scorer a while it holds a job: no leave, no result; its lease expires and b scores the job
        victim = next(s for s in pool._scorers.values() if s.name == "s-a")
        wait_for(lambda: bool(victim.jobs), 20, "scorer a to hold a job")
        scorers[0].kill()
        scorers[0].wait(timeout=30)
        # a result the victim sent just before it died may still be answered: the jobs it holds once that settled
        # are the ones that must go back (a snapshot taken before the kill counted such a job: flaky)
        time.sleep(0.5)
        held = set(victim.jobs)
        for group in groups[12:]:
            client.upload_group(group)
        seen = consume(client, len(groups), 60)
        assert set(seen) == {g.group_id for g in groups}
        for group in groups:
            for got, want in zip(seen[group.group_id], expected_ref(direct, group)):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        stats = client.hub_stats()
        assert (stats["accepted"], stats["consumed"], stats["dropped_ref_failure"]) == (24, 24, 0)
        counters = pool.counters
        assert counters.jobs_scored == 24 and counters.jobs_requeued >= len(held) >= 1
        assert not (held & set(pool._jobs)) and counters.results_refused == 0
        # /v1/logprobs for outside tools, answered by the scorer that is left
        body = {"input_ids": [[1, 2, 3, 4, 5, 6], [7, 8, 9]], "prompt_lengths": [2, 1]}
        answer = live.post("/v1/logprobs", json=body)
        assert answer.status_code == 200
        want = direct.score([Row(r, p) for r, p in zip(body["input_ids"], body["prompt_lengths"])], 1.0, timeout=60)
        for got, expected in zip(answer.json()["logprobs"], want):
            torch.testing.assert_close(torch.tensor(got), expected, rtol=0, atol=1e-6)
        assert stop(scorers[1]) == 0  # SIGTERM: finishes, leaves, exits 0
        wait_for(lambda: pool.scorers() == 0, 10, "scorer b to leave")
    finally:
        client.close()
        direct.close()
        for process in scorers:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)


def test_no_scorer_then_one_joins_mid_run_and_takes_the_waiting_work(server_factory, tiny_model_dir, tmp_path):
    live = server_factory(local_scoring=False, scorer_wait_s=1.0, queue_capacity=16)
    pool = live.state.scorer
    client = HubClient(live.url)
    scorer = None
    try:
        started = time.monotonic()
        answer = live.post("/v1/logprobs", json={"input_ids": [[1, 2, 3]], "prompt_lengths": [1]})
        assert answer.status_code == 503 and answer.headers["Retry-After"] == "5"
        assert "no reference scorer answered within 1s (scoring: no scorer" in answer.json()["detail"]
        assert 1.0 <= time.monotonic() - started < 10 and pool.queue_depth() == 0  # the request's job is gone
        for i in range(4):
            client.upload_group(make_group(seed=i))
        time.sleep(0.5)
        health = live.get("/healthz").json()
        assert (health["scoring"], health["scoring_jobs_waiting"], live.state.hub.ready_depth()) == ("no scorer", 4, 0)
        assert "grpo_no_scorer 1.0" in live.get("/metrics").text
        # a scorer whose model is not the hub's is refused: exit 2 with one line naming the reason
        other = tmp_path / "other-model"
        other.symlink_to(tiny_model_dir, target_is_directory=True)
        refused = start_scorer(live.url, other, "s-wrong", tmp_path)
        scorer = start_scorer(live.url, tiny_model_dir, "s-late", tmp_path)
        assert refused.wait(timeout=300) == 2
        assert "refused this scorer" in (tmp_path / "s-wrong.log").read_text()
        wait_for(lambda: pool.scorers() == 1, 300, "the scorer to join")
        joined = time.monotonic()
        wait_for(lambda: live.state.hub.ready_depth() == 4, 10, "the waiting groups to be scored")
        assert time.monotonic() - joined < 5  # took the waiting work at once
        assert pool.counters.jobs_scored == 4 and live.get("/healthz").json()["scoring"] == "1 joined"
    finally:
        client.close()
        if scorer is not None:
            assert stop(scorer) == 0


def test_the_scorer_routes_refuse_bad_input(server_factory):
    live = server_factory(local_scoring=False)
    refused = live.post("/v1/scorers", json={"name": "x", "vocab_size": 7})
    assert refused.status_code == 409 and "vocab_size 7" in refused.json()["detail"]
    sid = live.post("/v1/scorers", json={"name": "x", "vocab_size": live.state.vocab_size}).json()["scorer_id"]
    assert live.get("/v1/scorers/nobody/work").status_code == 404
    assert live.post(f"/v1/scorers/{sid}/results/j1", data=b"junk").status_code == 400
    assert requests.post(live.url + "/v1/scorers/nobody/heartbeat", timeout=10).status_code == 404
    assert requests.delete(live.url + f"/v1/scorers/{sid}", timeout=10).json() == {"requeued": 0}
    assert PINNED["device"] == "cpu"


def test_a_scorer_registers_again_after_a_hub_restart(tmp_path, tiny_model, tiny_model_dir):
    """RemoteScorer (what `grpo scorer` runs) in a thread of this process, against a hub that restarts on its port."""
    import threading

    from ref_server.scoring.remote import RemoteScorer
    from ref_server.scoring.scoring_jobs import model_identity
    from tests.live_server import LiveServer, make_config

    def hub(name, port=0):
        config = make_config(tmp_path / name, tiny_model_dir, local_scoring=False, **PINNED)
        return LiveServer(config, port=port).__enter__()

    body = {"input_ids": [[1, 2, 3, 4, 5]], "prompt_lengths": [2]}
    first = hub("a")
    scorer = ReferenceScorer(tiny_model, vocab_size=tiny_model.config.vocab_size, max_context=512)
    worker = RemoteScorer(ScorerClient(first.url), scorer, name="t", identity=model_identity(str(tiny_model_dir)),
                          poll_s=0.5)
    stop_worker = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop_worker,), daemon=True)
    thread.start()
    second = None
    try:
        wait_for(lambda: first.state.scorer.scorers() == 1, 20, "the scorer to join")
        want = first.post("/v1/logprobs", json=body).json()["logprobs"]
        first.__exit__(None, None, None)
        second = hub("b", port=int(first.url.rsplit(":", 1)[1]))
        wait_for(lambda: second.state.scorer.scorers() == 1, 30, "the scorer to join the restarted hub")
        assert second.post("/v1/logprobs", json=body).json()["logprobs"] == want
        assert worker.registrations == 2
        stop_worker.set()
        thread.join(timeout=30)
        assert not thread.is_alive() and second.state.scorer.scorers() == 0  # it left
    finally:
        stop_worker.set()
        scorer.close()
        if second is not None:
            second.__exit__(None, None, None)
