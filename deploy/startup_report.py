"""What `grpo run` waits for while its services start: a console line every ``run.startup_report_s`` seconds until
the learner's first step.

A run spends a while before its first step (a SmolLM2 run on a CPU: 79 s) importing, loading its models, setting up
DeepSpeed, generating the first groups and computing the first step; its console would say nothing meanwhile. Each
service says what it does now in a log line (``start-up: loading the model X``: :func:`shared.progress.startup_phase`);
the launcher hands every line of every service to :meth:`StartupReport.line` (deploy/launcher.py), and a thread shows
one line every ``every_s`` seconds, e.g.::

    [grpo run] == start-up 35s: learner: waiting for the first batch (12s); gen-0: generating the first groups (20s)

each service that is not ready yet, with what it does and for how long (since its last phase line; a service that
has said nothing yet is "starting", since it was started). The lines stop at the learner's first progress line
(its first step) or when the run ends, whichever comes first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from deploy.console import parse
from shared.progress import PROGRESS_MARK, READY, STARTUP_MARK, format_duration

STARTING = "starting"
PREFIX = "== start-up"


class StartupReport:
    """The start-up phase of each service (from its lines), and the thread that reports them."""

    def __init__(self, say: Callable[[str], object], every_s: float, *, learner: str = "learner",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.say, self.every_s, self.learner, self.clock = say, every_s, learner, clock
        self.since = clock()
        self.phases: dict[str, tuple[str, float]] = {}   # service -> (phase, since when)
        self.first_step = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._saying = threading.Lock()   # a line being said is out before the first step is marked
        self._thread: threading.Thread | None = None

    def started(self, name: str) -> None:
        with self._lock:
            self.phases[name] = (STARTING, self.clock())

    def ready(self, name: str) -> None:
        """``name`` is ready (the launcher saw the ref server answer /healthz)."""
        with self._lock:
            self.phases[name] = (READY, self.clock())

    def line(self, name: str, text: str) -> None:
        """A line of service ``name``'s output: a start-up phase, or (the learner's) its first progress line."""
        if self.first_step.is_set():
            return
        parsed = parse(text)
        if parsed.level != "INFO":
            return
        if parsed.message.startswith(STARTUP_MARK):
            with self._lock:
                self.phases[name] = (parsed.message[len(STARTUP_MARK):], self.clock())
        elif name == self.learner and parsed.message.startswith(PROGRESS_MARK):
            with self._saying:   # called before the progress line is shown: no report line follows it
                self.first_step.set()

    def report(self) -> str:
        """The line for now: every service not ready, what it does and for how long."""
        now = self.clock()
        with self._lock:
            waiting = [f"{name}: {phase} ({format_duration(now - since)})"
                       for name, (phase, since) in self.phases.items() if phase != READY]
        return f"{PREFIX} {format_duration(now - self.since)}: " + ("; ".join(waiting) or "every service is ready")

    def start(self) -> None:
        """Report every ``every_s`` seconds from a thread (0: never), until the first step or :meth:`close`."""
        if self.every_s <= 0:
            return
        self._thread = threading.Thread(target=self._run, name="startup-report", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            with self._saying:
                if self.first_step.is_set():
                    return
                self.say(self.report())

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
