import threading
import time

import pytest
import torch

from ref_server.hub.rollout_hub import RolloutHub
from shared.protocol.client import HubClient, HubError
from shared.protocol.records import RolloutGroup, TrainBatch

from .helpers import make_group

OCTET = {"Content-Type": "application/octet-stream"}


def upload(live, group):
    return live.post("/v1/rollouts", data=group.to_bytes(), headers=OCTET)


def test_group_round_trips_through_safetensors():
    group = make_group(version=3)
    back = RolloutGroup.from_bytes(group.to_bytes())
    assert back.group_id == group.group_id and back.policy_version == 3
    assert torch.equal(back.completion_ids, group.completion_ids)
    assert torch.equal(back.reward_components["correct"], group.rewards)
    assert back.finish_reasons == group.finish_reasons and back.sampling == group.sampling


@pytest.mark.slow
def test_batch_carries_reference_logprobs_equal_to_direct_scoring(server_factory):
    live = server_factory(model=True)
    groups = [make_group(seed=i, rewards=[0.0, 1.0, 1.0, 0.0]) for i in range(2)]
    for group in groups:
        answer = upload(live, group)
        assert answer.status_code == 200 and answer.json()["accepted"] is True
    client = HubClient(live.url)
    batch = client.get_batch(2, wait_s=10)
    assert isinstance(batch, TrainBatch) and batch.batch_size == 8
    assert batch.group_ids == [g.group_id for g in groups]
    assert batch.rewards.tolist() == [0.0, 1.0, 1.0, 0.0] * 2 and batch.group_index.tolist() == [0] * 4 + [1] * 4
    # reference logprobs equal a direct call of the logprob endpoint on the same rows
    prompt = groups[0].prompt_ids.tolist()
    rows = [prompt + groups[0].completion_ids[i, :n].tolist() for i, n in enumerate(groups[0].completion_lengths)]
    direct = client.logprobs(rows, [len(prompt)] * 4)
    for i, n in enumerate(groups[0].completion_lengths.tolist()):
        torch.testing.assert_close(batch.ref_logprobs[i, :n], torch.tensor(direct[i]), atol=1e-5, rtol=0)
        assert torch.equal(batch.input_ids[i, 3:3 + n], groups[0].completion_ids[i, :n])
    assert batch.truncated.tolist() == [False, False, False, True] * 2
    assert live.get("/healthz").json()["queue_depth"] == 0
    assert client.ack_batches([batch.batch_id]) == {batch.batch_id: "acked"}


@pytest.mark.slow
def test_queue_is_bounded_fifo_with_depth_and_retry_after(server_factory):
    live = server_factory(model=False, queue_capacity=3)
    groups = [make_group(seed=i) for i in range(4)]
    depths = [upload(live, g).json()["queue_depth"] for g in groups[:3]]
    assert depths == [1, 2, 3]
    full = upload(live, groups[3])
    assert full.status_code == 429 and full.headers["Retry-After"] == "1"
    assert "full" in full.json()["detail"] and full.headers["X-Queue-Depth"] == "3"
    batch = HubClient(live.url).get_batch(2)
    assert batch.group_ids == [groups[0].group_id, groups[1].group_id]  # FIFO
    assert batch.ref_logprobs is None  # beta = 0 mode
    assert upload(live, groups[3]).status_code == 200
    stats = live.get("/v1/hub/stats").json()
    assert stats["rejected_full"] == 1 and stats["accepted"] == 4 and stats["leased_groups"] == 2
    HubClient(live.url).ack_batches([batch.batch_id])
    assert live.get("/v1/hub/stats").json()["consumed"] == 2


@pytest.mark.slow
def test_duplicate_upload_is_acknowledged_once(server_factory):
    live = server_factory(model=False)
    group = make_group()
    assert upload(live, group).json()["queue_depth"] == 1
    again = upload(live, group).json()
    assert again["duplicate"] is True and again["queue_depth"] == 1


