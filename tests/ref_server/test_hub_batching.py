"""The hub's cheap paths: batches assembled from rows prepared at upload, staleness drops from a heap, uploads that
never hold the lock across their disk write, and leases handed back by a stopping learner."""

import heapq
import threading

import pytest
import torch

from ref_server.hub.batching import GroupRows, assemble_batch
from ref_server.hub.rollout_hub import RolloutHub
from shared.protocol.client import HubClient
from shared.protocol.records import TrainBatch

from .helpers import make_group


def hub(tmp_path=None, **kw) -> RolloutHub:
    return RolloutHub(capacity=kw.pop("capacity", 64), max_staleness=kw.pop("max_staleness", 2), scorer=None,
                      spool_dir=tmp_path, **kw)


def assert_same_batch(a: TrainBatch, b: TrainBatch) -> None:
    for name in ("input_ids", "prompt_lengths", "completion_lengths", "rewards", "behaviour_logprobs",
                 "group_index", "policy_versions", "truncated"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name
    assert (a.ref_logprobs is None) == (b.ref_logprobs is None)
    if a.ref_logprobs is not None:
        assert a.ref_logprobs.shape == b.ref_logprobs.shape and torch.equal(a.ref_logprobs, b.ref_logprobs)
    assert a.reward_components.keys() == b.reward_components.keys()
    for name in a.reward_components:
        assert torch.allclose(a.reward_components[name], b.reward_components[name], rtol=0, atol=0,
                              equal_nan=True), name
    assert (a.group_ids, a.generator_ids, a.temperature, a.batch_id) == \
        (b.group_ids, b.generator_ids, b.temperature, b.batch_id)


def mixed_groups():
    """Different prompt lengths, group sizes, padding garbage past the lengths, an empty completion, and reward
    components present in some groups only."""
    groups = [make_group(seed=0, prompt=(1, 2, 3), lengths=(3, 1, 4, 2)),
              make_group(seed=1, prompt=(5,), lengths=(6, 0, 2, 2), version=1),
              make_group(seed=2, group_size=2, prompt=(7, 8, 9, 10, 11), lengths=(1, 2))]
    groups[2].reward_components = {"other": torch.tensor([0.5, 0.25])}
    return groups


def test_prepared_rows_assemble_exactly_the_batch_of_from_groups():
    groups = mixed_groups()
    refs = [[-torch.rand(int(n)) for n in g.completion_lengths] for g in groups]
    padded = [torch.nn.utils.rnn.pad_sequence(r, batch_first=True) for r in refs]
    for with_ref in (False, True):
        rows = [GroupRows.of(g, r if with_ref else None) for g, r in zip(groups, refs)]
        got = assemble_batch(groups, rows, batch_id="b1")
        want = TrainBatch.from_groups(groups, padded if with_ref else None, batch_id="b1")
        assert_same_batch(got, want)
        # the widest row, not the widest prompt (5) plus the longest completion (6)
        assert got.input_ids.shape == (10, 7) and got.behaviour_logprobs.shape == (10, 6)
    # and the hub's take() is that assembly
    h = hub()
    h.report_version(1)
    for g in groups:
        h.put(g.to_bytes())
    batch = h.take(3)
    assert_same_batch(batch, TrainBatch.from_groups(groups, None, batch_id=batch.batch_id))


def test_staleness_drops_touch_only_the_stale_groups(tmp_path, monkeypatch):
    h = hub(tmp_path, capacity=512, max_staleness=3)
    versions = [v for _ in range(25) for v in (0, 1, 2, 3)]  # interleaved, as from several generators
    h.report_version(3)
    for i, v in enumerate(versions):
        h.put(make_group(version=v, seed=i).to_bytes())
    pops = []
    original = heapq.heappop
    monkeypatch.setattr(heapq, "heappop", lambda heap: pops.append(heap[0]) or original(heap))
    assert h.report_version(3) == 0 and pops == []  # nothing stale: only a look at the oldest version
    batch = h.take(4)  # no staleness work in a take
    assert pops == [] and batch.num_groups == 4
    assert batch.policy_versions.unique().tolist() == [0, 1, 2, 3]
    assert h.report_version(4) == 24  # the version-0 groups, but the one leased
    # one pop per version-0 heap entry (the leased one's too: skipped), none of the fresh ones
    assert h.counters.dropped_stale == 24 and len(pops) == 25 and {v for v, _ in pops} == {0}
    assert h.depth() == 72 and {e.group.policy_version for e in h.queue.groups.values()} == {1, 2, 3}
    assert len(list(tmp_path.glob("*.group"))) == h.depth() + 4  # dropped ones unspooled, leased ones kept


def test_an_upload_writing_its_spool_file_does_not_block_a_take(tmp_path):
    h = hub(tmp_path, capacity=3)
    for i in range(2):
        h.put(make_group(seed=i).to_bytes())
    writing, finish = threading.Event(), threading.Event()
    original = h.intake._spool_write

    def slow_write(groups):  # an upload's group commit (one call for all its groups)
        writing.set()
        finish.wait(10)
        return original(groups)

    h.intake._spool_write = slow_write
    slow = make_group(seed=9)
    answers = []
    uploader = threading.Thread(target=lambda: answers.append(h.put(slow.to_bytes())))
    uploader.start()
    assert writing.wait(10)
    try:  # the slot of the group being written counts against capacity
        h.put(make_group(seed=10).to_bytes())
        raise AssertionError("the hub accepted more than its capacity")
    except RuntimeError as exc:
        assert "full" in str(exc)
    assert h.put(slow.to_bytes())["duplicate"] is True  # a retry while the first upload writes
    batch = h.take(2, timeout=0)  # would wait for the lock (and time out as None) if put held it
    assert batch is not None and batch.num_groups == 2
    finish.set()
    uploader.join(10)
    assert answers and answers[0]["accepted"] and h.depth() == 1
    assert sorted(p.name.split("-", 1)[1] for p in tmp_path.glob("*.group")) == sorted(
        f"{g}.group" for g in [*batch.group_ids, slow.group_id])
    assert not list(tmp_path.glob("*.tmp"))


def test_a_handed_back_lease_is_the_next_batch_at_once(tmp_path):
    h = hub(tmp_path, lease_timeout_s=300)
    groups = [make_group(seed=i) for i in range(4)]
    for g in groups:
        h.put(g.to_bytes())
    first = h.take(2)
    assert h.release([first.batch_id, "nope"]) == {first.batch_id: "released", "nope": "unknown"}
    assert h.leased_depth() == 0 and h.depth() == 4
    again = h.take(2)
    assert again.group_ids == first.group_ids and again.batch_id != first.batch_id
    assert h.ack([first.batch_id]) == {first.batch_id: "late"}  # it stays with the new lease
    assert h.ack([again.batch_id]) == {again.batch_id: "acked"} and h.counters.consumed == 2


@pytest.mark.slow
def test_release_over_http(server_factory):
    live = server_factory(model=False)
    client = HubClient(live.url)
    for i in range(2):
        client.upload_group(make_group(seed=i))
    batch = client.get_batch(2)
    answer = live.post("/v1/batch/release", json={"batch_ids": [batch.batch_id]})
    assert answer.status_code == 200 and answer.json() == {"batches": {batch.batch_id: "released"}}
    assert client.hub_stats()["leased_groups"] == 0 and client.get_batch(2).group_ids == batch.group_ids
    assert live.post("/v1/batch/release", json={"batch_ids": "x"}).status_code == 422
