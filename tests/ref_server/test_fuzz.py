"""Fuzz every endpoint from the server's own OpenAPI schema: whatever is sent, no 5xx comes back."""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.live_server import LiveServer, make_config


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory, tiny_model_dir):
    with LiveServer(make_config(tmp_path_factory.mktemp("fuzz"), tiny_model_dir, max_request_tokens=4096,
                                max_long_poll_s=0.2)) as live:
        yield live


@pytest.mark.slow
def test_no_server_errors_on_any_endpoint(fuzz_server):
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 9
    statuses: dict[str, set[int]] = {}
    for operation in operations:
        fuzz_operation(operation, fuzz_server.url, statuses)
    assert fuzz_server.get("/healthz").status_code == 200
    # the fuzzer did reach the handlers (some 4xx answers, not only 200s)
    assert 422 in statuses["POST /v1/logprobs"] and 400 in statuses["POST /v1/rollouts"]


def fuzz_operation(operation, base_url: str, statuses: dict[str, set[int]]) -> None:
    """Run hypothesis over one operation's generated requests (a function per operation: @given takes no defaults)."""
    label = f"{operation.method.upper()} {operation.path}"

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(case=operation.as_strategy())
    def fuzz(case):
        response = case.call(base_url=base_url, timeout=30)
        statuses.setdefault(label, set()).add(response.status_code)
        assert response.status_code < 500, (label, response.status_code, response.text[:300])

    fuzz()