@pytest.mark.slow
def test_staleness_drops_are_counted(server_factory):
    live = server_factory(model=False, max_staleness=1)
    live.post("/v1/learner/version", json={"version": 1})
    for version in (0, 1):
        upload(live, make_group(version=version, seed=version))
    report = live.post("/v1/learner/version", json={"version": 3}).json()
    assert report["dropped_stale"] == 2 and report["queue_depth"] == 0  # versions 0 and 1 are > 1 behind
    for version in (2, 3):
        upload(live, make_group(version=version, seed=version))
    late = upload(live, make_group(version=1, seed=9)).json()
    assert late["accepted"] is False and late["dropped"] == "stale"
    stats = live.get("/v1/hub/stats").json()
    assert stats["dropped_stale"] == 2 and stats["refused_stale"] == 1
    batch = HubClient(live.url).get_batch(2)
    assert batch.policy_versions.tolist() == [2] * 4 + [3] * 4
    going_back = live.post("/v1/learner/version", json={"version": 2})
    assert going_back.status_code == 409 and "older" in going_back.json()["detail"]


@pytest.mark.slow
def test_empty_queue_answers_204_fast_and_long_poll_wakes_up(server_factory):
    live = server_factory(model=False)
    client = HubClient(live.url)
    started = time.monotonic()
    assert client.get_batch(1) is None
    assert time.monotonic() - started < 2.0
    group = make_group()
    threading.Timer(0.5, lambda: upload(live, group)).start()
    started = time.monotonic()
    batch = client.get_batch(1, wait_s=10)
    assert batch is not None and batch.group_ids == [group.group_id]
    assert time.monotonic() - started < 8.0


@pytest.mark.slow
def test_spooled_groups_survive_a_restart_in_order(server_factory, tmp_path):
    first = server_factory(model=False, path=tmp_path)
    groups = [make_group(seed=i) for i in range(3)]
    for group in groups:
        upload(first, group)
    client = HubClient(first.url)
    client.ack_batches([client.get_batch(1).batch_id])  # consumes groups[0]; its spool file is removed
    first.__exit__(None, None, None)
    (tmp_path / "spool" / "000000000099-garbage.group").write_bytes(b"not a group")
    second = server_factory(model=False, path=tmp_path)
    stats = second.get("/v1/hub/stats").json()
    assert stats["spool_reloaded"] == 2 and stats["spool_corrupt"] == 1
    third_group = make_group(seed=7)
    upload(second, third_group)
    batch = HubClient(second.url).get_batch(3)
    assert batch.group_ids == [groups[1].group_id, groups[2].group_id, third_group.group_id]
    assert (tmp_path / "spool" / "corrupt" / "000000000099-garbage.group").exists()


@pytest.mark.slow
def test_spool_reload_recomputes_reference_logprobs(server_factory, tmp_path):
    first = server_factory(model=True, path=tmp_path)
    upload(first, make_group(seed=5))
    first.__exit__(None, None, None)
    second = server_factory(model=True, path=tmp_path)
    batch = HubClient(second.url).get_batch(1, wait_s=10)
    assert batch.ref_logprobs is not None and (batch.ref_logprobs[0, :3] < 0).all()


@pytest.mark.slow
def test_bad_uploads(server_factory, tiny_model):
    live = server_factory(model=True)
    assert upload(live, make_group()).status_code == 200
    garbage = live.post("/v1/rollouts", data=b"garbage-bytes-here", headers=OCTET)
    assert garbage.status_code == 400 and "safetensors" in garbage.json()["detail"]
    bad_ids = make_group()
    bad_ids.completion_ids[0, 0] = tiny_model.config.vocab_size + 5
    response = upload(live, bad_ids)
    assert response.status_code == 422 and "token ids must be in" in response.json()["detail"]
    with pytest.raises(HubError) as info:
        HubClient(live.url).upload_group(bad_ids)
    assert info.value.status == 422


def test_hub_unit_drops_group_when_reference_scoring_fails():
    class FailingScorer:
        def submit(self, rows, temperature):
            from concurrent.futures import Future
            future = Future()
            future.set_exception(RuntimeError("model exploded"))
            return future

    hub = RolloutHub(capacity=4, max_staleness=2, scorer=FailingScorer())
    hub.put(make_group().to_bytes())
    assert hub.depth() == 0 and hub.counters.dropped_ref_failure == 1
