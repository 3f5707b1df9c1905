"""A real hub process (uvicorn on 127.0.0.1) and clients that go away or trickle: a long poll whose client left leases
nothing to it, and sockets that never finish their headers do not starve the hub. Bounded in time and count."""

from __future__ import annotations

import socket
import time

import pytest
import requests

from tests.faults.test_delivery_faults import client, hub  # noqa: F401 - fixture
from tests.ref_server.helpers import make_group


@pytest.mark.slow
def test_a_long_poll_whose_client_left_hands_its_groups_to_the_next_consumer_at_once(hub):  # noqa: F811
    h = hub(lease_timeout_s=60.0, max_long_poll_s=30.0)  # an expiring lease would take a minute
    gone = socket.create_connection(("127.0.0.1", h.port), timeout=5)
    gone.sendall(b"GET /v1/batch?num_groups=2&timeout=25 HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.5)  # the hub is long-polling for it now
    gone.close()     # the learner died mid-poll
    time.sleep(0.2)
    groups = [make_group(seed=i) for i in range(2)]
    for group in groups:
        client(h.url).upload_group(group)
    started = time.monotonic()
    batch = client(h.url).get_batch(2, wait_s=5)
    waited = time.monotonic() - started
    assert batch is not None and batch.group_ids == [g.group_id for g in groups]
    assert waited < 3.0, waited  # at once (a slice of the dead poll at most), not after the 60 s lease timeout
    stats = h.stats()
    assert stats["leased_groups"] == 2 and stats["queue_depth"] == 0 and stats["consumed"] == 0


@pytest.mark.slow
def test_sockets_that_trickle_their_headers_are_closed_and_do_not_starve_the_hub(hub):  # noqa: F811
    h = hub(header_timeout_s=2.0)
    tricklers = []
    for _ in range(40):
        sock = socket.create_connection(("127.0.0.1", h.port), timeout=5)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: hub\r\n")
        tricklers.append(sock)
    started = time.monotonic()
    answers = []
    while time.monotonic() - started < 3.5:  # one header byte per socket every 0.25 s: never a whole request
        for sock in tricklers:
            try:
                sock.sendall(b"X")
            except OSError:
                pass  # closed by the hub
        began = time.monotonic()
        assert requests.get(f"{h.url}/healthz", timeout=5).status_code == 200
        answers.append(time.monotonic() - began)
        time.sleep(0.25)
    assert max(answers) < 1.0, answers
    for sock in tricklers:  # each got 408 and was closed at its 2 s deadline (3.5 s have passed)
        sock.settimeout(3)
        received = b""
        try:
            while chunk := sock.recv(4096):
                received += chunk
        except ConnectionResetError:
            pass
        sock.close()
        assert received.startswith(b"HTTP/1.1 408 "), received[:80]
    # an honest keep-alive connection is not cut by the header deadline while it sends whole requests
    with requests.Session() as session:
        for _ in range(3):
            assert session.get(f"{h.url}/healthz", timeout=5).status_code == 200
            time.sleep(1.2)
