"""``ref_server.cpu_cores``: the ref server's process pinned to a few cores at start.

The hub's threads (the event loop, the upload workers, the spool's writer) share one interpreter lock. Floating over
every core, a thread woken on another core spins for the lock the running one holds, and on a 2-core machine the
hub served fewer groups with a longer upload tail than on one core of its own (docs/hub-capacity.md). Pinning is
applied to every thread the process has when it is set, and every thread started later (uvicorn's, the hub's,
torch's) inherits it, so the whole process stays on those cores.

Kept free of heavy imports: the preflight (deploy/preflight.py) checks the cores before anything starts.
"""

from __future__ import annotations

import logging
import os

from shared.errors import UsageError

__all__ = ["KEY", "available_cores", "cpu_cores_problem", "pin_process"]

KEY = "ref_server.cpu_cores"
log = logging.getLogger("grpo.ref_server")


def available_cores() -> set[int]:
    """The cores this process may run on (its affinity mask, as its parent left it)."""
    return set(os.sched_getaffinity(0))


def _spans(cores: set[int]) -> str:
    """``0-3,6`` for {0, 1, 2, 3, 6}, as the kernel writes core lists."""
    spans, ordered = [], sorted(cores)
    start = previous = ordered[0]
    for core in [*ordered[1:], None]:
        if core is not None and core == previous + 1:
            previous = core
            continue
        spans.append(str(start) if start == previous else f"{start}-{previous}")
        if core is not None:
            start = previous = core
    return ",".join(spans)


def cpu_cores_problem(cores: list[int] | None, available: set[int] | None = None) -> str | None:
    """One line naming the key when ``cores`` lists a core this process may not run on; None when they are fine
    (or unset)."""
    if cores is None:
        return None
    available = available_cores() if available is None else available
    missing = [c for c in cores if c not in available]
    if not missing:
        return None
    which = "core " + str(missing[0]) if len(missing) == 1 else "cores " + ", ".join(map(str, missing))
    return (f"{KEY}: {which} not available: this process may run on cores {_spans(available)} "
            f"({os.cpu_count()} on the machine)")


def pin_process(cores: list[int] | None) -> None:
    """Put this process (every thread it has now; threads started later inherit it) on ``cores``; nothing when
    None. A core the process may not use is a :class:`UsageError` naming the key."""
    if cores is None:
        return
    problem = cpu_cores_problem(cores)
    if problem:
        raise UsageError(problem)
    for tid in _thread_ids():
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
    log.info("%s: this process and its threads run on core%s %s only", KEY, "" if len(cores) == 1 else "s",
             _spans(set(cores)))


def _thread_ids() -> list[int]:
    """Every thread of this process (Linux's /proc/self/task); elsewhere only the calling one."""
    try:
        return [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:
        return [0]
