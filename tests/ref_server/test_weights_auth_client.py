import socket
import threading
import time

import pytest
import requests
import torch
from safetensors.torch import load_file, save_file

from ref_server.scoring.scorer import ReferenceScorer, Row
from shared.forward.logprobs import naive_sequence_logprobs
from shared.protocol.client import HubClient, HubError, HubUnavailable, RetryPolicy

from .helpers import make_group

OCTET = {"Content-Type": "application/octet-stream"}


def weights_file(tmp_path, name, value, size=1000):
    path = tmp_path / f"{name}.safetensors"
    save_file({"model.embed_tokens.weight": torch.full((size, 8), float(value))}, str(path))
    return path


@pytest.mark.slow
def test_weight_relay_versions_prune_and_stream(server_factory, tmp_path):
    live = server_factory(model=False, keep_weight_versions=2)
    client = HubClient(live.url)
    assert client.weights_version() is None
    for version in (1, 2, 5):
        answer = client.upload_weights(version, weights_file(tmp_path, f"w{version}", version))
        assert answer["version"] == version and answer["bytes"] > 32_000
    assert client.weights_version() == 5
    assert live.get("/healthz").json()["weights_version"] == 5
    gone = live.get("/v1/weights/1")
    assert gone.status_code == 404 and "not available" in gone.json()["detail"]
    dest = client.download_weights(2, tmp_path / "got.safetensors")
    assert torch.equal(load_file(str(dest))["model.embed_tokens.weight"], torch.full((1000, 8), 2.0))
    with pytest.raises(HubError) as info:
        client.upload_weights(5, weights_file(tmp_path, "again", 9))
    assert info.value.status == 409 and "not newer" in str(info.value.detail)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v0000000002.safetensors",
                                                                      "v0000000005.safetensors"]


@pytest.mark.slow
def test_weight_uploads_that_are_not_whole_safetensors_are_refused(server_factory, tmp_path):
    live = server_factory(model=False, max_weight_bytes=100_000)
    good = weights_file(tmp_path, "good", 1).read_bytes()
    response = requests.put(f"{live.url}/v1/weights/1", data=good[:-100], headers=OCTET, timeout=30)
    assert response.status_code == 400 and "truncated" in response.json()["detail"]
    response = requests.put(f"{live.url}/v1/weights/1", data=b"\x00" * 64, headers=OCTET, timeout=30)
    assert response.status_code == 400
    big = weights_file(tmp_path, "big", 1, size=5000).read_bytes()
    response = requests.put(f"{live.url}/v1/weights/1", data=big, headers=OCTET, timeout=30)
    assert response.status_code == 413
    assert HubClient(live.url).weights_version() is None  # nothing half-written was published
    assert list((tmp_path / "weights").iterdir()) == []


@pytest.mark.slow
def test_bearer_token_on_every_endpoint_but_healthz(server_factory):
    live = server_factory(model=True, token="s3cret")
    assert live.get("/healthz").status_code == 200
    for method, path in [("GET", "/metrics"), ("POST", "/v1/logprobs"), ("POST", "/v1/rollouts"),
                         ("GET", "/v1/batch?num_groups=1"), ("GET", "/v1/weights"), ("GET", "/v1/hub/stats"),
                         ("PUT", "/v1/weights/3")]:  # the API docs are open: tests/ref_server/test_service.py
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            response = requests.request(method, live.url + path, headers=headers, timeout=30)
            assert response.status_code == 401, (method, path, headers)
            assert response.json()["detail"] == "missing or wrong bearer token"
    authed = HubClient(live.url, token="s3cret")
    assert authed.logprobs([[1, 2, 3]], [1]) and authed.weights_version() is None
    with pytest.raises(HubError) as info:
        HubClient(live.url).hub_stats()
    assert info.value.status == 401


@pytest.mark.slow
def test_token_from_environment(server_factory, monkeypatch):
    monkeypatch.setenv("GRPO_TOKEN", "from-env")
    live = server_factory(model=False)
    assert live.get("/v1/weights").status_code == 401
    assert HubClient(live.url, token="from-env").weights_version() is None


@pytest.mark.slow
def test_beta_zero_mode_loads_no_model(server_factory):
    live = server_factory(model=True, beta=0.0)
    health = live.get("/healthz").json()
    assert health["reference_model_loaded"] is False and live.state.scorer is None
    response = live.post("/v1/logprobs", json={"input_ids": [[1, 2]], "prompt_lengths": [1]})
    assert response.status_code == 503 and "beta = 0" in response.json()["detail"]
    live.post("/v1/rollouts", data=make_group().to_bytes(), headers=OCTET)
    batch = HubClient(live.url).get_batch(1)
    assert batch.ref_logprobs is None and batch.batch_size == 4


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_dead_server_looks_dead_not_empty():
    client = HubClient(f"http://127.0.0.1:{_closed_port()}", timeout_s=2,
                       retry=RetryPolicy(max_retry_s=1.0, initial_backoff_s=0.1))
    started = time.monotonic()
    with pytest.raises(HubUnavailable, match="cannot reach"):
        client.get_batch(1)
    assert time.monotonic() - started < 10


@pytest.mark.slow
def test_client_retries_429_until_accepted(server_factory):
    live = server_factory(model=False, queue_capacity=1)
    client = HubClient(live.url, retry=RetryPolicy(max_retry_s=20, initial_backoff_s=0.1))
    client.upload_group(make_group(seed=1))
    threading.Timer(1.5, lambda: client.get_batch(1)).start()
    started = time.monotonic()
    answer = client.upload_group(make_group(seed=2))  # 429 (Retry-After 1) until the timer drains the queue
    assert answer["accepted"] is True and time.monotonic() - started >= 1.0
    assert live.get("/v1/hub/stats").json()["rejected_full"] >= 1


def test_scorer_splits_batches_on_out_of_memory(tiny_model):
    calls = []

    def flaky_forward(input_ids, prompt_lengths, completion_lengths, temperature):
        calls.append(input_ids.shape[0])
        if input_ids.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        with torch.no_grad():
            return naive_sequence_logprobs(tiny_model, input_ids, prompt_lengths, completion_lengths,
                                           temperature=temperature)

    scorer = ReferenceScorer(tiny_model, vocab_size=tiny_model.config.vocab_size, max_context=256,
                             forward=flaky_forward)
    rows = [Row([1, 2, 3, 4 + i, 5], 2) for i in range(7)]
    try:
        results = scorer.score(rows, timeout=60)
    finally:
        scorer.close()
    assert [len(r) for r in results] == [3] * 7 and scorer.oom_retries >= 2
    assert max(calls[1:]) <= 4 and calls[0] == 7
    with torch.no_grad():
        want = naive_sequence_logprobs(tiny_model, torch.tensor([r.input_ids for r in rows]), torch.full((7,), 2))
    for i in range(7):
        torch.testing.assert_close(results[i], want[i], atol=1e-5, rtol=0)
