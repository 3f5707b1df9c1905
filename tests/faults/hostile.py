"""Hostile HTTP clients for the chaos run: each kind sends a bounded number of bad requests to a live hub and records
every status it got back (a request that met a dead hub records nothing: the chaos run kills it on purpose)."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from collections.abc import Callable

import requests
import torch
from safetensors.torch import save

from tests.ref_server.helpers import make_group
from tests.ref_server.test_step_rewards_hub import bad_groups

OCTET = {"Content-Type": "application/octet-stream"}
JSON = {"Content-Type": "application/json"}


def _raw(port: int, head: bytes, body_parts: list[bytes], pause_s: float = 0.0, read: bool = True,
         timeout_s: float = 15.0) -> int | None:
    """Send ``head`` then the parts (``pause_s`` apart) on a raw socket; the answer's status, None if closed first."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(head)
        for part in body_parts:
            time.sleep(pause_s)
            sock.sendall(part)
        if not read:
            return None  # the client goes away mid-body
        first = sock.recv(4096).split(b"\r\n", 1)[0].split()
        return int(first[1]) if len(first) >= 2 and first[1].isdigit() else None


def _head(path: str, length: int, kind: str = "application/json") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: hub\r\nContent-Type: {kind}\r\nContent-Length: {length}\r\n\r\n"
            .encode())


def attacks(url: str, port: int, rng: random.Random) -> dict[str, Callable[[], int | None]]:
    """Each named attack: one request, its status."""
    def post(path, data, headers=JSON):
        return requests.post(f"{url}{path}", data=data, headers=headers, timeout=15).status_code

    def junk():
        return post("/v1/rollouts", rng.randbytes(rng.randint(1, 4096)), OCTET)

    def truncated_group():
        data = make_group(seed=rng.randint(0, 10**6)).to_bytes()
        return post("/v1/rollouts", data[:rng.randint(1, len(data) - 1)], OCTET)

    def oversized():  # a JSON route's body over its limit, declared honestly
        return post("/v1/batch/ack", b'{"batch_ids": ["' + b"a" * 3_000_000 + b'"]}')

    def nan_literals():
        path, body = rng.choice([("/v1/batch/ack", b'{"batch_ids": NaN}'), ("/v1/learner/version", b'{"version": NaN}'),
                                 ("/v1/batch/renew", b'{"batch_ids": [], "trained": Infinity}')])
        return post(path, body)

    def deep_json():
        depth = rng.choice([1000, 100_000])
        return post("/v1/batch/release", b'{"batch_ids": ' + b"[" * depth + b"]" * depth + b"}")

    def slow_body():  # 10 bytes of 1000, then silence: the hub's body deadline answers 408
        return _raw(port, _head("/v1/batch/ack", 1000), [b'{"batch_id', b's": ["x", '], pause_s=0.3)

    def mid_body_disconnect():
        return _raw(port, _head("/v1/rollouts", 50_000, OCTET), [rng.randbytes(100)], read=False)

    def bad_version():
        version = rng.choice([2**53 - 1, 10**6, -1, "7", 1.5, None])
        return post("/v1/learner/version", json.dumps({"version": version}))

    def wrong_layout_weights():
        blob = save({"not.a.layer": torch.zeros(3, 3)})
        return requests.put(f"{url}/v1/weights/{rng.randint(1, 3)}", data=blob, headers=OCTET, timeout=15).status_code

    def bad_step_rewards():
        return post("/v1/rollouts", rng.choice(bad_groups())[0], OCTET)

    return {f.__name__: f for f in (junk, truncated_group, oversized, nan_literals, deep_json, slow_body,
                                    mid_body_disconnect, bad_version, wrong_layout_weights, bad_step_rewards)}


class HostileClients(threading.Thread):
    """Every attack ``rounds`` times in a seeded random order, while ``go`` is set (the chaos run clears it to
    quiesce the hub before a kill); ``statuses``: (attack, status) of every answer received."""

    def __init__(self, url: str, port: int, seed: int, rounds: int, go: threading.Event,
                 done: threading.Event) -> None:
        super().__init__(daemon=True, name="hostile")
        self.rng = random.Random(seed)
        self.plan = [name for name in attacks(url, port, self.rng) for _ in range(rounds)]
        self.rng.shuffle(self.plan)
        self.url, self.port, self.go, self.done = url, port, go, done
        self.statuses: list[tuple[str, int]] = []
        self.unanswered = 0

    def run(self) -> None:
        kinds = attacks(self.url, self.port, self.rng)
        for name in self.plan:
            if self.done.is_set():
                return
            self.go.wait()
            try:
                status = kinds[name]()
            except (requests.RequestException, OSError):
                status = None  # the hub was down or killed mid-request
            if status is None:
                self.unanswered += 1
            else:
                self.statuses.append((name, status))
            time.sleep(self.rng.uniform(0.05, 0.4))
