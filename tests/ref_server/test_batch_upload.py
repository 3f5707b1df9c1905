"""POST /v1/rollouts/batch: an engine call's groups in one request, one answer each, nothing half-queued on bad input."""

import pytest
import torch

from shared.protocol.client import HubClient, HubError
from shared.protocol.wire import WireError, decode_messages, encode, encode_messages

from .helpers import make_group

OCTET = {"Content-Type": "application/octet-stream"}


def test_the_container_round_trips_and_refuses_what_it_does_not_hold():
    messages = [make_group(seed=i).to_bytes() for i in range(3)]
    assert decode_messages(encode_messages(messages), max_count=3) == messages
    assert decode_messages(encode_messages([]), max_count=3) == []
    with pytest.raises(WireError, match="at most 2"):
        decode_messages(encode_messages(messages), max_count=2)
    gap = encode("rollout_groups/v1", {"message/0": torch.zeros(3, dtype=torch.uint8),
                                       "message/2": torch.zeros(3, dtype=torch.uint8)}, {"count": 2})
    with pytest.raises(WireError, match="message/0 .. message/N-1"):
        decode_messages(gap, max_count=8)
    floats = encode("rollout_groups/v1", {"message/0": torch.zeros(3)}, {"count": 1})
    with pytest.raises(WireError, match="U8"):
        decode_messages(floats, max_count=8)
    with pytest.raises(WireError, match="expected a 'rollout_groups/v1'"):
        decode_messages(messages[0], max_count=8)


@pytest.mark.slow
def test_a_batch_upload_queues_every_group_in_order_with_one_answer_each(server_factory):
    live = server_factory(model=False)
    client = HubClient(live.url)
    groups = [make_group(seed=i) for i in range(5)]
    answers = client.upload_groups(groups[:3])
    assert [a["accepted"] for a in answers] == [True, True, True]
    assert [a["queue_depth"] for a in answers] == [1, 2, 3]
    again = client.upload_groups(groups[2:])                 # a retry that overlaps: the known one is a duplicate
    assert [a.get("duplicate", False) for a in again] == [True, False, False]
    batch = client.get_batch(5)
    assert batch.group_ids == [g.group_id for g in groups]   # FIFO, the order of the requests
    stats = live.get("/v1/hub/stats").json()
    assert stats["accepted"] == 5 and stats["duplicates"] == 1


@pytest.mark.slow
def test_a_bad_group_in_a_batch_queues_none_and_names_the_group(server_factory, tiny_model):
    live = server_factory(model=True)
    groups = [make_group(seed=i) for i in range(3)]
    groups[1].completion_ids[0, 0] = tiny_model.config.vocab_size + 5
    response = live.post("/v1/rollouts/batch", data=encode_messages([g.to_bytes() for g in groups]), headers=OCTET)
    assert response.status_code == 422
    assert "group 1 of 3 (none queued)" in response.json()["detail"]
    assert "token ids must be in" in response.json()["detail"]
    assert live.get("/v1/hub/stats").json()["queue_depth"] == 0
    hot = make_group(seed=7, temperature=0.5)               # another temperature than the hub batches
    with pytest.raises(HubError) as info:
        HubClient(live.url).upload_groups([make_group(seed=8), hot])
    assert info.value.status == 422 and "group 1 of 2" in str(info.value.detail)
    assert live.get("/v1/hub/stats").json()["queue_depth"] == 0
    garbage = live.post("/v1/rollouts/batch", data=b"not a container", headers=OCTET)
    assert garbage.status_code == 400


@pytest.mark.slow
def test_a_full_queue_takes_the_groups_that_fit_and_a_retry_finishes(server_factory):
    live = server_factory(model=False, queue_capacity=3)
    client = HubClient(live.url)
    groups = [make_group(seed=i) for i in range(5)]
    body = encode_messages([g.to_bytes() for g in groups])
    full = live.post("/v1/rollouts/batch", data=body, headers=OCTET)
    assert full.status_code == 429 and full.headers["Retry-After"] == "1"
    assert live.get("/v1/hub/stats").json()["queue_depth"] == 3   # the first three are queued
    client.ack_batches([client.get_batch(3).batch_id])
    retry = live.post("/v1/rollouts/batch", data=body, headers=OCTET).json()["answers"]
    assert [a.get("duplicate", False) for a in retry] == [True, True, True, False, False]
    assert client.get_batch(2).group_ids == [groups[3].group_id, groups[4].group_id]


@pytest.mark.slow
def test_the_client_falls_back_to_one_request_per_group_on_an_older_hub(server_factory, monkeypatch):
    live = server_factory(model=False)
    client = HubClient(live.url)
    paths = []
    original = client._request

    def older_hub(method, path, **kwargs):
        paths.append(path)
        if path == "/v1/rollouts/batch":
            raise HubError(404, "Not Found", live.url + path)
        return original(method, path, **kwargs)

    monkeypatch.setattr(client, "_request", older_hub)
    answers = client.upload_groups([make_group(seed=i) for i in range(2)])
    assert [a["accepted"] for a in answers] == [True, True]
    client.upload_groups([make_group(seed=5)])
    assert paths == ["/v1/rollouts/batch", "/v1/rollouts", "/v1/rollouts", "/v1/rollouts"]  # asked once
