"""The simulated clients of bench/hub_capacity.py: generators (threads in forked processes) that upload engine
calls' groups in binary ``POST /v1/rollouts/batch`` requests, and a learner that leases, decodes and acknowledges
batches and reports new versions (:class:`shared.protocol.client.HubClient`).

Each generator encodes its group once per learner version and only stamps a fresh group id into the bytes per
upload, so the clients cost little CPU (a saturated client could not measure the hub); their CPU is measured and
reported by the bench.
"""

from __future__ import annotations

import threading
import time
import uuid

import requests
import torch

from shared.protocol.client import HubClient
from shared.protocol.records import RolloutGroup
from shared.protocol.wire import encode_messages

ID_PLACEHOLDER = "f" * 32  # a group id's width (uuid hex): stamped over with a fresh id per upload


def make_group(args, version: int, generator_id: str) -> bytes:
    rng = torch.Generator().manual_seed(hash(generator_id) % 2**31)
    g, length = args.group_size, args.completion_len
    return RolloutGroup(  # every completion full length: G x L completion tokens per group
        prompt_ids=torch.randint(3, 30000, (args.prompt_len,), generator=rng),
        completion_ids=torch.randint(3, 30000, (g, length), generator=rng),
        completion_lengths=torch.full((g,), length, dtype=torch.long),
        behaviour_logprobs=-torch.rand(g, length, generator=rng) * 3, rewards=torch.rand(g, generator=rng),
        finish_reasons=["length"] * g, policy_version=version,
        generator_id=generator_id, group_id=ID_PLACEHOLDER).to_bytes()


def generator_thread(args, url: str, index: int, stop: threading.Event, measure: threading.Event,
                     out: list, version_box: list) -> None:
    session = requests.Session()
    generator_id = f"gen-{index}"
    version, template = -1, b""
    interval = args.groups_per_upload / args.rate if args.rate > 0 else 0.0
    next_at = time.monotonic() + (index % 97) / 97 * interval  # spread the generators' phases
    while not stop.is_set():
        if version != version_box[0]:
            version = version_box[0]
            template = make_group(args, version, generator_id)
        if interval:
            pause = next_at - time.monotonic()
            if pause > 0 and stop.wait(pause):
                break
            next_at = max(next_at + interval, time.monotonic() - interval)  # a late generator does not burst
        body = encode_messages([template.replace(ID_PLACEHOLDER.encode(), uuid.uuid4().hex.encode(), 1)
                                for _ in range(args.groups_per_upload)])
        start = time.monotonic()
        try:
            response = session.post(url + "/v1/rollouts/batch", data=body, timeout=60,
                                    headers={"Content-Type": "application/octet-stream"})
        except requests.RequestException:
            out.append(("error", start, time.monotonic() - start, 0))
            continue
        took = time.monotonic() - start
        if response.status_code != 200:
            out.append((f"http {response.status_code}", start, took, 0))
            stop.wait(float(response.headers.get("Retry-After", "0.1")))
            continue
        answer = response.json()
        accepted = sum(1 for a in answer["answers"] if a.get("accepted") and not a.get("duplicate"))
        if measure.is_set():
            out.append(("ok", start, took, accepted))
        if answer["answers"]:
            version_box[0] = max(version_box[0], int(answer["answers"][-1]["learner_version"]))


def client_process(args, url: str, indices: list[int], ready, go, end, queue) -> None:
    """Generators ``indices`` as threads; their uploads between ``go`` and ``end`` are measured."""
    stop, measure, out, version_box = threading.Event(), threading.Event(), [], [0]
    threads = [threading.Thread(target=generator_thread, args=(args, url, i, stop, measure, out, version_box),
                                daemon=True) for i in indices]
    for t in threads:
        t.start()
    ready.release()
    go.wait()
    cpu0, wall0 = time.process_time(), time.monotonic()
    measure.set()
    end.wait()
    measure.clear()
    cpu = (time.process_time() - cpu0) / max(time.monotonic() - wall0, 1e-9)
    stop.set()
    for t in threads:
        t.join(timeout=70)
    queue.put({"uploads": [o for o in out if o[1] >= wall0], "cpu": cpu})


# -- the learner, in the bench's process --------------------------------------------------------------------
def learner_thread(args, url: str, stop: threading.Event, measure: threading.Event, out: dict) -> None:
    client = HubClient(url, timeout_s=60)
    client.register_learner(0, groups_per_step=args.groups_per_step)
    version, since_step = 0, 0
    while not stop.is_set():
        start = time.monotonic()
        batch = client.get_batch(args.batch_groups, wait_s=0.5, min_version=max(0, version - args.max_staleness))
        if batch is None:
            continue
        took = time.monotonic() - start
        groups = batch.num_groups
        client.ack_batches([batch.batch_id])
        out["taken"] += groups
        if measure.is_set():
            out["latency"].append(took)
            out["taken_measured"] += groups
            out["tokens_measured"] += int(batch.completion_lengths.sum())
        since_step += groups
        if since_step >= args.groups_per_step:
            since_step = 0
            version += 1
            client.report_version(version)
    client.close()
