"""Fault injection against real processes on 127.0.0.1: every group the hub accepted is trained on exactly once.

The hub is a real ``grpo ref-server`` process (killed with SIGKILL and restarted on its spool), the consumer is the
learner's own delivery code (:class:`learner.delivery.DeliveryLedger` over a real :class:`HubClient`), and the
learner itself is a real ``grpo learner`` process where it is the one killed. Every loop is bounded in count and
time.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from learner.delivery import DeliveryLedger
from shared.protocol.client import HubClient, HubError, RetryPolicy
from shared.protocol.health import wait_healthy
from tests import service_forks as forks
from tests.ref_server.helpers import make_group

GRPO = str(Path(sys.executable).parent / "grpo")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Hub:
    """A ``grpo ref-server`` process (beta 0: the hub alone) that can be SIGKILLed and restarted on its spool."""

    def __init__(self, tmp_path: Path, lease_timeout_s: float = 2.0, **ref_server) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = tmp_path / "hub.yaml"
        self.config.write_text(json.dumps({
            "algorithm": {"loss": {"beta": 0.0}},
            "ref_server": {"port": self.port, "spool_dir": str(tmp_path / "spool"),
                           "weights_dir": str(tmp_path / "relay"), "lease_timeout_s": lease_timeout_s,
                           "max_long_poll_s": 5.0, **ref_server}}))
        self.log = open(tmp_path / "hub.log", "a")
        self.proc: subprocess.Popen | None = None

    def start(self) -> Hub:
        self.proc = forks.popen([GRPO, "ref-server", "--config", str(self.config)], env=ENV,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_healthy(self.url, 60, process=self.proc, poll_s=0.1, request_timeout_s=1)
        return self

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        self.log.close()

    def stats(self) -> dict:
        return requests.get(f"{self.url}/v1/hub/stats", timeout=10).json()


@pytest.fixture
def hub(tmp_path):
    hubs = []

    def start(**kw) -> Hub:
        hubs.append(Hub(tmp_path, **kw).start())
        return hubs[-1]

    yield start
    for h in hubs:
        h.stop()


def client(url: str) -> HubClient:
    return HubClient(url, timeout_s=10, retry=RetryPolicy(max_retry_s=60, initial_backoff_s=0.05, max_backoff_s=0.5))


class Consumer(threading.Thread):
    """The learner's delivery path without the model: lease, drop what was trained, 'train', acknowledge."""

    def __init__(self, url: str, groups_per_batch: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.client = client(url)
        self.ledger = DeliveryLedger(self.client, ack_on_checkpoint=False, lease_timeout_s=2.0)
        self.trained: list[str] = []
        self.groups_per_batch, self.stop = groups_per_batch, stop
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                batch = self.client.get_batch(self.groups_per_batch, wait_s=0.5)
                if batch is None or (batch := self.ledger.fresh_part(batch)) is None:
                    continue
                self.trained += batch.group_ids
                self.ledger.trained(batch)
        except BaseException as exc:  # noqa: BLE001 - handed to the test, which fails with it
            self.error = exc


def upload_all(url: str, groups, accepted: list[str], poisoned: list[int]) -> None:
    """Upload ``groups`` in order (retrying through hub restarts); note the accepted ids and the refused ones."""
    uploader = client(url)
    for i, group in enumerate(groups):
        try:
            if uploader.upload_group(group)["accepted"]:
                accepted.append(group.group_id)
        except HubError as exc:
            assert exc.status in (400, 422), exc
            poisoned.append(i)


@pytest.mark.slow
def test_hub_killed_during_uploads_and_batches_loses_and_duplicates_nothing(hub):
    h = hub(queue_capacity=64)
    stop = threading.Event()
    consumer = Consumer(h.url, groups_per_batch=2, stop=stop)
    consumer.start()
    accepted: list[str] = []
    poisoned: list[int] = []
    # two generators (one stops half way: churn), with poisoned groups among the good ones
    streams = [[make_group(seed=100 * g + i, generator_id=f"gen-{g}",
                           temperature=0.7 if i % 9 == 4 else 1.0) for i in range(n)]
               for g, n in ((0, 40), (1, 20))]
    uploaders = [threading.Thread(target=upload_all, args=(h.url, s, accepted, poisoned)) for s in streams]
    for t in uploaders:
        t.start()
    for _ in range(3):  # kill -9 while uploads and batches are in flight, restart on the same spool
        time.sleep(1.0)
        h.kill()
        time.sleep(0.3)
        h.start()
    for t in uploaders:
        t.join(timeout=180)
        assert not t.is_alive()
    deadline = time.monotonic() + 60
    while sorted(consumer.trained) != sorted(accepted) and time.monotonic() < deadline and consumer.error is None:
        time.sleep(0.2)
    stop.set()
    consumer.join(timeout=30)
    assert consumer.error is None, consumer.error
    expected_poison = sum(1 for s in streams for i, g in enumerate(s) if g.sampling.temperature != 1.0)
    assert len(poisoned) == expected_poison and len(accepted) == 60 - expected_poison
    assert len(consumer.trained) == len(set(consumer.trained)), "a group was trained twice"
    assert sorted(consumer.trained) == sorted(accepted), "an accepted group was lost"
    stats = h.stats()
    assert stats["queue_depth"] == 0 and stats["leased_groups"] == 0


@pytest.mark.slow
def test_a_consumer_killed_during_a_long_poll_loses_nothing(hub, tmp_path):
    """A learner that received a batch and died before acknowledging it: the lease expires, the groups return."""
    h = hub(lease_timeout_s=1.5)
    script = ("import sys, time; from shared.protocol.client import HubClient; "
              "b = HubClient(sys.argv[1]).get_batch(4, wait_s=20); print(b.batch_id, flush=True); time.sleep(60)")
    taker = subprocess.Popen([sys.executable, "-c", script, h.url], stdout=subprocess.PIPE, text=True, env=ENV,
                             cwd=Path(__file__).resolve().parents[2])
    time.sleep(1.0)  # it is long-polling now
    groups = [make_group(seed=i) for i in range(4)]
    for group in groups:
        client(h.url).upload_group(group)
    assert len(taker.stdout.readline().split()) == 1  # it got the batch ...
    taker.send_signal(signal.SIGKILL)  # ... and dies without acknowledging it
    taker.wait(timeout=10)
    again = client(h.url).get_batch(4, wait_s=10)
    assert again is not None and again.group_ids == [g.group_id for g in groups]
    assert h.stats()["lease_expired"] == 4


@pytest.mark.slow
def test_hub_killed_during_a_long_poll_hands_out_the_batch_after_restart(hub):
    h = hub()
    result: dict = {}

    def poll():
        result["batch"] = client(h.url).get_batch(2, wait_s=4)

    groups = [make_group(seed=i) for i in range(2)]
    client(h.url).upload_group(groups[0])
    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.5)
    h.kill()  # the long-poll's connection breaks: the client retries
    h.start()
    client(h.url).upload_group(groups[1])
    poller.join(timeout=60)
    batch = result.get("batch")
    if batch is None:  # the retried poll may have timed out on an empty queue: ask once more
        batch = client(h.url).get_batch(2, wait_s=5)
    assert batch.group_ids == [g.group_id for g in groups]


