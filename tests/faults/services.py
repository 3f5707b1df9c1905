"""Real ``grpo`` service processes for the fault tests: started in their own process group, SIGKILLed, paused
(SIGSTOP) and resumed, stopped; and what the hub says about itself (``/v1/hub/stats``, 5xx in ``/metrics``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import requests

from tests import service_forks as forks

GRPO = str(Path(sys.executable).parent / "grpo")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
_SERVER_ERRORS = re.compile(r'^grpo_ref_requests_total\{[^}]*status="5\d\d"[^}]*\} (\S+)$', re.M)
_SERVER_ERROR_LINES = re.compile(r'^grpo_ref_requests_total\{[^}]*status="5\d\d"[^}]*\} \S+$', re.M)


class Service:
    """One ``grpo <args>`` process; its output appended to ``log``."""

    def __init__(self, name: str, args: list[str], log: Path) -> None:
        self.name, self.args, self.log_path = name, args, log
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, *extra: str) -> Service:
        with open(self.log_path, "a") as log:
            log.write(f"==== start {self.starts} {' '.join(extra)}\n")
            log.flush()
            self.proc = forks.popen([GRPO, *self.args, *extra], env=ENV, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.starts += 1
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signum)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self, grace_s: float = 60) -> int | None:
        if self.proc is None:
            return None
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def hub_stats(url: str) -> dict:
    return requests.get(f"{url}/v1/hub/stats", timeout=10).json()


def server_errors(url: str) -> float:
    """Requests the hub answered 5xx since it started (its ``/metrics``)."""
    text = requests.get(f"{url}/metrics", timeout=10).text
    return sum(float(n) for n in _SERVER_ERRORS.findall(text))


def server_error_lines(url: str) -> list[str]:
    """The hub's ``/metrics`` lines that count 5xx answers (with their route and method labels)."""
    return _SERVER_ERROR_LINES.findall(requests.get(f"{url}/metrics", timeout=10).text)


def tracebacks(log: Path, limit: int = 3, lines: int = 30) -> list[str]:
    """The last ``limit`` tracebacks a service logged (``lines`` lines each): what a failed check shows."""
    text = log.read_text(errors="replace").splitlines() if log.exists() else []
    starts = [i for i, line in enumerate(text) if line.startswith("Traceback") or "Exception in ASGI" in line]
    return ["\n".join(text[i:i + lines]) for i in starts[-limit:]]


def spooled_groups(spool: Path) -> int:
    """Group files in the spool's top folder: what a restarted hub reloads (or quarantines at reload)."""
    return len(list(spool.glob("*.group")))


def accounting_gap(stats: dict, inflow: int) -> int:
    """accepted + reloaded - (consumed + queued + leased + dropped + quarantined + corrupt) for one hub lifetime,
    where ``inflow`` is what the lifetime found in the spool at start: 0 when every accepted group is accounted for."""
    out = (stats["consumed"] + stats["queue_depth"] + stats["leased_groups"] + stats["dropped_stale"]
           + stats["dropped_ref_failure"] + stats["quarantined"] + stats["spool_corrupt"])
    return stats["accepted"] + inflow - out
