"""What `grpo run` shows on its console, and writing to a console that may go away.

Every line a service prints goes to ``run_dir/logs/NAME.log`` (deploy/launcher.py); the console shows a readable
stream (``run.console: progress``, the default): the learner's per-step progress line, warnings and errors (with
the lines that follow them: a traceback, a warning's source line), and each service's start and stop lines.
Routine INFO chatter (HTTP access lines, weight-sync handshakes, loading bars) stays in the files.
``run.console: full`` (``grpo run --verbose``) shows every line, as before.

A line is classified by the log formats the services use: ours (``2026-01-02 03:04:05,678 grpo.x LEVEL msg``),
uvicorn's (``LEVEL:     msg``), DeepSpeed's (``[time] [LEVEL] [file:line:fn] msg``) and Python's warnings
(``file.py:12: SomeWarning: msg``). A line in none of them is shown when it is part of a traceback, is indented
below a shown warning or error (a Python warning's source line), or says "error" or "exception" itself (``grpo
learner: error: ...``); loading bars and blank lines are not. Warnings that every healthy run prints
(:data:`ROUTINE_WARNINGS`: back-pressure from a full queue, DeepSpeed choosing the CPU) stay in the files.

The same warning again and again (say a reward that fails on every completion) is shown :data:`REPEATS_SHOWN`
times, then the console says the rest are in the log file.

:class:`ConsoleWriter`: the launcher must outlive its console. Under ``grpo run ... | tee out.txt``, Ctrl-C reaches
``tee`` too, and every later console write fails with EPIPE; a launcher that died of that would leave its services
running and their pipes full. A write that fails marks the console gone; later lines go nowhere (they are all in
the log files) and the run stops its services as it would have.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from typing import Literal, TextIO

from shared.progress import PROGRESS_MARK

ConsoleMode = Literal["progress", "full"]

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
SHOWN_LEVELS = frozenset({"WARNING", "ERROR", "CRITICAL"})
REPEATS_SHOWN = 3

_LOGGING = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (?P<logger>\S+) (?P<level>[A-Z]+) (?P<msg>.*)$")
_UVICORN = re.compile(r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL):\s+(?P<msg>.*)$")
_DEEPSPEED = re.compile(r"^\[[^\]]+\] \[(?P<level>[A-Z]+)\] (?:\[[^\]]*\] )?(?P<msg>.*)$")
_PY_WARNING = re.compile(r"^\S.*:\d+: (?P<category>\w*Warning): (?P<msg>.*)$")
_SAYS_ERROR = re.compile(r"\berror\b|exception", re.IGNORECASE)
TRACEBACK = "Traceback (most recent call last):"
_NUMBERS = re.compile(r"\d+(\.\d+)?")

# Warnings every healthy run prints: in the log files, not on the console.
ROUTINE_WARNINGS = (
    re.compile(r"Setting accelerator to CPU"),          # DeepSpeed, in every process of a CPU run
    re.compile(r"answered 429: rollout queue is full"),  # back-pressure: the generator waits for the learner
    re.compile(r"\(not retried: shutting down\)"),       # an upload cut short when the run stops
    re.compile(r"the learner stopped"),                  # weight sync at the end of the run
)

# INFO messages that mark a service starting, becoming ready or stopping (what a person waits for).
MILESTONES = (
    re.compile(r"^ref-server (ready on|stopped)"),
    re.compile(r"^learner: \d+ rank"),
    re.compile(r"^checkpoint \S+ written"),
    re.compile(r"^resumed from "),
    re.compile(r"^SIG[A-Z]+ received: "),
    re.compile(r"^generator \S+: engine "),
    re.compile(r"^done: "),
)


@dataclass(frozen=True)
class Parsed:
    """A service's output line as the console sees it: its level (None: no log format) and its message."""

    level: str | None
    message: str


def parse(line: str) -> Parsed:
    for pattern in (_LOGGING, _UVICORN, _DEEPSPEED):
        match = pattern.match(line)
        if match and match["level"] in LEVELS:
            return Parsed(match["level"], match["msg"])
    match = _PY_WARNING.match(line)
    if match:
        return Parsed("WARNING", f"{match['category']}: {match['msg']}")
    return Parsed(None, line)


