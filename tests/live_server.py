"""A real uvicorn server on 127.0.0.1 (in a thread of the test process) around the real app, for any test folder."""

import socket
import threading
import time

import requests
import uvicorn

from ref_server.app import create_app
from ref_server.server import build_state
from shared.config.schema import GRPOConfig


class AppServer:
    """uvicorn around any ASGI ``app`` in a thread of the test process, on ``port`` of 127.0.0.1 (0: a free one)."""

    def __init__(self, app, port: int = 0) -> None:
        self.app = app
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and without it
        # every keep-alive request waits ~40 ms for a delayed ACK
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
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


class LiveServer(AppServer):
    """The real ref server app (build_state + create_app) from a config."""

    def __init__(self, config: GRPOConfig, port: int = 0) -> None:
        self.config = config
        self.state = build_state(config)
        super().__init__(create_app(self.state), port)

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.state.curriculum.close()   # as ref_server.server.serve does at a clean stop
        for pool in {id(p): p for p in (self.state.scorer, self.state.teacher) if p is not None}.values():
            pool.close()

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


