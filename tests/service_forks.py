"""``grpo`` services for tests, forked from a zygote that imported torch, transformers and DeepSpeed once.

A fresh ``grpo learner`` spends ~10 s of CPU importing torch, transformers and DeepSpeed before its first line of
its own work, a generator or ref server ~5 s; the suite starts ~150 of them, which was most of its CPU. ``popen``
and ``run`` here take the arguments of :class:`subprocess.Popen` and :func:`subprocess.run` (the part the tests use)
and, for a ``[GRPO, ...]`` command, fork the service from this worker's zygote (tests/service_zygote.py) instead:
a real process of its own (own pid and session, its own stdin/stdout/stderr, signals, exit status as ``Popen``
reports it) that runs ``grpo ARGV...`` exactly as a fresh one would after its imports, as ``grpo run`` forks its
CPU services (deploy/forked.py); ``ps`` shows its ``grpo ...`` command line (setproctitle). What differs from a
fresh start: the imports already happened (so a test of import-time behaviour or start-up cost starts a real
subprocess), and the process is the zygote's child, not the test's.

Anything else (another program, stdin=PIPE, an environment that changes what the imports read) and
``GRPO_TEST_FORK=0`` (every command a fresh subprocess) go to :mod:`subprocess` unchanged.
"""

from __future__ import annotations

import atexit
import json
import locale
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GRPO = str(Path(sys.executable).parent / "grpo")
ZYGOTE = Path(__file__).with_name("service_zygote.py")
START_TIMEOUT_S = 300.0
TITLE_ROOM = 4096  # characters of command line a forked service can show in ps (see service_zygote.py)
# read when the zygote imports torch, transformers and DeepSpeed: a child asking for other values starts fresh
IMPORT_TIME_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "LD_PRELOAD", "LD_LIBRARY_PATH",
                   "CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR", "HF_HOME", "TRANSFORMERS_CACHE", "HF_HUB_OFFLINE",
                   "TRANSFORMERS_OFFLINE", "TORCH_HOME", "MKL_NUM_THREADS")


class Zygote:
    """This process's zygote, started on first use; it ends (killing what it forked) when this process does."""

    _instance: Zygote | None = None

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="grpo-zygote-")
        self.path = os.path.join(self.folder, "socket")
        self.env = dict(os.environ)
        self.owner = os.getpid()
        self.proc = subprocess.Popen([sys.executable, str(ZYGOTE), self.path, " " * TITLE_ROOM], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=self.env)
        with selectors.DefaultSelector() as ready:
            ready.register(self.proc.stdout, selectors.EVENT_READ)
            started = ready.select(timeout=START_TIMEOUT_S) and self.proc.stdout.readline() == b"ready\n"
        if not started:
            self.proc.kill()
            raise RuntimeError(f"the service zygote did not start (status {self.proc.poll()})")
        atexit.register(self.close)

    @classmethod
    def get(cls) -> Zygote:
        if cls._instance is None or cls._instance.owner != os.getpid() or cls._instance.proc.poll() is not None:
            cls._instance = cls()
        return cls._instance

    def fork(self, argv: list[str], env: dict[str, str], cwd: str, fds: list[int]) -> tuple[int, socket.socket]:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        message = json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode() + b"\n"
        socket.send_fds(conn, [message], fds)
        reply = _read_line(conn, START_TIMEOUT_S)
        return json.loads(reply)["pid"], conn

    def compatible(self, env: dict[str, str]) -> bool:
        return all(env.get(key) == self.env.get(key) for key in IMPORT_TIME_ENV)

    def close(self) -> None:
        if os.getpid() != self.owner:  # a fork of the test process (tests that fork) exiting: not ours to end
            return
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the lifeline: the zygote kills what is left and exits
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


def _read_line(conn: socket.socket, timeout: float | None) -> bytes:
    data = b""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not data.endswith(b"\n"):
        remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        conn.settimeout(remaining)
        chunk = conn.recv(4096)
        if not chunk:
            raise RuntimeError("the service zygote closed the connection (did it die?)")
        data += chunk
    return data


