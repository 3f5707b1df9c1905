"""Step rewards through the hub (issue 23 item 1): uploads (single and batch), a bad step refused alone with a 422
naming it, leased batches with the steps at their batch rows, and the spool keeping them across a restart."""

from dataclasses import replace

import pytest
import torch

from ref_server.hub.batching import GroupRows, assemble_batch
from ref_server.hub.rollout_hub import RolloutHub
from shared.protocol.client import HubClient
from shared.protocol.records import RolloutGroup, TrainBatch
from shared.protocol.wire import decode, encode, encode_messages

from .helpers import make_group

pytestmark = pytest.mark.slow  # every test here uploads to a live uvicorn server

OCTET = {"Content-Type": "application/octet-stream"}
STEP_FIELDS = ("step_rewards", "step_index", "step_end")


def with_steps(steps, seed=0, lengths=(3, 1, 4, 2)) -> RolloutGroup:
    """A make_group group with ``steps[i]`` = completion i's (end, reward) pairs, None: outcome-only."""
    group = make_group(seed=seed, lengths=lengths, group_size=len(lengths))
    if steps is None:
        return group
    built = RolloutGroup.from_samples(
        prompt_ids=[1], completion_ids=[[5] * n for n in lengths], behaviour_logprobs=[[-1.0] * n for n in lengths],
        rewards=[0.0] * len(lengths), finish_reasons=["stop"] * len(lengths), policy_version=0, generator_id="g",
        steps=steps)
    return replace(group, step_rewards=built.step_rewards, step_index=built.step_index, step_end=built.step_end)


A = [[(0, 1.0), (2, 0.5)], [], [(3, -1.0)], [(0, 0.25), (1, 0.75)]]
B = [[], [(0, 2.0)], [], []]


def expected(groups):
    """The batch's step fields by hand: each group's steps, step_index shifted by the rows before the group."""
    rewards, index, ends, offset = [], [], [], 0
    for g in groups:
        if g.step_rewards is not None:
            rewards += g.step_rewards.tolist()
            index += [i + offset for i in g.step_index.tolist()]
            ends += g.step_end.tolist()
        offset += g.group_size
    return rewards, index, ends


def steps_of(batch: TrainBatch):
    return batch.step_rewards.tolist(), batch.step_index.tolist(), batch.step_end.tolist()


def test_uploaded_steps_reach_the_leased_batch_at_their_rows(server_factory):
    live = server_factory(model=False)
    client = HubClient(live.url)
    groups = [with_steps(A, seed=0), with_steps(None, seed=1), with_steps(B, seed=2),
              with_steps([[], [], [], []], seed=3)]
    assert client.upload_group(groups[0])["accepted"]
    assert [a["accepted"] for a in client.upload_groups(groups[1:])] == [True, True, True]
    batch = client.get_batch(4)
    assert batch.group_ids == [g.group_id for g in groups]
    assert steps_of(batch) == expected(groups)
    assert steps_of(batch) == ([1.0, 0.5, -1.0, 0.25, 0.75, 2.0], [0, 0, 2, 3, 3, 9], [0, 2, 3, 0, 1, 0])
    assert batch.step_rewards.dtype == torch.float32 and batch.step_index.dtype == torch.int64
    assert (batch.step_end < batch.completion_lengths[batch.step_index]).all()


def test_a_batch_of_outcome_only_groups_leases_without_step_fields(server_factory):
    live = server_factory(model=False)
    client = HubClient(live.url)
    client.upload_groups([with_steps(None, seed=i) for i in range(2)])
    batch = client.get_batch(2)
    assert batch.step_rewards is None and batch.step_index is None and batch.step_end is None


