"""A TCP port a service is about to serve on: bound at once (failing with who holds it), or checked free.

The ref server binds its port before it loads a model or says "ready" (:func:`bind_port`), and ``grpo run`` checks
the port before any service starts (:func:`port_problem`): a port held by a leftover hub or another program is one
line naming the process on it, found in ``/proc`` (Linux; elsewhere the line just says the port is in use).
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from shared.errors import UsageError

__all__ = ["bind_port", "hold_port", "listening_inodes", "port_owner", "port_problem", "release_port"]

_LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp


def listening_inodes(port: int, proc: Path = Path("/proc")) -> set[str]:
    """Socket inodes listening on ``port`` (any address, IPv4 or IPv6), from ``/proc/net/tcp{,6}``."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def port_owner(port: int, proc: Path = Path("/proc")) -> str | None:
    """``"pid N (command line)"`` of a process listening on ``port``; None when none is found (not Linux, or the
    process belongs to another user whose file descriptors cannot be read)."""
    targets = {f"socket:[{inode}]" for inode in listening_inodes(port, proc)}
    if not targets:
        return None
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit():
            continue
        if _holds(pid_dir / "fd", targets):
            try:
                command = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                command = "?"
            return f"pid {pid_dir.name} ({command[:120]})"
    return None


def _holds(fd_dir: Path, targets: set[str]) -> bool:
    """Whether a process's ``fd`` folder holds one of the sockets ``targets``."""
    try:
        fds = list(fd_dir.iterdir())
    except OSError:  # another user's process, or one that exited meanwhile
        return False
    for fd in fds:
        try:
            if os.readlink(fd) in targets:
                return True
        except OSError:  # closed since the listing (the listing's own descriptor, for this process)
            continue
    return False


def _address(host: str, port: int) -> tuple[int, tuple]:
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise OSError(errno.EADDRNOTAVAIL, f"cannot resolve {host!r}: {exc.strerror}") from None
    return family, address


def bind_port(host: str, port: int, key: str) -> socket.socket:
    """A socket bound (not yet listening) to ``host:port``, as uvicorn binds it (SO_REUSEADDR, so a closed
    connection in TIME_WAIT does not block it). A port already taken is a UsageError naming ``key`` and, where it
    can be found, the process holding the port."""
    try:
        family, address = _address(host, port)
    except OSError as exc:
        raise UsageError(f"{key}: cannot bind {host}:{port}: {exc.strerror or exc}") from None
    try:
        return _reusable_bound(family, address)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            owner = port_owner(port)
            held = f"held by {owner}" if owner else "in use by another process"
            raise UsageError(f"{key}: port {port} on {host} is {held}; stop it or choose another port "
                             f"(--set {key}=N)") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise UsageError(f"{key}: {host} is not an address of this machine, cannot bind port {port}") from None
        raise UsageError(f"{key}: cannot bind {host}:{port}: {exc.strerror or exc}") from None


def _reusable_bound(family: int, address: tuple) -> socket.socket:
    """A stream socket with SO_REUSEADDR bound to ``address`` (closed again when the bind fails: OSError)."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def hold_port(host: str, port: int) -> socket.socket | None:
    """Keep ``host:port`` from every other program's ephemeral ports while the service that will serve on it
    starts: a socket bound with SO_REUSEADDR and never listening. The service's own bind (SO_REUSEADDR, as
    :func:`bind_port` and uvicorn set it) and its listen still succeed beside it, but a ``bind(0)`` elsewhere (the
    learner's process-group and weight-sync stores, started at the same moment by ``grpo run``) never gets this
    port, which it otherwise can between the launcher's check and the service's bind. Close it once the service
    listens. None when it cannot be bound (the service's own bind then says why)."""
    try:
        return _reusable_bound(*_address(host, port))
    except OSError:
        return None


def release_port(held: socket.socket | None) -> None:
    """Let go of a port :func:`hold_port` held (None: it held nothing); closing twice is harmless."""
    if held is not None:
        held.close()


def port_problem(host: str, port: int, key: str) -> str | None:
    """Why ``host:port`` cannot be served on now (one line naming ``key``), or None when it is free."""
    try:
        bind_port(host, port, key).close()
    except UsageError as exc:
        return str(exc)
    return None


def is_loopback(host: str) -> bool:
    """``host`` reaches only this machine: localhost, 127.0.0.0/8 or ::1 (a name other than localhost is not)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def token_problem(host: str, token: str | None, key: str = "ref_server.host") -> str | None:
    """A hub bound beyond loopback takes weights and rollouts from whoever reaches it: it needs a token. The
    problem as one line, or None."""
    if token or is_loopback(host):
        return None
    return (f"{key}: {host!r} is reachable from other machines and no token is set: anyone who reaches it could "
            "upload weights and rollouts; set GRPO_TOKEN (or ref_server.token), or bind 127.0.0.1")