class ForkedService:
    """The part of :class:`subprocess.Popen` the tests use, for a service forked by the zygote."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket, stdout, stderr) -> None:
        self.args, self.pid, self._conn = args, pid, conn
        self.stdin, self.stdout, self.stderr = None, stdout, stderr
        self.returncode: int | None = None
        self._chunks: dict[object, list] = {}

    def poll(self) -> int | None:
        self._exited(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def _exited(self, timeout: float | None) -> bool:
        """Whether the child has exited, waiting up to ``timeout`` s for the zygote to say so (sets returncode)."""
        if self.returncode is None:
            with selectors.DefaultSelector() as selector:
                selector.register(self._conn, selectors.EVENT_READ)
                if not selector.select(timeout=timeout):
                    return False
            self.returncode = json.loads(_read_line(self._conn, 60))["returncode"]
            self._conn.close()
        return True

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input=None, timeout: float | None = None):  # noqa: A002 - Popen's name
        """Read stdout and stderr (those that are pipes) to their end, then wait; as Popen's."""
        if input is not None:
            raise ValueError("a forked service has no stdin pipe")
        deadline = None if timeout is None else time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            for stream in (self.stdout, self.stderr):
                if stream is not None and not stream.closed:
                    self._chunks.setdefault(stream, [])
                    selector.register(stream.fileno(), selectors.EVENT_READ, stream)
            while selector.get_map():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                for key, _ in selector.select(timeout=remaining):
                    chunk = os.read(key.fd, 1 << 16)
                    if chunk:
                        self._chunks[key.data].append(chunk)
                    else:
                        selector.unregister(key.fd)
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0.001))
        outputs = []
        for stream in (self.stdout, self.stderr):
            if stream is None:
                outputs.append(None)
                continue
            data = b"".join(self._chunks.get(stream, []))
            outputs.append(data.decode(stream.encoding, stream.errors) if hasattr(stream, "encoding") else data)
            stream.close()
        return tuple(outputs)

    def __enter__(self) -> ForkedService:
        return self

    def __exit__(self, *exc) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


def _forkable(args, env: dict[str, str], stdin) -> bool:
    return (os.environ.get("GRPO_TEST_FORK", "1") != "0" and len(args) > 1 and str(args[0]) == GRPO
            and stdin in (None, subprocess.DEVNULL) and Zygote.get().compatible(env))


def popen(args, *, stdin=None, stdout=None, stderr=None, text=None, encoding=None, errors=None, env=None,
          cwd=None, start_new_session=False, **kw):
    """``subprocess.Popen(args, ...)``, or a :class:`ForkedService` for a ``[GRPO, ...]`` command (always in a
    session of its own, as with ``start_new_session=True``)."""
    env = dict(os.environ if env is None else env)
    if kw or not _forkable(args, env, stdin):
        return subprocess.Popen(args, stdin=stdin, stdout=stdout, stderr=stderr, text=text, encoding=encoding,
                                errors=errors, env=env, cwd=cwd, start_new_session=start_new_session, **kw)
    text_mode = bool(text or encoding or errors)
    opened: list[int] = []   # descriptors to close here once the zygote has its copies

    def target(spec, default: int) -> tuple[int, object]:
        if spec is None:
            return default, None
        if spec == subprocess.DEVNULL:
            fd = os.open(os.devnull, os.O_RDWR)
            opened.append(fd)
            return fd, None
        if spec == subprocess.PIPE:
            read_fd, write_fd = os.pipe()
            opened.append(write_fd)
            if text_mode:
                return write_fd, open(read_fd, encoding=encoding or locale.getpreferredencoding(False),  # noqa: SIM115
                                      errors=errors or "strict")
            return write_fd, open(read_fd, "rb")  # noqa: SIM115
        return (spec if isinstance(spec, int) else spec.fileno()), None

    null_in = os.open(os.devnull, os.O_RDONLY)
    opened.append(null_in)
    out_fd, out_stream = target(stdout, 1)
    if stderr == subprocess.STDOUT:
        err_fd, err_stream = out_fd, None
    else:
        err_fd, err_stream = target(stderr, 2)
    try:
        pid, conn = Zygote.get().fork([str(a) for a in args[1:]], env, str(cwd or os.getcwd()),
                                      [null_in, out_fd, err_fd])
    finally:
        for fd in opened:
            os.close(fd)
    return ForkedService([str(a) for a in args], pid, conn, out_stream, err_stream)


def run(args, *, capture_output=False, timeout=None, check=False, stdout=None, stderr=None, text=None,
        encoding=None, errors=None, env=None, cwd=None, **kw) -> subprocess.CompletedProcess:
    """``subprocess.run(args, ...)``, the command forked as :func:`popen` does when it can."""
    if "input" in kw:
        return subprocess.run(args, capture_output=capture_output, timeout=timeout, check=check, stdout=stdout,
                              stderr=stderr, text=text, encoding=encoding, errors=errors, env=env, cwd=cwd, **kw)
    if capture_output:
        stdout = stderr = subprocess.PIPE
    proc = popen(args, stdout=stdout, stderr=stderr, text=text, encoding=encoding, errors=errors, env=env, cwd=cwd,
                 **kw)
    with proc:  # a Popen or a ForkedService: both close their pipes and wait on leaving
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    if check and proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, args, out, err)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)
