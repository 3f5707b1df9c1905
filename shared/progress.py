"""Progress of a long job as a line every few seconds: done/total, the percentage and the time left.

Used where a person would otherwise stare at a silent terminal: the demo's supervised warm-up, held-out evaluation
and the learner's per-step line. No terminal control codes: the lines read the same in a log file, under ``| tee``
and on a terminal.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

# Starts the learner's per-step line (learner/metrics.py), which `grpo run` shows on its console (deploy/console.py).
PROGRESS_MARK = "progress: "
# Starts a service's line naming what it does now while it starts (``start-up: loading the model X``): until the
# learner's first step, `grpo run` says what it waits for and for how long (deploy/startup_report.py).
STARTUP_MARK = "start-up: "
READY = "ready"   # the start-up phase of a service that has finished starting (the ref server answering)


def startup_phase(logger: logging.Logger, phase: str) -> None:
    """Log (INFO) that the service now does ``phase`` ("loading the model X", "waiting for the first batch")."""
    logger.info("%s%s", STARTUP_MARK, phase)


def format_duration(seconds: float) -> str:
    """``45s``, ``3m05s``, ``2h07m``: a short human duration (rounded to the second; negative counts as 0)."""
    total = max(0, round(seconds))
    if total < 60:
        return f"{total}s"
    minutes, secs = divmod(total, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def eta_seconds(done: float, total: float, elapsed_s: float) -> float | None:
    """Seconds left at the rate so far (``elapsed_s`` for ``done`` units); None before the first unit."""
    if done <= 0 or total <= 0:
        return None
    return elapsed_s / done * max(total - done, 0)


class Ticker:
    """Reports ``what: done/total (pct%), ETA ...`` through ``emit`` at most every ``every_s`` seconds, and once at
    the end (``done == total``, with the time it took).

    ``bounded``: ``total`` is a cap the job may stop before (a warm-up phase with an accuracy target), so the time
    left is an upper bound ("at most ...") rather than an estimate.
    """

    def __init__(self, what: str, total: int, emit: Callable[[str], None], *, every_s: float = 10.0,
                 unit: str = "", bounded: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        if total < 0:
            raise ValueError(f"{what}: a total of {total} units")
        self.what, self.total, self.emit, self.every_s = what, total, emit, every_s
        self.unit = f" {unit}" if unit else ""
        self.bounded = bounded
        self._clock = clock
        self.started = self._last = clock()
        self.lines = 0

    def update(self, done: int, detail: str = "", *, finished: bool = False) -> bool:
        """``done`` units finished (absolute, not an increment); ``detail`` is appended to the line; ``finished``:
        the job ended here (before its total too). Whether a line was emitted."""
        now = self._clock()
        finished = finished or done >= self.total
        if not finished and now - self._last < self.every_s:
            return False
        self._last = now
        elapsed = now - self.started
        pct = 100.0 * done / self.total if self.total else 100.0
        if finished:
            timing = f"in {format_duration(elapsed)}"
        else:
            left = eta_seconds(done, self.total, elapsed)
            timing = "ETA --" if left is None else (f"at most {format_duration(left)} more" if self.bounded
                                                     else f"ETA {format_duration(left)}")
        text = f"{self.what}: {done}/{self.total}{self.unit} ({pct:.0f}%), {timing}"
        self.emit(f"{text}, {detail}" if detail else text)
        self.lines += 1
        return True
