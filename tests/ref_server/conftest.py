"""Fixtures around a live reference server (see tests/live_server.py).

The servers here score on the CPU in float32 unless a test asks otherwise: the tests compare their logprobs with
the float32 CPU ``tiny_model`` at 1e-5, which ``device: auto`` (bfloat16 on a GPU machine) would not meet."""

import pytest

from tests.live_server import LiveServer, make_config

PINNED = {"device": "cpu", "dtype": "float32"}


@pytest.fixture
def server_factory(tmp_path, tiny_model_dir):
    """Start servers with config overrides; all are stopped at the end of the test."""
    started = []

    def start(model=True, path=None, **ref_server) -> LiveServer:
        live = LiveServer(make_config(path or tmp_path, tiny_model_dir if model else None, **{**PINNED, **ref_server}))
        started.append(live.__enter__())
        return live

    yield start
    for live in started:
        live.__exit__(None, None, None)


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory, tiny_model_dir):
    """One server with the tiny model for the read-only logprob tests of a module."""
    with LiveServer(make_config(tmp_path_factory.mktemp("srv"), tiny_model_dir, max_request_tokens=4096,
                                max_request_bytes=200_000, **PINNED)) as live:
        yield live
