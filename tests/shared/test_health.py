"""shared.protocol.health.wait_healthy: returns on a 200 from /healthz, stops early when the watched process died,
and times out."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from shared.protocol.health import HealthTimeout, NotHealthy, ServerExited, wait_healthy


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 - the http.server name
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", httpd
    httpd.shutdown()
    httpd.server_close()


class _Process:
    def __init__(self, code):
        self.code = code

    def poll(self):
        return self.code


def test_returns_once_healthz_answers_200(server):
    url, _ = server
    wait_healthy(url, 5, process=_Process(None), poll_s=0.01)


def test_a_dead_process_ends_the_wait_with_its_status(server):
    url, _ = server
    with pytest.raises(ServerExited, match="status 3") as err:
        wait_healthy(url, 5, process=_Process(3), poll_s=0.01)
    assert err.value.returncode == 3 and isinstance(err.value, NotHealthy)


def test_no_answer_and_a_non_200_answer_time_out(server):
    url, httpd = server
    httpd.RequestHandlerClass = type("Unhealthy", (_Health,), {"status": 503})
    with pytest.raises(HealthTimeout, match="within 0s"):
        wait_healthy(url, 0.2, poll_s=0.05)
    with pytest.raises(HealthTimeout):
        wait_healthy("http://127.0.0.1:9", 0.2, poll_s=0.05, request_timeout_s=0.1)
