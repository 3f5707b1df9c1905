"""Running model-written code against tests so that the policy cannot forge the verdict.

Two ideas (details in docs/reward-hacks.md):

* The verdict is computed here, in the parent, never in the sandboxed process. The sandbox is only asked for
  the values of the solution-dependent parts of each ``assert`` (``f(2)`` in ``assert f(2) == 4``; it never
  sees the ``4``), reported as JSON with exact built-in types on a pipe the parent reads
  (generator/sandbox/verdict.py splits the tests and judges, generator/sandbox/child.py runs in the sandbox).
  There is no verdict file, no ``AssertionError`` to replace, no ``__eq__`` of the policy's that runs.
* The sandbox process is isolated by the kernel where it allows it. Levels, best first (logged once):

  ``namespaces``  new mount, pid, network, IPC and UTS namespaces (plus a user namespace when not root); a
                  fresh root holding read-only binds of the Python installation and shared libraries and a
                  size-capped tmpfs at /sandbox, the host file system detached; uid nobody (when root) or no
                  capabilities; no_new_privs; it is pid 1 of its namespace, so it cannot see or signal us.
  ``nobody``      (root, no namespaces) setuid nobody in a fresh directory.
  ``rlimits``     only what follows.

  Always: ``python -I -S``, a clean environment, rlimits (address space, CPU, file size, no core, process
  count), its own process group killed whole on timeout, the launcher's death killing it, capped output,
  and an audit hook refusing sockets/subprocesses/signals as a last in-process layer.

``GRPO_SANDBOX_ISOLATION=namespaces|nobody|rlimits`` forces a level (an error if it does not work here). As
root, ``rlimits`` is never chosen implicitly: without namespaces or nobody, the sandbox refuses to run.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from generator.sandbox import child
from generator.sandbox.verdict import CompiledTest, LeafError, compile_tests, decode, judge

log = logging.getLogger("grpo.generator.sandbox")

LEVELS = ("namespaces", "nobody", "rlimits")
_DESCRIPTION = {"namespaces": "namespaces(mount,pid,net,ipc,uts{user})+minimal-root+{who}+rlimits+audit-hook",
                "nobody": "uid-nobody+rlimits+audit-hook", "rlimits": "rlimits+audit-hook"}
_LIB_DIRS = ("/lib", "/lib64", "/lib32", "/libx32", "/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32",
             "/etc/ld.so.cache", "/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
STARTUP_GRACE_S = 1.0       # wall time for starting the sandbox (two interpreters, namespaces), on top of timeout_s


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0
    memory_mb: int = 512
    max_file_mb: int = 16
    max_output_bytes: int = 65536          # the solution's own prints: kept for the detail; 16x this kills it
    max_result_bytes: int = 8 * 2**20      # the value channel


@dataclass
class TestRun:
    passed: int
    total: int
    status: str               # "ok", "timeout", "crashed", "solution_error"
    detail: str
    isolation: str            # the isolation level actually used, see the module docstring

    @property
    def fraction_passed(self) -> float:
        return self.passed / self.total if self.total else 0.0

    @property
    def network_isolation(self) -> str:
        """Former name of ``isolation``."""
        return self.isolation


def extract_code(completion: str) -> str:
    """The last fenced code block (```python ... ``` or ``` ... ```), else the whole completion."""
    blocks = re.findall(r"```(?:[a-zA-Z0-9_+-]*)\n(.*?)```", completion, re.DOTALL)
    return blocks[-1] if blocks else completion


def describe(level: str) -> str:
    """The layers a level stands for, as reported in ``TestRun.isolation``."""
    root = os.geteuid() == 0
    return _DESCRIPTION[level].format(user="" if root else ",user", who="nobody" if root else "no-caps")


def _binds() -> list[str]:
    """Host paths the sandbox sees read-only: the interpreter's installation and the shared-library dirs
    (nothing under a path already listed, so a prefix of /usr is bound once)."""
    python = os.path.realpath(sys.executable)
    prefixes = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)}
    if not any(python.startswith(p + os.sep) for p in prefixes):
        prefixes.add(os.path.dirname(python))
    chosen: list[str] = []
    for path in sorted(prefixes | set(_LIB_DIRS)):
        if os.path.lexists(path) and not any(path.startswith(c.rstrip("/") + "/") for c in chosen):
            chosen.append(path)
    return chosen


def _launcher_config(level: str, workdir: str, limits: SandboxLimits) -> dict:
    """What the launcher needs to build ``level`` (see generator/sandbox/child.py's launch)."""
    root = os.geteuid() == 0
    namespaces = level == "namespaces"
    return {"parent_pid": os.getpid(), "namespaces": namespaces, "mount": namespaces,
            "userns": namespaces and not root, "as_nobody": root and level != "rlimits", "root": workdir,
            "binds": _binds(), "work_mb": limits.max_file_mb, "python": os.path.realpath(sys.executable),
            "self": child.__file__, "cwd": "/sandbox" if namespaces else workdir,
            "limits": {"memory": limits.memory_mb * 2**20, "cpu": int(limits.timeout_s) + 1,
                       "fsize": limits.max_file_mb * 2**20}}


def _pump(proc: subprocess.Popen, payload: bytes, limits: SandboxLimits) -> tuple[bytes, bytes, str | None]:
    """Feed stdin, read the value channel (stdout) and the solution's output (stderr) within the deadline,
    never holding more than the caps; returns (values, output tail, problem or None)."""
    deadline = time.monotonic() + limits.timeout_s + STARTUP_GRACE_S
    selector = selectors.DefaultSelector()
    os.set_blocking(proc.stdin.fileno(), False)
    selector.register(proc.stdin, selectors.EVENT_WRITE)
    selector.register(proc.stdout, selectors.EVENT_READ)
    selector.register(proc.stderr, selectors.EVENT_READ)
    values, output, output_total, sent = bytearray(), bytearray(), 0, 0
    while selector.get_map():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return bytes(values), bytes(output), "timeout"
        for key, _ in selector.select(remaining):
            if key.fileobj is proc.stdin:
                try:
                    sent += os.write(proc.stdin.fileno(), payload[sent:sent + 65536])
                except BrokenPipeError:
                    sent = len(payload)
                if sent >= len(payload):
                    selector.unregister(proc.stdin)
                    proc.stdin.close()
                continue
            chunk = os.read(key.fileobj.fileno(), 65536)
            if not chunk:
                selector.unregister(key.fileobj)
            elif key.fileobj is proc.stdout:
                values += chunk
                if len(values) > limits.max_result_bytes:
                    return bytes(values), bytes(output), "values over max_result_bytes"
            else:
                output_total += len(chunk)
                output = (output + chunk)[-limits.max_output_bytes:]
                if output_total > 16 * limits.max_output_bytes:
                    return bytes(values), bytes(output), "output over 16 x max_output_bytes"
    return bytes(values), bytes(output), None


def _execute(level: str, payload: bytes, limits: SandboxLimits) -> tuple[int | None, bytes, bytes, str | None]:
    """One sandboxed run: (exit status or None if killed, values, output tail, problem)."""
    with tempfile.TemporaryDirectory(prefix="grpo-sandbox-") as workdir:
        os.chmod(workdir, 0o755 if level == "namespaces" else 0o700)
        if level == "nobody":
            os.chown(workdir, child.NOBODY, child.NOBODY)
        config = _launcher_config(level, workdir, limits)
        command = [config["python"], "-I", "-S", config["self"], "launch", json.dumps(config)]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        proc = subprocess.Popen(command, cwd=workdir, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        try:
            values, output, problem = _pump(proc, payload, limits)
        finally:
            if proc.poll() is None:
                _kill_group(proc)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                stream.close()
        if problem is None:
            try:
                proc.wait(timeout=max(0.1, limits.timeout_s))
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                problem = "timeout"
    return (None if problem else proc.returncode), values, output, problem


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher's process group (the sandbox dies with the launcher) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _read_values(raw: bytes) -> tuple[dict[int, object], dict[int, str], str | None]:
    """Parse the value channel. Malformed lines are ignored (their values are missing, so their tests fail),
    a leaf reported twice is a failure (the solution can write on this pipe too, but cannot know what to send)."""
    values: dict[int, object] = {}
    test_errors: dict[int, str] = {}
    solution_error = None
    for line in raw.split(b"\n"):
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if type(message) is not dict:
            continue
        leaf, test = message.get("leaf"), message.get("test")
        if type(leaf) is int:
            values[leaf] = LeafError("reported twice") if leaf in values else _leaf_value(message)
        elif type(test) is int:
            test_errors.setdefault(test, str(message.get("err"))[:300])
        elif "solution_error" in message:
            solution_error = str(message["solution_error"])[:300]
    return values, test_errors, solution_error


def _leaf_value(message: dict) -> object:
    """The decoded value, or a LeafError for an exception, a missing value or anything but plain data."""
    if "err" in message or "v" not in message:
        return LeafError(str(message.get("err", "no value"))[:300])
    try:
        return decode(message["v"])
    except (ValueError, TypeError, RecursionError) as exc:
        return LeafError(f"not plain data: {exc}")


def _payload(code: str, compiled: list[CompiledTest]) -> bytes:
    """Two lines for the runner: phase 0 (solution-free leaves), phase 1 (the solution and test steps)."""
    pure = [[leaf, src] for test in compiled for leaf, src in test.pure.items()]
    return (json.dumps({"pure": pure}) + "\n" + json.dumps({"code": code, "tests": [t.steps for t in compiled]})
            + "\n").encode()


def run_tests(code: str, tests: list[str], limits: SandboxLimits | None = None,
              isolation: str | None = None) -> TestRun:
    """Execute ``code`` then each test (e.g. ``assert f(2) == 4``) in the sandbox; count the tests that pass.

    The reward is ``passed / total``. A timeout or an output flood scores 0; a solution that raises while
    loading scores 0; otherwise each test is judged on the values that came back, even if the process then
    crashed. ``isolation`` forces a level (tests); by default the best one this machine allows.
    """
    return _run_tests(code, tests, limits or SandboxLimits(), isolation or isolation_level(), quiet=False)


def _run_tests(code: str, tests: list[str], limits: SandboxLimits, level: str, quiet: bool) -> TestRun:
    """run_tests at a given level; ``quiet`` while probing (a level that cannot start is not an error then)."""
    compiled = compile_tests(code, tests)
    status, raw, output, problem = _execute(level, _payload(code, compiled), limits)
    where, tail = describe(level), output.decode(errors="replace")[-500:]
    if problem:
        return TestRun(0, len(tests), "timeout" if problem == "timeout" else "crashed",
                       f"{problem} (limit {limits.timeout_s}s)" if problem == "timeout" else problem, where)
    values, test_errors, solution_error = _read_values(raw)
    if solution_error:
        return TestRun(0, len(tests), "solution_error", solution_error, where)
    if status == child.SETUP_FAILED and not values:
        (log.debug if quiet else log.error)("the code sandbox could not start (%s): %s", where, tail)
        return TestRun(0, len(tests), "crashed", f"sandbox setup failed: {tail}", where)
    reasons = [judge(test, values, test_errors.get(i)) for i, test in enumerate(compiled)]
    failures = [f"test {i}: {r}" for i, r in enumerate(reasons) if r is not None]
    detail = "; ".join(failures[:5])[:1000] + (f"; exit status {status}: {tail}" if status else "")
    return TestRun(len(tests) - len(failures), len(tests), "ok" if status == 0 else "crashed", detail, where)


def _probe(level: str) -> bool:
    """Does ``level`` work on this machine? A value computed by the solution must come back."""
    run = _run_tests("x = 6 * 7", ["assert x == 42"], SandboxLimits(timeout_s=10), level, quiet=True)
    if run.passed != 1:
        log.info("code sandbox: isolation level %r is not available here (%s)", level, run.detail[:300])
    return run.passed == 1


@functools.lru_cache(maxsize=1)
def isolation_level() -> str:
    """The best isolation level that works here, probed once and logged once (a warning if degraded)."""
    forced = os.environ.get("GRPO_SANDBOX_ISOLATION")
    if forced:
        if forced not in LEVELS or not _probe(forced):
            raise RuntimeError(f"GRPO_SANDBOX_ISOLATION={forced!r} does not work on this machine "
                               f"(choose from {LEVELS})")
        log.info("code sandbox isolation (forced): %s", describe(forced))
        return forced
    for level in LEVELS:
        if level == "rlimits" and os.geteuid() == 0:
            raise RuntimeError("the code sandbox would run model-written code as root with only rlimits and an "
                               "audit hook (no namespaces here, and uid nobody cannot run this interpreter); "
                               "enable user namespaces, install Python where nobody can read it, or accept the "
                               "risk with GRPO_SANDBOX_ISOLATION=rlimits")
        if _probe(level):
            (log.info if level == "namespaces" else log.warning)(
                "code sandbox isolation: %s%s", describe(level),
                "" if level == "namespaces" else " (namespaces unavailable: weaker isolation)")
            return level
    raise RuntimeError("the code sandbox cannot run Python at any isolation level on this machine")
