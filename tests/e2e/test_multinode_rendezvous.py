"""The learner's rendezvous check (learner.engine.check_rendezvous): where several ranks cannot meet, the error
names MASTER_ADDR:MASTER_PORT within learner.rendezvous_timeout_s instead of torch's 30-minute wait; a real
TCPStore that comes up late is waited for, and the probe leaves it working for the ranks' own clients."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from learner.engine import LearnerSetupError, check_rendezvous


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@pytest.fixture
def ranks(monkeypatch):
    def world(rank: int, address: str, port: int | str, size: int = 2) -> None:
        monkeypatch.setenv("WORLD_SIZE", str(size))
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("MASTER_ADDR", address)
        monkeypatch.setenv("MASTER_PORT", str(port))
    return world


def test_a_rank_whose_master_never_answers_fails_naming_the_address_in_time(ranks):
    port = free_port("127.0.0.9")  # nothing listens there
    ranks(1, "127.0.0.9", port)
    started = time.monotonic()
    with pytest.raises(LearnerSetupError, match=rf"rank 1: no learner rendezvous at .* 127\.0\.0\.9:{port} after "
                       r"0\.6s \(learner\.rendezvous_timeout_s"):
        check_rendezvous(0.6, poll_s=0.1)
    assert 0.6 <= time.monotonic() - started < 3


def test_a_rank_waits_for_a_late_master_and_the_store_still_serves_its_ranks(ranks):
    port = free_port("127.0.0.3")
    ranks(1, "127.0.0.3", port)
    stores = []
    late = threading.Timer(0.5, lambda: stores.append(
        TCPStore("127.0.0.3", port, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))))
    late.start()
    started = time.monotonic()
    check_rendezvous(10, poll_s=0.1)
    assert 0.4 < time.monotonic() - started < 5
    late.join()
    client = TCPStore("127.0.0.3", port, 2, is_master=False, timeout=timedelta(seconds=10))
    client.set("k", "v")
    assert stores[0].get("k") == b"v"


def test_rank_zero_refuses_a_master_address_that_is_not_its_own(ranks):
    ranks(0, "192.0.2.1", 29500)  # TEST-NET-1: never an address of this machine
    with pytest.raises(LearnerSetupError, match="MASTER_ADDR 192.0.2.1, which is not an address of this node"):
        check_rendezvous(5)
    ranks(0, "127.0.0.4", 29500)  # a loopback "node" address is this machine's
    check_rendezvous(5)


def test_missing_or_bad_master_settings_are_named_and_one_rank_needs_none(ranks, monkeypatch):
    ranks(1, "127.0.0.2", "not-a-port")
    with pytest.raises(LearnerSetupError, match="MASTER_ADDR/MASTER_PORT are '127.0.0.2'/'not-a-port'"):
        check_rendezvous(5)
    ranks(0, "", 1, size=1)
    check_rendezvous(5)  # a world of one: nothing to meet
