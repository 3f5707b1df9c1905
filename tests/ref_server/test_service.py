"""The reference server as a service (issue 24 item 5): the API docs open in a browser without the token
(``ref_server.public_docs``), every error of the OpenAI-style routes in OpenAI's shape (from the routes, the router
and the request guard alike), and malformed bodies answered 400 on every route with a short body that never
echoes the input (a body of the wrong shape stays 422).

The shape is checked here key by key: what OpenAI's client reads (``error.message`` for the exception's text,
``type``, ``param``, ``code``); tests/ref_server/test_openai_client.py checks that the real ``openai`` client parses
it into its own exceptions."""

import json
import socket
import time

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ref_server import session_routes
from ref_server.app import create_app
from ref_server.http import OPENAI_PATHS, error_body, is_openai_path
from ref_server.hub import routes as hub_routes
from ref_server.relay import routes as relay_routes
from ref_server.scoring import logprobs_routes
from ref_server.server import build_state
from ref_server.tool_api import completions_routes, prm_routes, tokenizer_routes
from shared.protocol.openai_errors import MAX_ERROR_TEXT, OPENAI_ERROR_TYPES, openai_error
from tests.live_server import AppServer, LiveServer, make_config

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {"Content-Type": "application/json"}
OCTET = {"Content-Type": "application/octet-stream"}
MARKER = "QZ" * 300  # in every malformed body: an answer that holds a piece of it echoes the input


def assert_openai_error(response: requests.Response, status: int, kind: str, code: str | None = None) -> str:
    """``response`` is OpenAI's error shape, exactly: ``{"error": {"message", "type", "param", "code"}}``."""
    assert response.status_code == status, response.text[:300]
    assert response.headers["content-type"] == "application/json", response.headers
    body = response.json()
    assert list(body) == ["error"] and sorted(body["error"]) == ["code", "message", "param", "type"], body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"], body
    assert error["type"] == kind and error["code"] == code, body
    return error["message"]


# -- the shape itself ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("status, kind", [(400, "invalid_request_error"), (401, "authentication_error"),
                                          (404, "not_found_error"), (405, "invalid_request_error"),
                                          (408, "timeout_error"), (413, "invalid_request_error"),
                                          (422, "invalid_request_error"), (429, "rate_limit_error"),
                                          (500, "server_error"), (503, "service_unavailable"),
                                          (418, "invalid_request_error"), (502, "server_error")])
def test_openai_error_type_per_status(status, kind):
    assert openai_error(status, "why", param="prompt", code="c") == {
        "error": {"message": "why", "type": kind, "param": "prompt", "code": "c"}}
    assert error_body("/v1/completions", status, "why") == {
        "error": {"message": "why", "type": kind, "param": None, "code": None}}
    assert error_body("/v1/batch/ack", status, "why") == {"detail": "why"}


_PROBLEMS = st.lists(st.fixed_dictionaries({"loc": st.lists(st.text(max_size=20) | st.integers(), max_size=4),
                                            "msg": st.text(max_size=20) | st.just("m" * 2000)}), max_size=30)


@settings(max_examples=60)
@given(status=st.integers(400, 599), message=st.text(max_size=20) | st.just("x" * 5000) | _PROBLEMS, path=st.sampled_from(
    sorted(OPENAI_PATHS) + ["/v1/models/x/y", "/v1/logprobs", "/v1/rollouts", "/healthz", "/v1/modelsx"]))
def test_error_bodies_are_bounded_in_either_shape(status, message, path):
    body = error_body(path, status, message)
    assert len(json.dumps(body)) < 6000  # a few hundred characters per string, at most ten items per list
    if is_openai_path(path):
        error = body["error"]
        assert isinstance(error["message"], str) and len(error["message"]) <= MAX_ERROR_TEXT + 30
        assert error["type"] == OPENAI_ERROR_TYPES.get(status, "server_error" if status >= 500 else
                                                       "invalid_request_error")
    else:
        assert list(body) == ["detail"]


def test_the_openai_paths_are_exactly_the_openai_routers():
    """Every route of the OpenAI-style routers answers errors in OpenAI's shape; no hub, relay or /v1/logprobs
    route does (their clients read ``detail``)."""
    for router in (completions_routes.router, tokenizer_routes.router, prm_routes.router):
        for route in router.routes:
            assert is_openai_path(route.path.replace("{model:path}", "some/model")), route.path
    for router in (hub_routes.router, session_routes.router, relay_routes.router, logprobs_routes.router):
        for route in router.routes:
            assert not is_openai_path(route.path), route.path
    assert not is_openai_path("/v1/models-x") and is_openai_path("/v1/models/a/b")


