"""One rule for the code a user plugs in that fails: rewards (python, built-in, and a PRM or HTTP reward that answers
something unusable) and environments (``reset()``/``step()`` raising, timing out, returning garbage).

Each failure is contained where it happens: the completion or trajectory gets its ``on_error`` score and the run
goes on, so that a rare bug (one odd completion in a thousand) costs one score. Containment alone has one limit: a
reward or environment that fails on most of what it is given trains the model on ``on_error`` scores, a batch with
no signal (176 of 176 trajectories failed, loss 0, exit 0). So every source of failures (each reward by its name,
the environment) keeps the outcome of its last ``generator.failures.window`` completions or trajectories, and after
each engine call :meth:`FailureRule.check` stops the generator (:class:`FailureRateExceeded`, exit 2: the user's
code has to change) when

* the window is full and at least ``generator.failures.max_rate`` of it failed, or
* every completion or trajectory it has been given so far failed (the first batch of a broken reward stops the run
  at once: no need to wait for a full window).

The error names the source, the rate and the window, and the first failure in the window with its place in the
user's code (``file.py:line in function``, the innermost frame outside grpo-stack, the standard library and the
installed packages); its traceback is logged just before.

A remote reward service that is *down* (connection refused, a timeout, 5xx, 429) is not a failure of the user's
code: the reward raises :class:`ServiceDown` and :class:`ServicePause` holds the rollout loop on that group (no
generation, no upload), retrying every ``generator.failures.service_retry_s`` until the service answers again. One
that answers garbage (4xx, not JSON, the wrong number of scores) fails its group under the rule.

`grpo eval` (generator/evaluate.py) scores under the same rule and the same pause, chunk by chunk as it generates:
an accuracy computed from on_error scores would be as meaningless as training on them.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

from shared.errors import ServiceError, UsageError

log = logging.getLogger("grpo.generator")

_PROJECT = Path(__file__).resolve().parent.parent
# folders (with their separator: a user's "generator_rewards/" is not "generator/") whose frames are not the user's
_OURS = tuple(os.path.join(_PROJECT, package, "") for package in ("generator", "shared", "learner", "ref_server",
                                                                    "deploy"))
_LIBRARIES = tuple({os.path.join(Path(sysconfig.get_paths()[key]).resolve(), "")
                    for key in ("stdlib", "platstdlib", "purelib", "platlib")})
TRACE_FRAMES = 8   # frames of a failure's traceback that are kept (the innermost)
T = TypeVar("T")


def is_user_file(filename: str) -> bool:
    """Whether a frame's file is the user's: not grpo-stack's packages, the standard library or an installed one."""
    if filename.startswith("<"):   # <frozen importlib._bootstrap>, <string>: not a file of anyone's
        return False
    path = str(Path(filename).resolve())
    return not path.startswith(_OURS) and not path.startswith(_LIBRARIES)


def user_place(frames: Sequence[traceback.FrameSummary]) -> str | None:
    """``file:line in function`` of the innermost frame in the user's code (the innermost frame at all when none
    is: a built-in reward's own line)."""
    if not frames:
        return None
    frame = next((f for f in reversed(frames) if is_user_file(f.filename)), frames[-1])
    return f"{frame.filename}:{frame.lineno} in {frame.name}"


@dataclass(frozen=True)
class Failure:
    """What went wrong on one completion or trajectory: ``what`` (``KeyError: 'label'``, ``returned nan``), where
    in the user's code (None when no code raised: a value that was no number), and the traceback."""

    what: str
    where: str | None = None
    trace: str | None = None

    @classmethod
    def of(cls, exc: BaseException, context: str = "") -> Failure:
        frames = traceback.extract_tb(exc.__traceback__)
        trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-TRACE_FRAMES))
        return cls(f"{context}{type(exc).__name__}: {exc}", user_place(frames), trace)

    @classmethod
    def hung(cls, limit: str, timeout_s: float, frame: FrameType | None) -> Failure:
        """A call still running ``timeout_s`` after it began (``limit``: the setting that set it, for the message):
        where it was at that moment (its thread's current frame)."""
        what = f"took longer than {limit} = {timeout_s:g}s"
        if frame is None:
            return cls(what)
        frames = traceback.extract_stack(frame)
        return cls(what, user_place(frames), "".join(traceback.format_list(frames[-TRACE_FRAMES:])))

    def prefixed(self, context: str) -> Failure:
        return Failure(context + self.what, self.where, self.trace)

    def __str__(self) -> str:
        return self.what if self.where is None else f"{self.what} (at {self.where})"


def thread_frame(ident: int | None) -> FrameType | None:
    """The current frame of a running thread (None once it ended)."""
    return sys._current_frames().get(ident) if ident is not None else None   # noqa: SLF001 - documented in sys


