"""Fuzz every endpoint from the server's own OpenAPI schema, with valid and with negative (schema-violating) data,
and every JSON endpoint with hostile JSON (deep nesting, NaN/Infinity literals, huge numbers): whatever is sent, a
4xx or a 2xx comes back, never a 5xx, and /metrics counts none."""

import json

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.live_server import LiveServer, make_config


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory, tiny_model_dir):
    with LiveServer(make_config(tmp_path_factory.mktemp("fuzz"), tiny_model_dir, max_request_tokens=4096,
                                max_long_poll_s=0.2)) as live:
        yield live


@pytest.mark.slow
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_errors_on_any_endpoint(fuzz_server, mode):
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 9
    statuses: dict[str, set[int]] = {}
    for operation in operations:
        fuzz_operation(operation, fuzz_server.url, statuses, mode)
    assert fuzz_server.get("/healthz").status_code == 200
    assert 'status="5' not in fuzz_server.get("/metrics").text
    # the fuzzer did reach the handlers (some 4xx answers, not only 200s)
    if mode is GenerationMode.POSITIVE:
        assert 422 in statuses["POST /v1/logprobs"] and 400 in statuses["POST /v1/rollouts"]
    else:  # schema-violating bodies and parameters: refused (binary bodies have no schema to violate)
        assert 422 in statuses["POST /v1/batch/ack"] and 422 in statuses["GET /v1/batch"], statuses


def fuzz_operation(operation, base_url: str, statuses: dict[str, set[int]], mode=GenerationMode.POSITIVE) -> None:
    """Run hypothesis over one operation's generated requests (a function per operation: @given takes no defaults)."""
    label = f"{operation.method.upper()} {operation.path}"

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case):
        response = case.call(base_url=base_url, timeout=30)
        statuses.setdefault(label, set()).add(response.status_code)
        assert response.status_code < 500, (label, response.status_code, response.text[:300])

    try:
        fuzz()
    except Unsatisfiable:  # negative mode: an operation without parameters or body has nothing to violate
        assert mode is GenerationMode.NEGATIVE, label


# JSON that Python's json module accepts or chokes on, and that no endpoint may answer with a 5xx
_LEAVES = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10)
           | st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e999", "9" * 5000, "1" * 400 + ".0"]))
_HOSTILE = st.recursive(_LEAVES, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.sampled_from(["version", "batch_ids", "input_ids", "prompt_lengths",
                                                           "temperature", "prompt", "tokens", "wait_s", "x"]),
                                          inner, max_size=4), max_leaves=12)


def _hostile_text(value) -> str:
    """``value`` as JSON text, the sampled literals written bare (``NaN``, ``1e400``, 5000 digits)."""
    if isinstance(value, str) and (value in ("NaN", "Infinity", "-Infinity") or value[:1].isdigit()
                                   or value.startswith("-1e")):
        return value
    if isinstance(value, list):
        return "[" + ",".join(_hostile_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{_hostile_text(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)  # floats: Python writes its own NaN/Infinity


@pytest.mark.slow
def test_hostile_json_on_every_json_endpoint_is_a_4xx(fuzz_server):
    schema = json.loads(requests.get(f"{fuzz_server.url}/openapi.json", timeout=30).text)
    routes = [(method.upper(), path.replace("{member_id}", "m").replace("{sender_id}", "s"))
              for path, item in schema["paths"].items() for method, spec in item.items()
              if "application/json" in spec.get("requestBody", {}).get("content", {})]
    assert len(routes) >= 12
    session = requests.Session()

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(route=st.sampled_from(routes), value=_HOSTILE, depth=st.sampled_from([0, 0, 0, 250, 10_000]))
    def fuzz(route, value, depth):
        text = "[" * depth + _hostile_text(value) + "]" * depth
        response = session.request(route[0], fuzz_server.url + route[1], data=text.encode(),
                                   headers={"Content-Type": "application/json"}, timeout=30)
        assert response.status_code < 500, (route, text[:200], response.status_code, response.text[:300])
        assert len(response.content) < 5000 or response.status_code < 400, (route, len(response.content))

    fuzz()
    assert 'status="5' not in fuzz_server.get("/metrics").text
