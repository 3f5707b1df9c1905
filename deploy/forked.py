"""Services started as forks of `grpo run` after it imported torch and transformers once (CPU runs).

Each service process spends its first seconds importing torch and transformers (about 4 s of CPU each); on a small
CPU machine the learner, the generators and the ref server do that at once on the same cores, and the first
learner step waits for it. `grpo run` already imports torch (validating the config loads the estimator
registries), so on a run where every service is on the CPU it imports transformers' model classes too
(:func:`preload`, while the ref server, started fresh, imports beside it) and forks the learner and the generators
from there: they start with both imported and shared copy-on-write.

Forking is safe here because nothing in the launcher has used CUDA, started a thread or run a parallel torch op
when it forks (the console readers start afterwards). Each child (:func:`fork_service`) starts a new session (its
process group is what the launcher signals), reads ``/dev/null`` and writes both output streams to its pipe, takes
the service's environment, sets torch's thread count from ``OMP_NUM_THREADS`` (the OpenMP runtime read the
variable when torch loaded in the launcher), reseeds torch and numpy as a fresh process would be, and runs
``deploy.services.main(argv)`` (the service commands of ``grpo``); it never returns into the launcher's frames: it runs the exit handlers and leaves with
``os._exit``. A GPU service, or a learner of several ranks (torchrun), always starts as a fresh process.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import NoReturn, TextIO

from deploy.services import main as service_main


def preload() -> None:
    """Import what every forked service needs (torch; transformers' model classes without the packages services
    never use, see deploy.startup)."""
    import torch  # noqa: F401

    from deploy.startup import import_model_classes

    import_model_classes()


class ForkedProcess:
    """The part of :class:`subprocess.Popen` the launcher uses, for a child made by :func:`fork_service`."""

    def __init__(self, pid: int, stdout: TextIO, args: list[str]) -> None:
        self.pid, self.stdout, self.args = pid, stdout, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)  # -N when killed by signal N, as Popen
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode


def fork_service(argv: list[str], env: dict[str, str],
                 entry: Callable[[list[str]], int] = service_main) -> ForkedProcess:
    """Fork a child that runs ``grpo ARGV...`` (``entry(argv)``, by default :func:`deploy.services.main`) with
    ``env`` as its environment; its stdout and stderr come back through the returned process's ``stdout`` (text,
    by line)."""
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns

        def own_session_and_pipe() -> None:
            os.setsid()
            os.close(read_fd)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            os.dup2(write_fd, 1)
            os.dup2(write_fd, 2)
            os.close(write_fd)

        exit_as_service(argv, env, entry, own_session_and_pipe)
    os.close(write_fd)
    stdout = os.fdopen(read_fd, "r", buffering=1, encoding="utf-8", errors="replace")
    return ForkedProcess(pid, stdout, ["grpo", *argv])


def exit_as_service(argv: list[str], env: dict[str, str], entry: Callable[[list[str]], int],
                    setup: Callable[[], None]) -> NoReturn:
    """In a forked child: ``setup()`` (its session and streams), then :func:`run_as_service`; leaves with the
    exit status through ``os._exit`` (never into the parent's frames), with a traceback on its stderr if anything
    raised."""
    code = 1
    try:
        setup()
        code = run_as_service(argv, env, entry)
    except BaseException:  # noqa: BLE001 - reported on the service's own output, and the exit status says so
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # the reading end was closed, or the stream was
                pass
        os._exit(code)


def run_as_service(argv: list[str], env: dict[str, str], entry: Callable[[list[str]], int]) -> int:
    """In the child: become the service a fresh ``python -m deploy.cli ARGV`` would be, run it, run the exit
    handlers; the exit status."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    # fresh streams on /dev/null and the pipe (line-buffered), whatever the launcher's were (e.g. a capture)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
    sys.argv = ["grpo", *argv]
    import torch

    if env.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    torch.seed()  # every fork would otherwise draw the launcher's random stream
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    try:
        code = entry(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    atexit._run_exitfuncs()
    return code
