import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from shared.forward.logprobs import naive_sequence_logprobs
from shared.protocol.client import HubClient
from shared.protocol.logprob_messages import encode_logprob_request

pytestmark = pytest.mark.slow  # every test uses the live shared_server

OCTET = {"Content-Type": "application/octet-stream"}


def expected_rows(model, input_ids, prompt_lengths, temperature=1.0):
    """The same logprobs computed in-process with transformers (naive full log-softmax), row by row."""
    rows = []
    for ids, plen in zip(input_ids, prompt_lengths):
        with torch.no_grad():
            out = naive_sequence_logprobs(model, torch.tensor([ids]), torch.tensor([plen]), temperature=temperature)
        rows.append(out[0].tolist())
    return rows


def random_rows(rng, n, vocab, max_len=40):
    input_ids, prompt_lengths = [], []
    for _ in range(n):
        length = rng.randint(1, max_len)
        input_ids.append([rng.randrange(vocab) for _ in range(length)])
        prompt_lengths.append(rng.randint(1, length))
    return input_ids, prompt_lengths


def assert_rows_close(got, want, atol=1e-4):
    assert [len(r) for r in got] == [len(r) for r in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(w), atol=atol, rtol=0)


def test_health(shared_server):
    body = shared_server.get("/healthz").json()
    assert body["status"] == "ok" and body["reference_model_loaded"] is True
    assert body["vocab_size"] > 40 and body["max_context"] == 256


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_json_parity_with_transformers_ragged(shared_server, tiny_model, temperature):
    vocab = tiny_model.config.vocab_size
    input_ids, prompt_lengths = random_rows(random.Random(1), 7, vocab)
    input_ids.append([3, 4, 5])  # prompt covers the whole row: zero completion tokens
    prompt_lengths.append(3)
    response = shared_server.post("/v1/logprobs", json={
        "input_ids": input_ids, "prompt_lengths": prompt_lengths, "temperature": temperature})
    assert response.status_code == 200, response.text
    got = response.json()["logprobs"]
    assert [len(r) for r in got] == [len(i) - p for i, p in zip(input_ids, prompt_lengths)]
    assert got[-1] == []
    assert_rows_close(got, expected_rows(tiny_model, input_ids, prompt_lengths, temperature))


def test_temperature_changes_values(shared_server):
    payload = {"input_ids": [[5, 6, 7, 8, 9]], "prompt_lengths": [1]}
    hot = shared_server.post("/v1/logprobs", json={**payload, "temperature": 2.0}).json()["logprobs"][0]
    cold = shared_server.post("/v1/logprobs", json=payload).json()["logprobs"][0]
    assert max(abs(a - b) for a, b in zip(hot, cold)) > 1e-3


def test_binary_form_equals_json(shared_server, tiny_model):
    input_ids, prompt_lengths = random_rows(random.Random(2), 5, tiny_model.config.vocab_size)
    client = HubClient(shared_server.url)
    binary = client.logprobs(input_ids, prompt_lengths, temperature=0.9, binary=True)
    as_json = client.logprobs(input_ids, prompt_lengths, temperature=0.9, binary=False)
    assert_rows_close(binary, as_json, atol=1e-6)
    assert_rows_close(binary, expected_rows(tiny_model, input_ids, prompt_lengths, 0.9))


BAD_JSON = [
    ({"input_ids": [[1, -2, 3]], "prompt_lengths": [1]}, 422, "token id -2"),
    ({"input_ids": [[1, 99999, 3]], "prompt_lengths": [1]}, 422, "token id 99999 is outside"),
    ({"input_ids": [[1, 2, 3]], "prompt_lengths": [0]}, 422, "prompt_length 0"),
    ({"input_ids": [[1, 2, 3]], "prompt_lengths": [4]}, 422, "prompt_length 4"),
    ({"input_ids": [[1, 2], [3, 4]], "prompt_lengths": [1]}, 422, "2 rows but prompt_lengths has 1"),
    ({"input_ids": [], "prompt_lengths": []}, 422, "input_ids is empty"),
    ({"input_ids": [[1, 2.5]], "prompt_lengths": [1]}, 422, "valid integer"),
    ({"input_ids": [[1, "2"]], "prompt_lengths": [1]}, 422, "valid integer"),
    ({"input_ids": [[1, True]], "prompt_lengths": [1]}, 422, "valid integer"),
    ({"input_ids": [[1, 2]], "prompt_lengths": [1], "temperature": 0}, 422, "greater than or equal to 0.001"),
    ({"prompt_lengths": [1]}, 422, "Field required"),
    ({"input_ids": [list(range(10)) * 30], "prompt_lengths": [1]}, 422, "exceed the model's context of 256"),
    ({"input_ids": [[1] * 200] * 21, "prompt_lengths": [1] * 21}, 413, "4096-token budget"),
]


