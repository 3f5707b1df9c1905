"""A real uvicorn server on 127.0.0.1 (in a thread of the test process) around the real app and tiny model."""

import socket
import threading
import time

import pytest
import requests
import torch
import uvicorn
from transformers import AutoModelForCausalLM

from ref_server.app import create_app
from ref_server.server import build_state
from shared.config import GRPOConfig


class LiveServer:
    def __init__(self, config: GRPOConfig) -> None:
        self.config = config
        self.state = build_state(config)
        self.app = create_app(self.state)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()
        if self.state.scorer is not None:
            self.state.scorer.close()

    def get(self, path: str, **kw) -> requests.Response:
        return requests.get(self.url + path, timeout=30, **kw)

    def post(self, path: str, **kw) -> requests.Response:
        return requests.post(self.url + path, timeout=30, **kw)


def make_config(tmp_path, model_dir=None, **ref_server) -> GRPOConfig:
    beta = ref_server.pop("beta", 0.04 if model_dir is not None else 0.0)
    return GRPOConfig.model_validate({
        "algorithm": {"loss": {"beta": beta}},
        "ref_server": {"model": str(model_dir) if model_dir else None, "spool_dir": str(tmp_path / "spool"),
                       "weights_dir": str(tmp_path / "weights"), "max_long_poll_s": 5.0, **ref_server},
    })


@pytest.fixture
def server_factory(tmp_path, tiny_model_dir):
    """Start servers with config overrides; all are stopped at the end of the test."""
    started = []

    def start(model=True, path=None, **ref_server) -> LiveServer:
        live = LiveServer(make_config(path or tmp_path, tiny_model_dir if model else None, **ref_server))
        started.append(live.__enter__())
        return live

    yield start
    for live in started:
        live.__exit__(None, None, None)


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory, tiny_model_dir):
    """One server with the tiny model for the read-only logprob tests of a module."""
    with LiveServer(make_config(tmp_path_factory.mktemp("srv"), tiny_model_dir, max_request_tokens=4096,
                                max_request_bytes=200_000)) as live:
        yield live


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