# -- live servers ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def secured(tmp_path_factory, tiny_model_dir):
    """A server with the tiny model, a token, a small body limit and a short body deadline."""
    config = make_config(tmp_path_factory.mktemp("service"), tiny_model_dir, token=TOKEN, device="cpu",
                         dtype="float32", max_request_bytes=4096, body_timeout_s=3.0, max_long_poll_s=0.2)
    with LiveServer(config) as live:
        yield live


@pytest.mark.slow
def test_api_docs_open_without_the_token_and_offer_it(secured):
    docs = secured.get("/docs")
    assert docs.status_code == 200 and "swagger-ui" in docs.text and "/openapi.json" in docs.text
    assert secured.get("/redoc").status_code == 200 and secured.get("/docs/oauth2-redirect").status_code == 200
    spec = secured.get("/openapi.json").json()
    assert spec["components"]["securitySchemes"]["bearer"] == {
        "type": "http", "scheme": "bearer", "description": "ref_server.token (or GRPO_TOKEN)"}
    assert spec["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]
    assert spec["paths"]["/v1/batch/ack"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in spec["paths"]["/healthz"]["get"]
    # everything else still needs it, in the shape each path's clients read
    for path in ("/v1/hub/stats", "/metrics", "/v1/weights"):
        response = secured.get(path)
        assert response.status_code == 401 and response.json() == {"detail": "missing or wrong bearer token"}
        assert response.headers["www-authenticate"] == "Bearer"
    assert secured.get("/v1/hub/stats", headers=AUTH).status_code == 200


@pytest.mark.slow
def test_every_error_of_the_openai_routes_is_in_openai_shape(secured):
    for method, path in [("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/v1/models/m"),
                         ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/tokenizer_info"),
                         ("POST", "/v1/chat/completions")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            response = requests.request(method, secured.url + path, json={"prompt": "hi"}, headers=headers,
                                        timeout=30)
            message = assert_openai_error(response, 401, "authentication_error", "invalid_api_key")
            assert message == "missing or wrong bearer token"

    def post(path, **kw):
        return requests.post(secured.url + path, headers={**AUTH, **kw.pop("headers", {})}, timeout=30, **kw)

    assert "not strict JSON" in assert_openai_error(post("/v1/completions", data=b"{", headers=JSON), 400,
                                                    "invalid_request_error")
    bad_field = post("/v1/completions", json={"prompt": "hi", "temperature": 0.5, "max_tokens": 2})
    assert "greedily" in assert_openai_error(bad_field, 400, "invalid_request_error")
    assert bad_field.json()["error"]["param"] == "temperature"
    too_long = post("/v1/completions", json={"prompt": "1" * 400, "max_tokens": 0})
    assert "context of 256" in assert_openai_error(too_long, 400, "invalid_request_error", "context_length_exceeded")
    # the guard's 413, from the declared length and from a chunked body passing the limit
    assert "4096-byte limit" in assert_openai_error(post("/tokenize", data=b" " * 5000, headers=JSON), 413,
                                                    "invalid_request_error")
    chunked = post("/v1/completions", data=iter([b'{"prompt": "', b"1" * 3000, b"1" * 3000, b'"}']), headers=JSON)
    assert "4096-byte limit" in assert_openai_error(chunked, 413, "invalid_request_error")
    # the router's 404 and 405, and an unknown model
    for method, path, status, kind in [("POST", "/v1/chat/completions", 404, "not_found_error"),
                                       ("GET", "/v1/completions", 405, "invalid_request_error")]:
        answer = requests.request(method, secured.url + path, headers=AUTH, timeout=30)
        assert f"Invalid URL ({method} {path})" in assert_openai_error(answer, status, kind)
    unknown = requests.get(secured.url + "/v1/models/gpt-4", headers=AUTH, timeout=30)
    assert "'gpt-4' does not exist" in assert_openai_error(unknown, 404, "not_found_error", "model_not_found")
    served = secured.get("/v1/models", headers=AUTH).json()["data"][0]["id"]
    assert secured.get(f"/v1/models/{served}", headers=AUTH).json()["id"] == served
    assert 'status="5' not in secured.get("/metrics", headers=AUTH).text


@pytest.mark.slow
def test_a_body_that_stops_arriving_is_408_in_openai_shape(secured):
    with socket.create_connection(("127.0.0.1", int(secured.url.rsplit(":", 1)[1])), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        started = time.monotonic()
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
    assert 2.9 < time.monotonic() - started < 10, answer
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower(), head
    error = json.loads(body)["error"]
    assert error["type"] == "timeout_error" and "deadline" in error["message"], error


def _body_routes(live) -> list[tuple[str, str, bool]]:
    """(method, path, binary) of every route that takes a body, from the server's own OpenAPI schema."""
    spec = live.get("/openapi.json").json()
    routes = []
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            content = operation.get("requestBody", {}).get("content", {})
            if content:
                concrete = path.replace("{member_id}", "m").replace("{sender_id}", "s").replace("{version}", "7")
                routes.append((method.upper(), concrete, "application/json" not in content))
    return routes


def _assert_short_400(response: requests.Response, path: str, binary: bool) -> None:
    assert response.status_code == 400, (path, response.status_code, response.text[:300])
    assert len(response.content) < 600 and "QZQZQZQZ" not in response.text, (path, response.text[:300])
    body = response.json()
    message = body["error"]["message"] if is_openai_path(path) else body["detail"]
    assert ("safetensors" if binary else "JSON") in message, (path, message)


@pytest.mark.slow
def test_malformed_bodies_are_400_on_every_route_and_wrong_shapes_422(secured):
    routes = _body_routes(secured)
    assert len(routes) >= 18 and ("POST", "/v1/batch/ack", False) in routes and ("PUT", "/v1/weights/7", True) in routes
    malformed = [b"", b"{", b"not json " + MARKER.encode(), b'{"prompt": "' + MARKER.encode(),
                 b'{"a": NaN, "m": "' + MARKER.encode() + b'"}', b'{"a": 1,}', b"[" * 300 + b"]" * 300]
    for method, path, binary in routes:
        for body in malformed:
            response = requests.request(method, secured.url + path, data=body, timeout=30,
                                        headers={**AUTH, **(OCTET if binary else JSON)})
            _assert_short_400(response, path, binary)
        if not binary:  # JSON of the wrong shape: 422 (FastAPI's and /v1/logprobs'), 400 on OpenAI's routes
            response = requests.request(method, secured.url + path, data=b"[1, 2]", headers={**AUTH, **JSON},
                                        timeout=30)
            assert response.status_code == (400 if is_openai_path(path) else 422), (path, response.text[:300])
    metrics = secured.get("/metrics", headers=AUTH).text
    assert 'status="5' not in metrics and 'grpo_ref_requests_refused_total{reason="bad_json"}' in metrics


@pytest.mark.slow
def test_any_cut_json_body_is_a_short_400(secured):
    """Property: every strict prefix of a JSON object is malformed, whatever it holds, on whichever route."""
    routes = _body_routes(secured)
    session = requests.Session()
    values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                      max_size=3), max_leaves=8)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(route=st.sampled_from(routes), value=values, data=st.data())
    def cut(route, value, data):
        text = json.dumps({"marker": MARKER, "prompt": value, "tokens": value})
        body = text[:data.draw(st.integers(0, len(text) - 1))].encode()
        method, path, binary = route
        response = session.request(method, secured.url + path, data=body, timeout=30,
                                   headers={**AUTH, **(OCTET if binary else JSON)})
        _assert_short_400(response, path, binary)

    cut()


@pytest.mark.slow
def test_public_docs_false_puts_the_docs_behind_the_token(server_factory):
    live = server_factory(model=False, token=TOKEN, public_docs=False)
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert live.get(path).status_code == 401 and live.get(path).json() == {"detail": "missing or wrong bearer token"}
        assert live.get(path, headers=AUTH).status_code == 200
    # without a model: 503 and an empty model list, in OpenAI's shape
    no_model = requests.post(live.url + "/v1/completions", json={"prompt": "hi"}, headers=AUTH, timeout=30)
    assert "beta = 0" in assert_openai_error(no_model, 503, "service_unavailable")
    missing = live.get("/v1/models/any", headers=AUTH)
    assert "none (beta = 0 mode)" in assert_openai_error(missing, 404, "not_found_error", "model_not_found")


@pytest.mark.slow
def test_an_unhandled_error_is_a_500_in_the_paths_shape_without_its_text(tmp_path):
    app = create_app(build_state(make_config(tmp_path)))

    async def broken() -> None:
        raise RuntimeError("secret internals")

    app.add_api_route("/pooling", broken, methods=["POST"])  # an OpenAI-style path (no reward model is loaded)
    app.add_api_route("/v1/broken", broken, methods=["POST"])
    with AppServer(app) as live:
        answer = requests.post(live.url + "/pooling", timeout=30)
        assert "logged by the server" in assert_openai_error(answer, 500, "server_error")
        plain = requests.post(live.url + "/v1/broken", timeout=30)
        assert plain.status_code == 500 and plain.json() == {"detail": "internal server error (logged by the server)"}
        assert "secret" not in answer.text + plain.text
