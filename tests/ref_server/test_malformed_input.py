"""Malformed input found by fault injection: each one a 4xx with a reason, never a 500; 5xx are counted."""

import json
import struct

import pytest
import torch
from safetensors.torch import save

from shared.protocol.wire import FORMAT_KEY, JSON_KEY

pytestmark = pytest.mark.slow  # every test uses a live server (shared_server or server_factory)

OCTET = {"Content-Type": "application/octet-stream"}


def _logprob_request(temperature_json: str) -> bytes:
    """A binary logprob request whose metadata carries ``temperature`` exactly as written (e.g. ``1e400``)."""
    fields = '{"temperature": ' + temperature_json + "}"
    return save({"input_ids": torch.tensor([1, 2, 3]), "row_lengths": torch.tensor([3]),
                 "prompt_lengths": torch.tensor([1])}, metadata={FORMAT_KEY: "logprob_request/v1", JSON_KEY: fields})


@pytest.mark.parametrize("temperature", ["1e400", "-1e400", "1e-300", "0", "10" * 200, '"hot"', "true"])
def test_binary_logprob_temperatures_out_of_range_are_400(shared_server, temperature):
    response = shared_server.post("/v1/logprobs", data=_logprob_request(temperature), headers=OCTET)
    assert response.status_code == 400 and "temperature" in response.json()["detail"], response.text


@pytest.mark.parametrize("temperature", [1e-300, 0.0, -1.0])
def test_json_logprob_tiny_temperature_is_422_not_null_logprobs(shared_server, temperature):
    response = shared_server.post("/v1/logprobs", json={"input_ids": [[1, 2, 3]], "prompt_lengths": [1],
                                                        "temperature": temperature})
    assert response.status_code == 422, response.text
    huge = shared_server.post("/v1/logprobs", data='{"input_ids": [[1, 2, 3]], "prompt_lengths": [1], '
                              '"temperature": 1e400}', headers={"Content-Type": "application/json"})
    assert huge.status_code == 400 and "not strict JSON" in huge.json()["detail"]  # no float64: malformed JSON


def _weights_blob(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize("spec, reason", [
    ({"dtype": "F32", "shape": [2]}, "data_offsets"),
    ({"dtype": "F32", "shape": [2], "data_offsets": "0,8"}, "data_offsets"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0]}, "data_offsets"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}, "do not match"),
    ({"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}, "shape"),
])
def test_weights_with_broken_headers_are_400(server_factory, spec, reason):
    live = server_factory(model=False)
    response = _put(live, "/v1/weights/1", _weights_blob({"w": spec}, b"\0" * 8))
    assert response.status_code == 400 and reason in response.json()["detail"], response.text
    assert live.get("/v1/weights").json()["version"] is None


# every JSON type where a header field belongs: each was a TypeError (a 500) somewhere ("dtype": [..] on every route)
ODD_ENTRIES = [
    {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]},
    {"dtype": {"F32": 1}, "shape": [2], "data_offsets": [0, 8]},
    {"dtype": None, "shape": [2], "data_offsets": [0, 8]},
    {"dtype": "F32", "shape": {"0": 2}, "data_offsets": [0, 8]},
    {"dtype": "F32", "shape": [2], "data_offsets": [[0], 8]},
    ["F32", [2], [0, 8]],
]


@pytest.mark.parametrize("entry", ODD_ENTRIES, ids=lambda e: json.dumps(e)[:40])
def test_header_fields_of_any_json_type_are_4xx_on_every_route(shared_server, entry):
    """The one header parser answers every route that reads safetensors bytes: /v1/logprobs (binary),
    /v1/rollouts, /v1/rollouts/batch (a bad container, and a bad group inside a good one) and the weight upload."""
    live = shared_server
    blob = _weights_blob({"t": entry}, b"\0" * 8)
    for path in ("/v1/logprobs", "/v1/rollouts", "/v1/rollouts/batch"):
        response = live.post(path, data=blob, headers=OCTET)
        assert response.status_code == 400 and "tensor 't'" in response.json()["detail"], (path, response.text)
    response = _put(live, "/v1/weights/1", blob)
    assert response.status_code == 400 and "tensor 't'" in response.json()["detail"], response.text
    from shared.protocol.wire import encode_messages
    inner = live.post("/v1/rollouts/batch", data=encode_messages([blob]), headers=OCTET)
    assert inner.status_code == 200, inner.text
    (answer,) = inner.json()["answers"]
    assert answer["status"] == 400 and "tensor 't'" in answer["refused"]
    metrics = live.get("/metrics").text
    assert 'status="500"' not in metrics


def test_weights_with_overlapping_or_gapped_tensors_are_400(server_factory):
    live = server_factory(model=False)
    overlap = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
               "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    gap = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
           "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}
    for header in (overlap, gap):
        response = _put(live, "/v1/weights/1", _weights_blob(header, b"\0" * 12))
        assert response.status_code == 400 and "contiguous" in response.json()["detail"], response.text
    good = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    assert _put(live, "/v1/weights/1", _weights_blob(good, b"\0" * 12)).status_code == 200


def test_a_weights_version_far_ahead_of_the_learner_is_refused(server_factory):
    live = server_factory(model=False)
    blob = save({"w": torch.zeros(2)})
    response = _put(live, "/v1/weights/9999999999", blob)
    assert response.status_code == 409 and "ahead" in response.json()["detail"]
    assert _put(live, "/v1/weights/10000000000", blob).status_code == 422  # outside the path's range
    assert _put(live, "/v1/weights/3", blob).status_code == 200


def test_5xx_are_counted_in_metrics(server_factory):
    live = server_factory(model=False)

    def explode():
        raise RuntimeError("injected")

    live.state.hub.depth = explode  # /healthz reads it: an unhandled error inside a handler
    with pytest.raises(RuntimeError, match="injected"):
        # the in-process test server re-raises; a client of uvicorn would see a bare 500
        from fastapi.testclient import TestClient
        TestClient(live.app).get("/healthz")
    metrics = live.get("/metrics").text
    assert 'grpo_ref_requests_total{endpoint="/healthz",status="500"} 1.0' in metrics


def _put(live, path, data):
    import requests
    return requests.put(live.url + path, data=data, headers=OCTET, timeout=30)
