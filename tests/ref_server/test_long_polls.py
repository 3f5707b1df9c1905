"""Long polls on the real hub (uvicorn on 127.0.0.1): 60 of them waiting at once (45 generators asking a full hub
for budget, 15 learners asking for a batch that is not there) hold threads of their own, so an upload, a lease and
an ack are answered while every one of them is still waiting. In anyio's one shared pool of 40 threads they had
waited for the polls' waits to end."""

from __future__ import annotations

import threading

import pytest
import requests

from shared.protocol.client import HubClient
from tests.live_server import LiveServer, make_config
from tests.ref_server.helpers import make_group

WAIT_S = 10.0


@pytest.mark.slow
def test_an_upload_a_lease_and_an_ack_are_answered_while_60_long_polls_wait(tmp_path):
    with LiveServer(make_config(tmp_path, max_staleness=1, max_long_poll_s=WAIT_S)) as live:
        client = HubClient(live.url)
        client.report_version(5, groups_per_step=1)
        assert client.rollout_budget(0)["wanted"] == 0   # version 0 is past max_staleness: a budget poll waits
        answers: list[int] = []

        def poll(path: str, params: dict) -> None:
            answers.append(requests.get(f"{live.url}{path}", params=params, timeout=60).status_code)

        polls = [threading.Thread(target=poll, args=("/v1/rollouts/budget", {"policy_version": 0, "wait_s": WAIT_S}))
                 for _ in range(45)]
        polls += [threading.Thread(target=poll, args=("/v1/batch", {"num_groups": 64, "timeout": WAIT_S}))
                  for _ in range(15)]
        for thread in polls:
            thread.start()
        # the budget polls hold their threads for their whole wait (the batch polls in slices of 0.5 s)
        while live.state.long_polls.borrowed_tokens < 45:
            threading.Event().wait(0.05)
        client.upload_group(make_group(version=5, seed=1))
        batch = client.get_batch(1)
        assert batch is not None and batch.policy_versions.tolist() == [5] * 4
        client.ack_batches([batch.batch_id])
        still_waiting = sum(thread.is_alive() for thread in polls)
        for thread in polls:
            thread.join(timeout=60)
    assert still_waiting == 60    # the upload, the lease and the ack did not wait for any of them
    assert sorted(answers) == [200] * 45 + [204] * 15    # each poll answered when its wait ended
