"""The zygote of tests/service_forks.py: one process per pytest worker that imports torch, transformers' model
classes, DeepSpeed and every service module once, then forks a child for each ``grpo ARGV...`` a test starts.

    python tests/service_zygote.py SOCKET_PATH ROOM     (started by tests/service_forks.py; stdin is its lifeline)

ROOM is an argument of spaces: a process title (what ``ps`` shows, set with setproctitle) can only be as long as
the command line the process was started with.

Protocol, on a Unix socket per started service: the client sends one JSON line ``{"argv", "env", "cwd"}`` with the
child's stdin, stdout and stderr as three file descriptors (SCM_RIGHTS). The zygote forks; the child starts a new
session (its process group is its pid, as ``Popen(start_new_session=True)``), takes the three descriptors as 0, 1
and 2, changes to ``cwd`` and runs ``deploy.cli.main(argv)`` as the service would after a fresh start
(``deploy.forked.run_as_service``: environment, streams, signal handlers, torch threads and seeds, exit handlers).
The zygote answers ``{"pid"}`` once the child's session exists, and ``{"returncode"}`` (``-N`` for signal ``N``) on
the same socket when the child exits. When stdin closes (the pytest worker ended), every child still running is
killed with its process group and the zygote exits.

Nothing here starts a thread or runs a torch op before forking (deploy/forked.py says why that matters).
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import socket
import sys

import setproctitle

GRPO = os.path.join(os.path.dirname(sys.executable), "grpo")


def preload() -> None:
    import deepspeed  # noqa: F401
    import torch  # noqa: F401

    from deploy.startup import import_model_classes

    import_model_classes()
    import deploy.cli  # noqa: F401
    import deploy.launcher  # noqa: F401
    import generator.main  # noqa: F401
    import learner.main  # noqa: F401
    import ref_server.scorer_pool.remote  # noqa: F401
    import ref_server.server  # noqa: F401


def read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 16)
        if not more:
            raise ConnectionError("the client left mid-request")
        data += more
    return json.loads(data), fds


def child(request: dict, fds: list[int], ready_fd: int) -> None:
    """In the forked child: never returns."""
    from deploy.cli import main as cli_main
    from deploy.forked import exit_as_service

    def own_session_and_streams() -> None:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        setproctitle.setproctitle(" ".join([GRPO, *request["argv"]]))  # what `ps` shows for a fresh `grpo ...`
        os.write(ready_fd, b"1")
        os.close(ready_fd)

    exit_as_service(request["argv"], request["env"], cli_main, own_session_and_streams)


def serve(path: str, ready_fd: int) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(0, selectors.EVENT_READ, "lifeline")
    children: dict[int, socket.socket] = {}
    os.write(ready_fd, b"ready\n")
    os.close(ready_fd)
    while True:
        for key, _ in selector.select(timeout=0.05):
            if key.data == "lifeline" and not os.read(0, 4096):
                for pid in children:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)  # the client made it; whoever ends first
                return
            if key.data == "accept":
                conn, _ = listener.accept()
                try:
                    request, fds = read_request(conn)
                except (OSError, ValueError) as exc:
                    print(f"service zygote: bad request: {exc!r}", file=sys.stderr, flush=True)
                    conn.close()
                    continue
                ready_r, ready_w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.close(ready_r)
                    listener.close()
                    selector.close()
                    conn.close()
                    for other in children.values():
                        other.close()
                    child(request, fds, ready_w)
                os.close(ready_w)
                for fd in fds:
                    os.close(fd)
                os.read(ready_r, 1)  # the child's session exists (or it died trying: the status will say)
                os.close(ready_r)
                children[pid] = conn
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        reap(children)


def reap(children: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            except OSError:  # the test let go of the process
                pass
            conn.close()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the test run reaches the tests; the lifeline ends us
    sys.path[0] = os.path.dirname(sys.executable)  # what a console script (`grpo`) has first on its path
    ready = os.dup(1)  # "ready" goes to the client alone: what the imports print goes to stderr
    os.dup2(2, 1)
    preload()
    serve(sys.argv[1], ready)
