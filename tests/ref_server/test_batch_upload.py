"""POST /v1/rollouts/batch: an engine call's groups in one request, one answer each, nothing half-queued on bad input."""

import pytest
import torch

from shared.protocol.client import HubClient, HubError
from shared.protocol.wire import WireError, decode_messages, encode, encode_messages

from .helpers import group_bytes, make_group

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
def test_a_bad_group_in_a_batch_is_refused_alone_and_the_good_ones_are_queued(server_factory, tiny_model):
    live = server_factory(model=True)
    groups = [make_group(seed=i) for i in range(5)]
    groups[1].completion_ids[0, 0] = tiny_model.config.vocab_size + 5      # outside the model's vocabulary
    messages = [g.to_bytes() for g in groups]
    messages[3], _ = group_bytes("rewards", 1e300, torch.float64, group_id="f64")  # inf in the learner's float32
    messages.insert(2, b"not a group")                                     # not even a message
    response = live.post("/v1/rollouts/batch", data=encode_messages(messages), headers=OCTET)
    assert response.status_code == 200
    answers = response.json()["answers"]
    assert [a["accepted"] for a in answers] == [True, False, False, True, False, True]
    assert [a.get("status") for a in answers] == [None, 422, 400, None, 422, None]
    assert "completion_ids: token ids must be in" in answers[1]["refused"]
    assert answers[4]["refused"] == "rewards[1] = 1e+300 is not a finite float32 (the dtype the learner uses)"
    stats = live.get("/v1/hub/stats").json()
    assert stats["queue_depth"] == 3 and stats["accepted"] == 3 and stats["rejected"] == 3
    batch = HubClient(live.url).get_batch(3, wait_s=20)
    assert batch.group_ids == [groups[i].group_id for i in (0, 2, 4)]     # the good ones, in order
    assert torch.isfinite(batch.rewards).all()
    hot = make_group(seed=7, temperature=0.5)               # another temperature than the hub batches
    answers = HubClient(live.url).upload_groups([make_group(seed=8), hot])
    assert [a["accepted"] for a in answers] == [True, False] and answers[1]["status"] == 422
    assert "temperature 0.5" in answers[1]["refused"]
    with pytest.raises(HubError) as info:                   # a single upload is refused with its status
        HubClient(live.url).upload_group(make_group(seed=9, temperature=0.5))
    assert info.value.status == 422
    assert live.get("/v1/hub/stats").json()["rejected"] == 5
