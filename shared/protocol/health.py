"""Waiting for a server to answer ``GET /healthz`` with 200 (the **contract** of the ref server), and stopping early
when the process that should become that server has already died.

One loop for the launcher (`grpo run`), the tests that start a ref server as a process, and the benchmarks.
"""

from __future__ import annotations

import time
from typing import Protocol

import requests


class Watched(Protocol):
    """What :func:`wait_healthy` reads of a process: :class:`subprocess.Popen`, or deploy.forked.ForkedProcess."""

    def poll(self) -> int | None: ...


class NotHealthy(RuntimeError):
    """The server did not become healthy: see :class:`HealthTimeout` and :class:`ServerExited`."""


class HealthTimeout(NotHealthy):
    """``GET URL/healthz`` did not answer 200 within the time allowed."""


class ServerExited(NotHealthy):
    """The watched process exited before the server answered; ``returncode`` is its exit status."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


def wait_healthy(url: str, timeout_s: float, *, process: Watched | None = None, poll_s: float = 0.5,
                 request_timeout_s: float = 2.0) -> None:
    """Return once ``GET {url}/healthz`` answers 200; poll every ``poll_s`` seconds.

    Raises :class:`ServerExited` as soon as ``process`` (if given) has exited, and :class:`HealthTimeout` when
    ``timeout_s`` seconds pass first. A refused connection, a timeout or any other request error means "not yet".
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None:
            code = process.poll()
            if code is not None:
                raise ServerExited(f"the server for {url} exited with status {code} before it was healthy", code)
        try:
            if requests.get(f"{url}/healthz", timeout=request_timeout_s).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(poll_s)
    raise HealthTimeout(f"{url}/healthz did not answer 200 within {timeout_s:.0f}s")