@dataclass
class LineFilter:
    """Decides, line by line, what of one service's output the console shows (one per service: it remembers
    whether a traceback or a shown warning is being continued, and how often each warning came)."""

    mode: ConsoleMode
    log_name: str                          # named when repeats stop being shown
    _traceback: bool = False               # inside a traceback: shown until its unindented last line
    _indented_follow: bool = False         # after a shown warning/error: its indented lines are shown too
    _seen: dict[str, int] = field(default_factory=dict)

    def shown(self, line: str) -> str | None:
        """The text to show for ``line`` (without the service prefix), or None to leave it to the log file."""
        if self.mode == "full":
            return line
        if self._traceback or line.startswith(TRACEBACK):
            self._traceback = line.startswith(TRACEBACK) or line[:1].isspace()  # its last line is unindented
            self._indented_follow = False
            return line
        parsed = parse(line)
        if parsed.level is None:
            if self._indented_follow and line[:1].isspace():
                return line
            self._indented_follow = False
            return line if _SAYS_ERROR.search(line) else None
        self._indented_follow = False
        if parsed.level == "INFO" and parsed.message.startswith(PROGRESS_MARK):
            return parsed.message[len(PROGRESS_MARK):]
        if parsed.level in SHOWN_LEVELS:
            return self._warning(parsed, line)
        if parsed.level == "INFO" and any(p.match(parsed.message) for p in MILESTONES):
            return parsed.message
        return None

    def _warning(self, parsed: Parsed, line: str) -> str | None:
        """A warning or error line, unless it is routine or came :data:`REPEATS_SHOWN` times already."""
        if any(p.search(parsed.message) for p in ROUTINE_WARNINGS):
            return None
        key = f"{parsed.level} {_NUMBERS.sub('#', parsed.message)}"
        count = self._seen[key] = self._seen.get(key, 0) + 1
        if count > REPEATS_SHOWN:
            return None
        self._indented_follow = True  # a Python warning's source line, a multi-line message
        if count == REPEATS_SHOWN:
            return f"{line}  [repeated: further ones only in {self.log_name}]"
        return line


class ConsoleWriter:
    """Lines to a stream (``sys.stdout`` at the time of writing unless given) that may be closed under us: the
    first failed write marks it gone, and every later write is dropped (no exception reaches the caller)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream
        self._lock = threading.Lock()
        self.gone = False

    def write(self, text: str) -> bool:
        """Write ``text`` and a newline; False if the console is gone (now or before)."""
        with self._lock:
            if self.gone:
                return False
            stream = self._stream or sys.stdout
            try:
                stream.write(text + "\n")
                stream.flush()
            except (OSError, ValueError):  # EPIPE (the reader exited), EIO (the terminal closed), a closed file
                self.gone = True
                _silence(stream)
                return False
            return True


def _silence(stream: TextIO) -> None:
    """Point the stream's descriptor at /dev/null, so that what is still buffered in it, flushed when the process
    exits, does not fail again ("Exception ignored ... BrokenPipeError")."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError, AttributeError):  # not a real file (a test's StringIO)
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


# The launcher's console: this process's standard output.
STDOUT = ConsoleWriter()


def echo_logs(names: tuple[str, ...], prefix: str, stream: TextIO | None = None) -> None:
    """Show the INFO lines of the loggers ``names`` as ``PREFIX message`` on ``stream`` (default stdout): the
    progress of the demo's warm-up (``grpo.demo``) and of evaluation (``grpo.eval``). Once per logger."""
    for name in names:
        logger = logging.getLogger(name)
        if any(getattr(h, "grpo_echo", False) for h in logger.handlers):
            continue
        handler = logging.StreamHandler(stream or sys.stdout)
        handler.setFormatter(logging.Formatter(f"{prefix} %(message)s"))
        handler.grpo_echo = True
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
