"""Per-token policy versions through the hub (issue 38): uploads (single and batch) reach the leased batch at their
rows, hostile versions are a 422 naming the problem (refused alone in a batch upload), staleness goes by a group's
oldest token, and the spool keeps them across a restart."""

from dataclasses import replace

import pytest
import torch

from ref_server.hub.batching import GroupRows, assemble_batch
from ref_server.hub.rollout_hub import RolloutHub
from shared.protocol.client import HubClient
from shared.protocol.records import RolloutGroup, TrainBatch
from shared.protocol.wire import decode, encode, encode_messages

from .helpers import make_group

OCTET = {"Content-Type": "application/octet-stream"}
LENGTHS = [3, 1, 4, 2]   # make_group's rows
# policy_version 4, the oldest; completion 0 crossed two switches, 2 one, 3 was sampled after both (padding: 0)
CROSSING = torch.tensor([[4, 5, 6, 0], [4, 0, 0, 0], [4, 4, 5, 6], [6, 6, 0, 0]])


def crossing(seed: int, versions: torch.Tensor = CROSSING, policy_version: int = 4) -> RolloutGroup:
    return replace(make_group(version=policy_version, seed=seed), token_versions=versions).validate()


def rows_of(batch: TrainBatch) -> list[list[int]]:
    return [batch.token_versions[i, :n].tolist() for i, n in enumerate(batch.completion_lengths.tolist())]


EXPECTED = [[4, 5, 6], [4], [4, 4, 5, 6], [6, 6],        # the crossing group
            [5, 5, 5], [5], [5] * 4, [5, 5],              # a version-5 group of an old client: its version
            [4, 5, 6], [4], [4, 4, 5, 6], [6, 6]]


def test_the_hubs_prepared_rows_assemble_the_versions_of_from_groups():
    groups = [crossing(0), make_group(version=5, seed=1), crossing(2)]
    got = assemble_batch(groups, [GroupRows.of(g, None) for g in groups], batch_id="b")
    want = TrainBatch.from_groups(groups, None, batch_id="b")
    assert torch.equal(got.token_versions, want.token_versions)
    assert got.token_versions.shape == got.behaviour_logprobs.shape and rows_of(got) == EXPECTED
    assert got.policy_versions.tolist() == [4] * 4 + [5] * 4 + [4] * 4   # the oldest token of each group
    hub = RolloutHub(capacity=8, max_staleness=2, scorer=None, spool_dir=None)
    hub.report_version(6)
    for g in groups:
        hub.put(g.to_bytes())
    leased = hub.take(3)
    assert rows_of(leased) == EXPECTED and rows_of(leased.select_groups([1, 2])) == EXPECTED[4:]
    hub.put(make_group(version=6, seed=3).to_bytes())
    assert hub.take(1).token_versions is None    # a batch of one-version groups: as before


def test_staleness_goes_by_the_oldest_token():
    hub = RolloutHub(capacity=8, max_staleness=1, scorer=None, spool_dir=None)
    hub.report_version(6)
    # sampled up to version 6, but its oldest tokens are version 4: two behind the learner, one too many
    assert hub.put(crossing(0).to_bytes())["dropped"] == "stale"
    fresh = CROSSING.clamp(min=5)          # the same tails, the version-4 tokens sampled at 5
    assert hub.put(crossing(1, fresh, policy_version=5).to_bytes())["accepted"]
    assert hub.report_version(7) == 1      # now version 5 is two behind: dropped from the queue too
    assert hub.depth() == 0


def hostile() -> list[tuple[bytes, str]]:
    """(group bytes, what the 422 must name)."""
    tensors, fields = decode(make_group(version=4, seed=7).to_bytes(), "rollout_group/v1")

    def sent(versions) -> bytes:
        return encode("rollout_group/v1", {**tensors, "token_versions": versions}, fields)

    down = CROSSING.clone()
    down[2, 3] = 4
    return [
        (sent(CROSSING.double()), "token_versions must be an integer tensor, got torch.float64"),
        (sent(CROSSING - 5), "token_versions: completion 0, token 0 is -1, outside [4, 2^53)"),
        (sent(CROSSING + 2**53), "outside [4, 2^53)"),
        (sent(CROSSING[:, :3]), "token_versions must have the shape of the completions (4, 4), got (4, 3)"),
        (sent(down), "token_versions: completion 2, token 3 has version 4 after 5"),
        (sent(CROSSING + 1), "the oldest token version is 5, but policy_version is 4"),
        (sent(CROSSING.clamp(max=4) + CROSSING.eq(6).long() * 4), "token version 8 is newer than any version the "
                                                                  "learner has published (6)"),
    ]


@pytest.mark.slow
def test_uploads_reach_the_batch_and_hostile_versions_are_a_422_refused_alone(server_factory):
    live = server_factory(model=False, max_staleness=3)
    assert live.post("/v1/learner/version", json={"version": 6}).status_code == 200
    client = HubClient(live.url)
    groups = [crossing(0), make_group(version=5, seed=1), crossing(2)]
    assert client.upload_group(groups[0])["accepted"]
    good = groups[1].to_bytes()
    for data, reason in hostile():
        single = live.post("/v1/rollouts", data=data, headers=OCTET)
        assert single.status_code == 422 and reason in single.json()["detail"], (reason, single.text)
        both = live.post("/v1/rollouts/batch", data=encode_messages([good, data]), headers=OCTET)
        assert both.status_code == 200
        first, second = both.json()["answers"]
        assert first["accepted"] and not second["accepted"] and second["status"] == 422 and reason in second["refused"]
    assert client.upload_groups(groups[2:])[0]["accepted"]
    batch = client.get_batch(3)
    assert batch.group_ids == [g.group_id for g in groups] and rows_of(batch) == EXPECTED
    assert batch.token_versions.dtype == torch.int64
    assert 'status="5' not in live.get("/metrics").text


@pytest.mark.slow
def test_the_spool_keeps_the_versions_across_a_restart(server_factory, tmp_path):
    first = server_factory(model=False, path=tmp_path, max_staleness=3)
    first.post("/v1/learner/version", json={"version": 6})
    groups = [crossing(20), make_group(version=5, seed=21), crossing(22)]
    HubClient(first.url).upload_groups(groups)
    first.__exit__(None, None, None)
    second = server_factory(model=False, path=tmp_path, max_staleness=3)
    stats = second.get("/v1/hub/stats").json()
    assert stats["spool_reloaded"] == 3 and stats["spool_corrupt"] == 0
    batch = HubClient(second.url).get_batch(3)
    assert batch.group_ids == [g.group_id for g in groups] and rows_of(batch) == EXPECTED