def _learner_config(tmp_path: Path, hub_url: str, model_dir, max_steps: int) -> Path:
    path = tmp_path / f"learner-{max_steps}.yaml"
    path.write_text(json.dumps({"algorithm": {"loss": {"beta": 0.0}}, "learner": {
        "model": str(model_dir), "hub_url": hub_url, "groups_per_step": 2, "max_steps": max_steps, "lr": 1e-3,
        "checkpoint_every": 2, "checkpoint_dir": str(tmp_path / "ckpt"), "output_dir": str(tmp_path / "final"),
        "metrics_jsonl": str(tmp_path / "metrics.jsonl"), "tensorboard_dir": None, "batch_wait_s": 1.0,
        "retry_max_s": 60}}))
    return path


@pytest.mark.slow
def test_learner_killed_and_resumed_trains_each_group_exactly_once(hub, tmp_path, tiny_model_dir):
    """Checkpoints every 2 steps: the learner is SIGKILLed after step 3 (that batch was trained on but no checkpoint
    holds it, so it was not acknowledged); the resumed learner starts from the step-2 checkpoint, gets the batch
    again when its lease expires, and every one of the 12 groups ends in the final lineage exactly once."""
    h = hub(lease_timeout_s=3.0, max_staleness=1000)  # the groups are all version 0: never stale here
    groups = [make_group(seed=i) for i in range(12)]
    uploader = client(h.url)
    for group in groups[:6]:  # three steps' worth: the learner then waits for more, and is killed there
        uploader.upload_group(group)
    log = open(tmp_path / "learner.log", "w")
    first = forks.popen([GRPO, "learner", "--config", str(_learner_config(tmp_path, h.url, tiny_model_dir, 6))],
                             env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) == 3):
        assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "learner.log").read_text()[-3000:]
        time.sleep(0.1)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    steps_before = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    checkpointed = int(sorted((tmp_path / "ckpt").glob("step*/COMPLETE"))[-1].parent.name[4:])
    assert steps_before == [1, 2, 3] and checkpointed == 2
    for group in groups[6:]:
        uploader.upload_group(group)
    resumed = forks.run([GRPO, "learner", "--resume", "--config",
                              str(_learner_config(tmp_path, h.url, tiny_model_dir, 6))],
                             env=ENV, stdout=log, stderr=subprocess.STDOUT, timeout=300)
    log.close()
    assert resumed.returncode == 0, (tmp_path / "learner.log").read_text()[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    after = records[len(steps_before):]
    assert [r["step"] for r in after] == [3, 4, 5, 6]  # resumed from the step-2 checkpoint
    # the step-2 checkpoint's acknowledgement may not have reached the hub before the SIGKILL (it follows the
    # checkpoint): those leases then expire and come back, and the ledger drops them as duplicates of what the
    # checkpoint holds. Nothing else may come back twice; exactly-once is the lineage's check below.
    assert sum(r["duplicate_groups"] for r in after) <= 4, [r["duplicate_groups"] for r in after]
    final = sorted((tmp_path / "ckpt").glob("step*/COMPLETE"))[-1].parent
    trained = [g for p in final.glob("consumed-rank*.json") for g in json.loads(p.read_text())]
    assert len(trained) == len(set(trained)) == 12 and set(trained) == {g.group_id for g in groups}
    stats = h.stats()
    assert stats["consumed"] == 12 and stats["queue_depth"] == 0 and stats["leased_groups"] == 0
    assert stats["lease_expired"] >= 2  # the killed learner's unacknowledged batches came back


def test_client_retries_a_response_cut_after_its_headers():
    """A server that sends the headers and half the body, then closes; the next answer is whole."""
    body = json.dumps({"version": 7}).encode()
    answers = [b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
               % (len(body), body[:5]),
               b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n"
               b"\r\n%s" % (len(body), body)]
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(20)
    served = []

    def serve():
        for answer in answers:
            conn, _ = server.accept()
            conn.recv(65536)
            conn.sendall(answer)
            conn.close()
            served.append(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        version = client(f"http://127.0.0.1:{server.getsockname()[1]}").weights_version()
    finally:
        thread.join(timeout=20)
        server.close()
    assert version == 7 and len(served) == 2