class CallHung(BaseException):  # noqa: N818 - what happened to the call, as ServiceDown
    """A call of user code still running after its time limit; ``failure`` says where it was then. A
    BaseException, as KeyboardInterrupt: raised inside the call on the main thread, it must not be caught by the
    call's own ``except Exception`` (per-completion containment would go on to the next completion)."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.what)
        self.failure = failure


def call_within(call: Callable[[], T], timeout_s: float | None, limit: str) -> T:
    """``call()``'s value, or what it raised; :class:`CallHung` when it still runs ``timeout_s`` later (None: no
    limit). ``limit``: the setting that set ``timeout_s``, for the message.

    On the main thread the call runs there, and a timer interrupts it (SIGUSR2 to the main thread, whose handler
    raises CallHung at the line it reached): user code keeps the main thread, which math_verify's signal.alarm
    needs (TRL's accuracy_reward). Elsewhere it runs in a daemon thread, abandoned when it hangs: Python cannot stop
    a thread."""
    if timeout_s is None:
        return call()
    if threading.current_thread() is threading.main_thread():
        return _call_on_main(call, timeout_s, limit)
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True, name="grpo-user-call")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise CallHung(Failure.hung(limit, timeout_s, thread_frame(thread.ident)))
    if "error" in box:
        raise box["error"]
    return box["value"]


def _call_on_main(call: Callable[[], T], timeout_s: float, limit: str) -> T:
    running = [True]

    def interrupt(signum: int, frame: FrameType | None) -> None:
        if running[0]:   # a signal that arrives as the call returns is ignored
            running[0] = False
            raise CallHung(Failure.hung(limit, timeout_s, frame))

    previous = signal.signal(signal.SIGUSR2, interrupt)
    timer = threading.Timer(timeout_s, signal.pthread_kill, (threading.main_thread().ident, signal.SIGUSR2))
    timer.daemon = True
    timer.start()
    try:
        value = call()
        running[0] = False
        return value
    finally:
        running[0] = False
        timer.cancel()
        timer.join()
        signal.signal(signal.SIGUSR2, previous)


class FailureRateExceeded(UsageError):
    """A reward or environment failed on too many of its last completions or trajectories (the module docstring);
    the message names it, the rate, the window and the first failure in the window with its file:line."""


class FailureRule:
    """The outcomes of each source's last ``window`` completions or trajectories (``window`` 0: never stops)."""

    def __init__(self, window: int = 64, max_rate: float = 0.5) -> None:
        self.window, self.max_rate = window, max_rate
        self.outcomes: dict[str, collections.deque] = {}   # source -> deque of Failure | None (None: it worked)
        self.units: dict[str, str] = {}                     # source -> what it is given ("completions")

    def record(self, source: str, outcomes: Sequence[Failure | None], unit: str = "completions") -> None:
        """The outcome of each of the ``unit`` ``source`` (``reward 'python'``, ``environment 'guess'``) was given:
        a Failure, or None where it worked."""
        self.outcomes.setdefault(source, collections.deque(maxlen=max(self.window, 1))).extend(outcomes)
        self.units[source] = unit

    def record_group(self, reward_names: Sequence[str], failures: dict[str, Sequence[Failure | None]],
                     environment: str | None = None, trajectories: Sequence[Failure | None] = ()) -> None:
        """One scored group: each reward's outcome on its completions (``GroupScores.failures``), and with an
        environment (its name) what failed each trajectory there."""
        for name in reward_names:
            self.record(f"reward {name!r}", failures[name])
        if environment is not None:
            self.record(f"environment {environment!r}", trajectories, "trajectories")

    def check(self) -> None:
        """:class:`FailureRateExceeded` for the first source over the rule (its traceback logged first)."""
        if not self.window:
            return
        for source, kept in self.outcomes.items():
            failures = [o for o in kept if o is not None]
            full, every = len(kept) == self.window, len(failures) == len(kept)
            if not failures or not (every or (full and len(failures) >= self.max_rate * len(kept))):
                continue
            first, unit = failures[0], self.units[source]
            over = (f"all {len(kept)} {unit} it was given so far" if every and not full else
                    f"{len(failures)} of its last {len(kept)} {unit} ({len(failures) / len(kept):.0%})")
            if first.trace:
                log.error("%s: the first failure in the window:\n%s", source, first.trace.rstrip())
            raise FailureRateExceeded(
                f"{source} failed on {over}: the rule is to stop at {self.max_rate:.0%} of a window of {self.window} "
                f"(generator.failures.max_rate and .window), since training would learn from on_error scores alone; "
                f"the first failure in the window: {first}")


class ServiceDown(ServiceError):
    """A remote reward service (a PRM, an HTTP reward model) that does not answer: connection refused, a timeout,
    5xx or 429. Not a failure of the reward: :class:`ServicePause` waits for it. One that answers something unusable
    (4xx, not JSON, the wrong count) raises any other error, a failure under the rule."""

    def __init__(self, service: str, url: str, reason: str) -> None:
        super().__init__(f"{service} at {url} unreachable ({reason})")
        self.service, self.url, self.reason = service, url, reason


class ServicePause:
    """Runs a scoring call again, every ``retry_s``, while it raises :class:`ServiceDown`: generation pauses on that
    group (nothing is uploaded meanwhile), with one console line when the pause starts and one when it ends."""

    def __init__(self, retry_s: float = 10.0, paused: str = "generation") -> None:
        """``paused``: what waits for the service, as the console lines name it (``grpo eval``: "evaluation")."""
        self.retry_s = retry_s
        self.paused = paused
        self.down: ServiceDown | None = None   # set while paused
        self.pauses = 0
        self.paused_s = 0.0

    def call(self, score: Callable[[], T], stop: threading.Event) -> T | None:
        """``score()``'s value; None when a stop was requested while the service was down."""
        since = time.monotonic()
        while not (stop.is_set() and self.down is not None):
            try:
                value = score()
            except ServiceDown as exc:
                if self.down is None:
                    self.pauses += 1
                    log.warning("%s: pausing %s, retrying every %gs (generator.failures.service_retry_s)",
                                exc, self.paused, self.retry_s)
                self.down = exc
                stop.wait(self.retry_s)
                continue
            if self.down is not None:
                waited = time.monotonic() - since
                self.paused_s += waited
                log.warning("%s at %s answers again: %s resumes (paused %.0fs)", self.down.service,
                            self.down.url, self.paused, waited)
                self.down = None
            return value
        return None
