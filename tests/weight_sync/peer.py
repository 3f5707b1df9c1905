"""A generator's weight-sync receiver as its own process, for the test that kills one mid-transfer.

It joins through the hub, connects to the learner's group (the real GroupReceiver), waits until the hub says a
version is ready for it, asks for it, takes the version header, prints RECEIVING and then stops taking buckets: a receiver
stuck half-way, which the test then kills with SIGKILL.
"""

import sys
import time

import torch

from shared.protocol.client import HubClient, RetryPolicy
from shared.protocol.weight_sync_messages import JoinRequest, MemberPoll
from shared.weight_sync import groups
from shared.weight_sync.group_receiver import GroupReceiver


def main(url: str) -> None:
    client = HubClient(url, retry=RetryPolicy(max_retry_s=10))
    member = client.sync_join(JoinRequest(generator_id="peer", transport="collective", workers=1))
    receiver = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        answer = client.sync_poll(member, MemberPoll(version=0, wait_s=1.0))
        if answer.action == "connect" and receiver is None:
            receiver = GroupReceiver(answer.offer.model_dump(mode="json"), 1, torch.device("cpu"))
            print("CONNECTED", flush=True)
        elif answer.action == "receive" and receiver is not None:
            receiver._ask()  # as GroupReceiver.receive does: the learner's link serves receivers that asked
            header = torch.zeros(groups.HEADER_LEN, dtype=torch.int64)
            groups.broadcast(receiver.group, header, receiver.timeout_s)
            print("RECEIVING", groups.VersionHeader.from_tensor(header).version, flush=True)
            time.sleep(600)
    sys.exit("peer: nothing to receive within 60 s")


if __name__ == "__main__":
    main(sys.argv[1])