def bad_groups():
    """(group bytes, what the 422 must name): each refused on its own."""
    beyond = replace(with_steps(A), step_end=torch.tensor([0, 2, 4, 0, 1]))          # completion 2 has 4 tokens
    unsorted = replace(with_steps(A), step_end=torch.tensor([2, 0, 3, 0, 1]))
    row = replace(with_steps(A), step_index=torch.tensor([0, 0, 2, 3, 4]))
    nan = replace(with_steps(A), step_rewards=torch.tensor([1.0, float("nan"), 0.0, 0.0, 0.0]))
    tensors, fields = decode(with_steps(A).to_bytes(), "rollout_group/v1")
    tensors["step_rewards"] = torch.tensor([1.0, 1e300, 0.0, 0.0, 0.0], dtype=torch.float64)
    huge = encode("rollout_group/v1", tensors, fields)
    del tensors["step_end"]
    partial = encode("rollout_group/v1", tensors, fields)
    return [
        (beyond.to_bytes(), "step_end: step 0 of completion 2 (entry 2) ends at token 4, outside the completion's 4"),
        (unsorted.to_bytes(), "step_end: step 1 of completion 0 (entry 1) ends at token 0, not after"),
        (row.to_bytes(), "step_index: entry 4 is 4, outside the group's 4 completions"),
        (nan.to_bytes(), "step_rewards: step 1 of completion 0 (entry 1) has reward nan"),
        (huge, "step_rewards: step 1 of completion 0 (entry 1) has reward 1e+300, not a finite float32"),
        (partial, "step_rewards, step_index and step_end go together"),
    ]


def test_a_group_with_bad_steps_is_refused_alone_naming_the_step(server_factory):
    live = server_factory(model=False)
    client = HubClient(live.url)
    good = [with_steps(A, seed=10), with_steps(None, seed=11)]
    client.upload_group(good[0])
    b12 = with_steps(B, seed=12)
    for data, message in bad_groups():
        response = live.post("/v1/rollouts", data=data, headers=OCTET)
        assert response.status_code == 422, message
        assert message in response.json()["detail"]
        batch_upload = live.post("/v1/rollouts/batch", headers=OCTET,
                                 data=encode_messages([b12.to_bytes(), data]))
        assert batch_upload.status_code == 200                            # the bad group is refused alone
        first, second = batch_upload.json()["answers"]
        assert first["accepted"] and not second["accepted"] and second["status"] == 422  # first: once, then duplicate
        assert message in second["refused"]
        assert live.get("/v1/hub/stats").json()["queue_depth"] == 2      # the good groups only, each once
    answers = client.upload_groups([good[1], replace(with_steps(A, seed=13), step_end=torch.tensor([0, 2, 4, 0, 1]))])
    assert answers[0]["accepted"] and answers[1]["status"] == 422 and "step_end" in answers[1]["refused"]
    queued = [good[0], b12, good[1]]
    batch = client.get_batch(3)
    assert batch.group_ids == [g.group_id for g in queued] and steps_of(batch) == expected(queued)


def test_the_spool_keeps_the_steps_across_a_restart(server_factory, tmp_path):
    first = server_factory(model=False, path=tmp_path)
    groups = [with_steps(A, seed=20), with_steps(None, seed=21), with_steps(B, seed=22)]
    HubClient(first.url).upload_groups(groups)
    first.__exit__(None, None, None)
    second = server_factory(model=False, path=tmp_path)
    stats = second.get("/v1/hub/stats").json()
    assert stats["spool_reloaded"] == 3 and stats["spool_corrupt"] == 0
    batch = HubClient(second.url).get_batch(3)
    assert batch.group_ids == [g.group_id for g in groups]
    assert steps_of(batch) == expected(groups)


def test_the_hubs_prepared_rows_assemble_the_steps_of_from_groups():
    groups = [with_steps(A, seed=30), with_steps(None, seed=31, lengths=(2, 2)),
              with_steps(B, seed=32, lengths=(1, 5, 1, 1))]
    got = assemble_batch(groups, [GroupRows.of(g, None) for g in groups], batch_id="b")
    want = TrainBatch.from_groups(groups, None, batch_id="b")
    for name in STEP_FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert steps_of(got) == expected(groups)
    hub = RolloutHub(capacity=8, max_staleness=2, scorer=None, spool_dir=None)
    for g in groups:
        hub.put(g.to_bytes())
    leased = hub.take(3)
    assert steps_of(leased) == expected(groups)
    assert steps_of(leased.select_groups([1, 2])) == expected(groups[1:])
