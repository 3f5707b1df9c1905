"""The ref server binds its port before it loads a model or logs "ready": a port in use fails at once, naming the
process that holds it (ref_server/server.py serve, shared/ports.py)."""

from __future__ import annotations

import logging
import os
import socket

import pytest

from ref_server.server import serve
from shared.config.schema import GRPOConfig
from shared.errors import UsageError
from shared.ports import bind_port, hold_port, port_owner


def test_a_port_in_use_fails_before_the_model_loads_and_before_ready(tmp_path, caplog):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        # a missing reference model: had the model loaded first, this would be the error
        config = GRPOConfig.model_validate({"algorithm": {"loss": {"beta": 0.04}}, "ref_server": {
            "port": port, "model": str(tmp_path / "no-model"), "spool_dir": str(tmp_path / "spool"),
            "weights_dir": str(tmp_path / "w")}})
        with caplog.at_level(logging.INFO), pytest.raises(UsageError) as info:
            serve(config)
    assert str(info.value).startswith(f"ref_server.port: port {port} on 127.0.0.1 is held by pid {os.getpid()} (")
    assert "ready" not in caplog.text
    assert not (tmp_path / "spool").exists()   # no hub state was created either


def test_bind_port_names_a_foreign_address_and_frees_the_port_on_close():
    with pytest.raises(UsageError, match=r"^k: 192\.0\.2\.1 is not an address of this machine"):
        bind_port("192.0.2.1", 8470, "k")   # TEST-NET-1: never local
    sock = bind_port("127.0.0.1", 0, "k")
    port = sock.getsockname()[1]
    assert port_owner(port) is None      # bound, not yet listening: nobody serves it yet
    sock.listen()
    assert port_owner(port).startswith(f"pid {os.getpid()} (")
    sock.close()
    bind_port("127.0.0.1", port, "k").close()


def test_a_held_port_is_left_to_its_service_and_kept_from_everyone_elses_ephemeral_ports():
    """``grpo run`` holds the hub's port while the services start (shared/ports.py hold_port): the ref server's own
    bind and listen succeed beside the hold, a plain bind of that port is refused, and no ``bind(0)`` (how the
    learner's stores pick their ports) is given it, over as many tries as the ephemeral range has ports."""
    held = hold_port("127.0.0.1", 0)
    port = held.getsockname()[1]
    try:
        service = bind_port("127.0.0.1", port, "ref_server.port")
        service.listen()
        service.close()
        with socket.socket() as plain, pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
        low, high = (int(v) for v in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
        for _ in range(high - low + 1):
            with socket.socket() as other:
                other.bind(("127.0.0.1", 0))
                assert other.getsockname()[1] != port
    finally:
        held.close()
    with socket.socket() as plain:  # released: anyone may have it again
        plain.bind(("127.0.0.1", port))
