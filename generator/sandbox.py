"""Running model-written code against tests: a subprocess with a wall-clock limit, CPU/memory/file limits, no
network, an empty working directory and a clean environment.

Isolation, in layers: ``python -I`` (no user site, no PYTHON* variables), a fresh temporary directory, rlimits
(address space, CPU seconds, file size, no core dumps), its own process group (killed whole on timeout), a new
network namespace via ``unshare -rn`` where the kernel allows it, and in every case an audit hook inside the child
that refuses sockets and subprocesses. This contains accidents and runaway code (infinite loops, memory bombs,
``rm -rf`` of the cwd); it is not a boundary against a determined attacker, who can tamper with the runner it
shares an interpreter with. Run untrusted code at scale inside a container or VM.
"""

from __future__ import annotations

import functools
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

_RUNNER = r'''
import json, sys
def _deny(event, args):
    if event.startswith(("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.fork",
                         "pty.", "ctypes.dlopen")):
        raise PermissionError(f"sandbox: {event} is not allowed")
spec = json.load(open(sys.argv[1]))
result_path = sys.argv[2]
sys.addaudithook(_deny)
namespace = {"__name__": "__main__"}
passed, errors = 0, []
try:
    exec(compile(spec["code"], "<solution>", "exec"), namespace)
    solution_error = None
except BaseException as exc:
    solution_error = f"{type(exc).__name__}: {exc}"
for test in spec["tests"]:
    if solution_error is not None:
        break
    try:
        exec(compile(test, "<test>", "exec"), dict(namespace))
        passed += 1
    except BaseException as exc:
        errors.append(f"{type(exc).__name__}: {exc}"[:200])
with open(result_path, "w") as fh:
    json.dump({"passed": passed, "solution_error": solution_error, "errors": errors[:5]}, fh)
'''


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0
    memory_mb: int = 512
    max_file_mb: int = 16
    max_output_bytes: int = 65536


@dataclass
class TestRun:
    passed: int
    total: int
    status: str               # "ok", "timeout", "crashed", "solution_error"
    detail: str
    network_isolation: str    # "netns+audit-hook" or "audit-hook"

    @property
    def fraction_passed(self) -> float:
        return self.passed / self.total if self.total else 0.0


def extract_code(completion: str) -> str:
    """The last fenced code block (```python ... ``` or ``` ... ```), else the whole completion."""
    blocks = re.findall(r"```(?:[a-zA-Z0-9_+-]*)\n(.*?)```", completion, re.DOTALL)
    return blocks[-1] if blocks else completion


@functools.lru_cache(maxsize=1)
def _netns_prefix() -> tuple[str, ...]:
    """``unshare -rn`` if this kernel lets an unprivileged process make a user + network namespace."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    try:
        ok = subprocess.run([unshare, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return (unshare, "-rn") if ok else ()


def _limit(limits: SandboxLimits) -> None:  # runs in the child between fork and exec
    memory = limits.memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    cpu = int(limits.timeout_s) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    size = limits.max_file_mb * 2**20
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_tests(code: str, tests: list[str], limits: SandboxLimits | None = None) -> TestRun:
    """Execute ``code`` then each test statement (e.g. ``assert f(2) == 4``); count the tests that pass."""
    limits = limits or SandboxLimits()
    prefix = _netns_prefix()
    isolation = "netns+audit-hook" if prefix else "audit-hook"
    with tempfile.TemporaryDirectory(prefix="grpo-sandbox-") as workdir:
        spec_path, result_path, runner_path = (os.path.join(workdir, n) for n in ("spec.json", "result.json",
                                                                                  "runner.py"))
        with open(spec_path, "w") as fh:
            json.dump({"code": code, "tests": tests}, fh)
        with open(runner_path, "w") as fh:
            fh.write(_RUNNER)
        command = [*prefix, sys.executable, "-I", runner_path, spec_path, result_path]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(command, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: _limit(limits))
        try:
            output, _ = proc.communicate(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return TestRun(0, len(tests), "timeout", f"killed after {limits.timeout_s}s", isolation)
        tail = output[-limits.max_output_bytes:].decode(errors="replace")
        try:
            with open(result_path) as fh:
                result = json.load(fh)
        except (OSError, json.JSONDecodeError):
            return TestRun(0, len(tests), "crashed", f"exit code {proc.returncode}: {tail[-500:]}", isolation)
    passed = min(int(result.get("passed", 0)), len(tests))
    if result.get("solution_error"):
        return TestRun(0, len(tests), "solution_error", str(result["solution_error"]), isolation)
    return TestRun(passed, len(tests), "ok", "; ".join(result.get("errors", [])), isolation)
