"""The endpoint under uvicorn, on a thread of the generator: the port is bound before it starts (a port in use is
a UsageError naming ``generator.agent.port`` and its holder) and the server is up when :meth:`start` returns."""

from __future__ import annotations

import logging
import threading
import time

from generator.agent.calls import CallHandler
from generator.agent.routes import build_app
from shared.config.schema.agent import AgentConfig
from shared.errors import ServiceError, UsageError
from shared.ports import bind_port, token_problem

log = logging.getLogger("grpo.generator.agent")

START_TIMEOUT_S = 30.0


class AgentServer:
    def __init__(self, handler: CallHandler, cfg: AgentConfig) -> None:
        self.handler, self.cfg = handler, cfg
        self.url = ""
        self._server = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        import uvicorn

        cfg = self.cfg
        problem = token_problem(cfg.host, cfg.token, "generator.agent.host")
        if problem:
            raise UsageError(problem.replace("GRPO_TOKEN (or ref_server.token)", "generator.agent.token"))
        sock = bind_port(cfg.host, cfg.port, "generator.agent.port")
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        app = build_app(self.handler, cfg.token, cfg.max_request_bytes, cfg.body_timeout_s)
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                                     timeout_graceful_shutdown=2))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name="grpo-agent-endpoint")
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ServiceError(f"the agent endpoint did not start on {self.url} (see the log above)")
            time.sleep(0.02)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
