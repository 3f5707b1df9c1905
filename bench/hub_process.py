"""The hub under test of bench/hub_capacity.py: the real app (as ``grpo ref-server`` builds it, without a model) in
a child process, its stages timed from inside (:class:`StageClock`, answered at ``GET /bench/stages``), and the
``/proc`` readers of its CPU and context switches. The simulated clients are bench/hub_load.py.

The child is this file run as a script (:class:`HubProcess` starts it)::

    python bench/hub_process.py PORT_FILE --capacity N --max-staleness N [--spool-dir DIR] [--hub-cores C ...]
        [--ungated]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from shared.protocol.health import wait_healthy  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")  # /proc/<pid>/stat counts CPU time in these


class StageClock:
    """Per stage, summed over the hub's threads: wall seconds (they include waiting for the GIL and the disk), CPU
    seconds of the calling thread (``time.thread_time``: the stage's own work, whatever the machine's load) and
    calls."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seconds: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, owner, name: str, stage: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                spent, used = time.perf_counter() - start, time.thread_time() - cpu
                with self.lock:
                    self.seconds[stage] = self.seconds.get(stage, 0.0) + spent
                    self.cpu[stage] = self.cpu.get(stage, 0.0) + used
                    self.calls[stage] = self.calls.get(stage, 0) + 1

        setattr(owner, name, timed)

    def snapshot(self) -> dict:
        with self.lock:
            return {stage: {"s": round(s, 4), "cpu_s": round(self.cpu[stage], 4), "calls": self.calls[stage]}
                    for stage, s in self.seconds.items()}


# Stages that contain others (not added to them): the whole upload and the whole lease, on the worker threads.
UPLOAD_TOTAL, LEASE_TOTAL = "= upload (put_many, all of it)", "= lease (take, all of it)"
UPLOAD_STAGES = ("group decode+validate", "spool write+fsync", "spool rename", "row layout", "container decode")
LEASE_STAGES = ("batch assembly", "batch serialisation", "ack (+ spool unlink)")


def serve_hub(port_file: str, spool_dir: str | None, capacity: int, max_staleness: int, ungated: bool = False,
              cores: list[int] | None = None) -> None:
    """The real app (as ``grpo ref-server`` builds it, without a model) with stage clocks; ``GET /bench/stages``
    answers them. Writes its port to ``port_file`` once bound."""
    import socket

    import uvicorn

    from ref_server import http as _http  # noqa: F401  (the app's modules, imported before they are patched)
    from ref_server.app import create_app
    from ref_server.cpu_cores import pin_process
    from ref_server.header_deadline import header_deadline_protocol
    from ref_server.hub import leases, routes
    from ref_server.hub.intake import Intake
    from ref_server.hub.spool import RolloutSpool
    from ref_server.server import build_state
    from shared.config.schema import GRPOConfig
    from shared.protocol.records import TrainBatch

    clock = StageClock()
    clock.wrap(routes, "decode_messages", "container decode")
    clock.wrap(Intake, "_decode", "group decode+validate")
    clock.wrap(Intake, "_spool_write", "spool write+fsync")
    clock.wrap(RolloutSpool, "commit", "spool rename")
    clock.wrap(Intake, "_mark_ready", "row layout")
    clock.wrap(leases, "assemble_batch", "batch assembly")
    clock.wrap(TrainBatch, "to_bytes", "batch serialisation")
    clock.wrap(leases.Leases, "ack", "ack (+ spool unlink)")
    clock.wrap(Intake, "put_many", UPLOAD_TOTAL)
    clock.wrap(leases.Leases, "take", LEASE_TOTAL)
    config = GRPOConfig.model_validate({
        "algorithm": {"loss": {"beta": 0.0}},
        "ref_server": {"model": None, "spool_dir": spool_dir, "queue_capacity": capacity,
                       "max_staleness": max_staleness, "max_long_poll_s": 5.0, "cpu_cores": cores},
    })
    pin_process(config.ref_server.cpu_cores)  # as `grpo ref-server` does, before uvicorn starts its threads
    state = build_state(config)
    if ungated:  # the comparison: uploads decode and lay out rows in parallel (the hub before its CPU gate)
        state.hub.intake.cpu_gate = None
    app = create_app(state)

    @app.get("/bench/stages", include_in_schema=False)
    def stages() -> dict:
        return {"stages": clock.snapshot(), "python_threads": [t.native_id for t in threading.enumerate()]}

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    Path(port_file + ".tmp").write_text(str(sock.getsockname()[1]))
    os.replace(port_file + ".tmp", port_file)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2,
                                           http=header_deadline_protocol(10.0)))
    signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
    server.run(sockets=[sock])


class HubProcess:
    def __init__(self, spool_dir: str | None, capacity: int, max_staleness: int, cores: list[int] | None = None,
                 ungated: bool = False) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="hubcap-")
        port_file = os.path.join(self.tmp.name, "port")
        args = [sys.executable, __file__, port_file, "--capacity", str(capacity),
                "--max-staleness", str(max_staleness)] + (["--spool-dir", spool_dir] if spool_dir else []) + (
                    ["--hub-cores", *map(str, cores)] if cores else []) + (["--ungated"] if ungated else [])
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(args, env=env)
        deadline = time.monotonic() + 60
        while not os.path.exists(port_file):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the hub did not start")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{Path(port_file).read_text()}"
        wait_healthy(self.url, timeout_s=60)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.tmp.cleanup()


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of ``pid`` by thread id (``/proc/<pid>/task/<tid>/schedstat``: nanoseconds on
    the CPU, not 10 ms ticks); the main (event-loop) thread is ``pid``."""
    seconds = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            seconds[tid] = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9
        except OSError:
            continue  # a thread that ended
    return seconds


def context_switches(pid: int) -> int:
    """Voluntary + involuntary context switches of ``pid``'s live threads (``/proc/<pid>/task/<tid>/status``): a
    thread waiting for the GIL, the disk or a lock switches out voluntarily, so their rate shows contention."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
                if "ctxt_switches:" in line:
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


def process_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15])  # utime stime cutime cstime


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="the hub under test of bench/hub_capacity.py (its child process)")
    p.add_argument("port_file", help="where the hub writes its port once bound")
    p.add_argument("--capacity", type=int, required=True, help="ref_server.queue_capacity")
    p.add_argument("--max-staleness", type=int, required=True)
    p.add_argument("--spool-dir")
    p.add_argument("--hub-cores", type=int, nargs="+", help="ref_server.cpu_cores")
    p.add_argument("--ungated", action="store_true", help="switch off the hub's CPU gate")
    args = p.parse_args(argv)
    serve_hub(args.port_file, args.spool_dir, args.capacity, args.max_staleness, args.ungated, args.hub_cores)
    return 0


if __name__ == "__main__":
    sys.exit(main())