@pytest.mark.parametrize("payload, status, message", BAD_JSON)
def test_bad_json_input_gets_4xx_with_reason(shared_server, payload, status, message):
    response = shared_server.post("/v1/logprobs", json=payload)
    assert response.status_code == status, response.text
    assert message in json.dumps(response.json()["detail"])
    # and the server keeps serving
    ok = shared_server.post("/v1/logprobs", json={"input_ids": [[1, 2, 3]], "prompt_lengths": [1]})
    assert ok.status_code == 200 and len(ok.json()["logprobs"][0]) == 2


def test_malformed_bodies(shared_server):
    response = shared_server.post("/v1/logprobs", data=b"{not json", headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and "JSON" in json.dumps(response.json()["detail"])
    response = shared_server.post("/v1/logprobs", data=b"\x05\x00\x00\x00\x00\x00\x00\x00abc", headers=OCTET)
    assert response.status_code == 400 and "not safetensors" in response.json()["detail"]
    response = shared_server.post("/v1/logprobs", data=b"x" * 300_000, headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and "200000-byte limit" in response.json()["detail"]
    good = encode_logprob_request([[1, 2, 3]], [1], 1.0)
    truncated = good[: len(good) - 4]
    response = shared_server.post("/v1/logprobs", data=truncated, headers=OCTET)
    assert response.status_code == 400


def test_binary_bad_ids_are_checked_too(shared_server):
    body = encode_logprob_request([[1, 2, 100000]], [1], 1.0)
    response = shared_server.post("/v1/logprobs", data=body, headers=OCTET)
    assert response.status_code == 422 and "token id 100000" in response.json()["detail"]


def test_many_concurrent_clients_get_correct_answers(shared_server, tiny_model):
    vocab = tiny_model.config.vocab_size
    requests_ = [random_rows(random.Random(100 + i), 3, vocab, max_len=30) for i in range(24)]
    client = HubClient(shared_server.url)
    before = shared_server.state.scorer.forward_batches

    def call(args):
        return client.logprobs(*args, binary=bool(hash(str(args)) % 2))

    with ThreadPoolExecutor(max_workers=12) as pool:
        answers = list(pool.map(call, requests_))
    for (input_ids, prompt_lengths), got in zip(requests_, answers):
        assert_rows_close(got, expected_rows(tiny_model, input_ids, prompt_lengths))
    # requests were micro-batched together: fewer forward passes than requests
    assert shared_server.state.scorer.forward_batches - before < len(requests_)


def test_metrics_exposition(shared_server):
    shared_server.post("/v1/logprobs", json={"input_ids": [[1, 2, 3, 4]], "prompt_lengths": [2]})
    text = shared_server.get("/metrics").text
    assert 'grpo_ref_requests_total{endpoint="/v1/logprobs",status="200"}' in text
    assert "grpo_ref_request_seconds_bucket" in text and "grpo_hub_queue_depth" in text
    scored = [line for line in text.splitlines() if line.startswith("grpo_ref_tokens_scored_total")]
    assert scored and float(scored[0].split()[-1]) >= 2


def test_openapi_docs(shared_server):
    spec = shared_server.get("/openapi.json").json()
    assert "/v1/logprobs" in spec["paths"] and "/v1/rollouts" in spec["paths"]
    assert shared_server.get("/docs").status_code == 200
