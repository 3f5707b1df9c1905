"""`grpo run` with ``eval.every_steps``: when the learner finishes, the evaluator is asked (SIGUSR1) to evaluate the
final version, whatever ``eval.every_steps``, and given ``eval.final_wait_s`` to do it before the services stop, so
that the run's closing lines compare the best version with the final one (generator/evaluator.py)."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable


def evaluate_final_version(services: list, wait_s: float, stopped: Callable[[], bool],
                           say: Callable[[str], object]) -> None:
    """Signal the ``evaluator`` service (if any, and alive) and wait until it exits, ``wait_s`` passes or
    ``stopped()`` (Ctrl-C)."""
    evaluator = next((s for s in services if s.name == "evaluator"), None)
    if evaluator is None or wait_s <= 0 or evaluator.process.poll() is not None:
        return
    say(f"the learner finished: the evaluator evaluates the final version (at most eval.final_wait_s {wait_s:g}s)")
    evaluator.process.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + wait_s
    while evaluator.process.poll() is None and not stopped():
        if time.monotonic() > deadline:
            say(f"the evaluator did not finish within eval.final_wait_s {wait_s:g}s: stopping it")
            return
        time.sleep(0.2)
