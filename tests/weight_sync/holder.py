"""Both ends of a weight-sync group as real processes that exit normally, for the test of clean teardown.

``learner URL``: a learner's publisher (rank 0 sender, a small model): prints READY once registered with the hub,
publishes version 1, prints SERVED once the receiver holds it, waits for a line on stdin (the receiver is done),
closes and returns (the interpreter then exits normally).
``receiver URL``: a generator-side GroupReceiver that joins through the hub, receives one version (checking the
values), prints RECEIVED, holds the group until a line on stdin, closes and exits.
Each prints DONE before returning; the test checks exit codes: a group torn down badly ends in std::terminate
(exit status -6) after DONE.
"""

import sys
import time

import torch

from shared.protocol.client import HubClient, RetryPolicy
from shared.protocol.weight_sync_messages import JoinRequest, MemberPoll
from shared.weight_sync.group_receiver import GroupReceiver

CFG = dict(transport="collective", bucket_mb=0.001, timeout_s=10.0, join_timeout_s=20.0, poll_s=0.05)


def client(url: str) -> HubClient:
    return HubClient(url, retry=RetryPolicy(max_retry_s=10, initial_backoff_s=0.05, max_backoff_s=0.2))


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 8))


def learner(url: str) -> None:
    from shared.config.schema import WeightSyncConfig
    from shared.weight_sync.publisher import WeightPublisher

    publisher = WeightPublisher(model(), lambda: client(url), WeightSyncConfig(**CFG), rank=0, world=1,
                                device=torch.device("cpu"), relay_version=None)
    print("READY", flush=True)  # registered with the hub: a receiver may join now
    try:
        deadline = time.monotonic() + 30
        while publisher.sender.counters.members < 1:
            if time.monotonic() > deadline:
                sys.exit("learner: no member within 30 s")
            time.sleep(0.02)
        publisher.publish(1)
        # idle is not served: on a loaded machine the member's ask for version 1 can come after the sender went
        # idle, and closing then leaves the receiver waiting on a group that is gone
        deadline = time.monotonic() + 30
        while publisher.sender.counters.served < 1 or not publisher.sender.wait_idle(0.1):
            if time.monotonic() > deadline:
                sys.exit("learner: version 1 not served within 30 s")
            time.sleep(0.02)
        print("SERVED", flush=True)
        sys.stdin.readline()  # the receiver took the whole version (its completion step too) and holds the group
    finally:
        publisher.close()
    print("DONE", publisher.sender.counters.published, flush=True)


def receiver(url: str) -> None:
    hub = client(url)
    member = hub.sync_join(JoinRequest(generator_id="holder", transport="collective", workers=1))
    group_receiver, version, received = None, None, {}
    expected = dict(model().named_parameters())
    deadline = time.monotonic() + 30
    try:
        while version is None:
            if time.monotonic() > deadline:
                sys.exit("receiver: nothing received within 30 s")
            answer = hub.sync_poll(member, MemberPoll(version=0, wait_s=0.5))
            if answer.action == "connect" and group_receiver is None:
                group_receiver = GroupReceiver(answer.offer.model_dump(mode="json"), 1, torch.device("cpu"))
            elif answer.action == "receive" and group_receiver is not None:
                version = group_receiver.receive(lambda tensors: received.update((n, t.clone()) for n, t in tensors))
                for name, param in expected.items():
                    if not torch.equal(received[name], param.detach()):
                        sys.exit(f"receiver: {name} differs from the learner's")
        print("RECEIVED", version, flush=True)
        sys.stdin.readline()  # hold the group (like a generator between versions) until told to close
        hub.sync_leave(member)
    finally:
        if group_receiver is not None:
            group_receiver.close()
        hub.close()
    print("DONE", version, flush=True)


if __name__ == "__main__":
    {"learner": learner, "receiver": receiver}[sys.argv[1]](sys.argv[2])
