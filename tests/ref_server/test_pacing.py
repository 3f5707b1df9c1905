"""Staleness-aware pacing: the hub tells a generator how many groups of its version the learner can still train
within max_staleness, leases drop groups older than the version the batch will be trained at, and a generator and
learner that follow both train only groups within the bound and drop none."""

import threading
import time

import pytest

from ref_server.hub.pacing import groups_wanted
from ref_server.hub.rollout_hub import RolloutHub
from shared.protocol.client import HubClient
from tests.live_server import LiveServer, make_config
from tests.ref_server.helpers import make_group


def hub(**kw) -> RolloutHub:
    return RolloutHub(capacity=kw.pop("capacity", 256), max_staleness=kw.pop("max_staleness", 2), scorer=None, **kw)


@pytest.mark.parametrize("generator, learner, leased, queued, step, bound, wanted", [
    (5, 5, 0, 0, 16, 2, 48),    # three steps' worth: trained at versions 5, 6, 7 -> staleness 0, 1, 2
    (5, 5, 32, 0, 16, 2, 16),   # the learner trains one batch and prefetched the next: one more batch
    (5, 5, 32, 10, 16, 2, 6),
    (5, 5, 32, 20, 16, 2, 0),   # never negative
    (4, 5, 32, 0, 16, 2, 0),    # a generator one version behind: its groups would be trained at staleness 3
    (5, 5, 0, 0, 16, 0, 16),    # on-policy: one batch, and only of the learner's version
    (5, 5, 16, 0, 16, 0, 0),    # ... and none while a batch is still being trained
    (4, 5, 0, 0, 16, 0, 0),
    (6, 5, 0, 0, 4, 1, 12),     # weights newer than the learner's last report (reports travel asynchronously)
])
def test_groups_wanted(generator, learner, leased, queued, step, bound, wanted):
    assert groups_wanted(generator_version=generator, learner_version=learner, leased_groups=leased,
                         queued_groups=queued, groups_per_step=step, max_staleness=bound) == wanted


def test_groups_wanted_refuses_a_step_of_no_groups():
    with pytest.raises(ValueError, match="groups_per_step"):
        groups_wanted(generator_version=0, learner_version=0, leased_groups=0, queued_groups=0, groups_per_step=0,
                      max_staleness=1)


def test_the_hub_budget_counts_queued_and_leased_groups():
    h = hub(max_staleness=1)
    assert h.budget(0)["wanted"] is None  # no learner yet: nothing to pace by
    h.report_version(0, groups_per_step=4)
    assert h.budget(0)["wanted"] == 8
    for i in range(6):
        h.put(make_group(version=0, seed=i).to_bytes())
    assert h.budget(0)["wanted"] == 2
    batch = h.take(4)  # leased groups still count until trained
    assert h.budget(0)["wanted"] == 2
    h.renew([batch.batch_id])
    assert h.budget(0)["wanted"] == 2
    h.renew([batch.batch_id], trained=True)  # trained, held for a checkpoint: no longer ahead of new groups
    assert h.budget(0)["wanted"] == 6
    h.ack([batch.batch_id])
    assert h.budget(0)["wanted"] == 6
    h.report_version(1)  # the step size is remembered
    assert h.budget(0)["wanted"] == 2 and h.budget(1)["wanted"] == 6


def test_a_budget_wait_ends_when_the_learner_moves_on():
    h = hub(max_staleness=0)
    h.report_version(0, groups_per_step=2)
    for i in range(2):
        h.put(make_group(version=0, seed=i).to_bytes())
    started = time.monotonic()
    assert h.budget(0, wait_s=0.3)["wanted"] == 0 and time.monotonic() - started >= 0.3
    answers = []
    waiter = threading.Thread(target=lambda: answers.append(h.budget(0, wait_s=10)))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive()
    batch = h.take(2)
    h.report_version(1)  # new weights: the generator must load them before its groups are wanted again
    waiter.join(5)
    h.ack([batch.batch_id])  # the learner's order: the version report, then the acknowledgement
    assert not waiter.is_alive() and answers[0]["learner_version"] == 1 and answers[0]["wanted"] == 0
    assert h.budget(1)["wanted"] == 2


def test_a_lease_drops_groups_older_than_its_min_version():
    h = hub(max_staleness=2)
    h.report_version(2)
    for i, version in enumerate([0, 0, 1, 1, 2, 2]):
        h.put(make_group(version=version, seed=i).to_bytes())
    batch = h.take(2, min_version=1)
    assert batch.policy_versions.unique().tolist() == [1]
    assert h.counters.dropped_stale == 2 and h.depth() == 2
    assert h.take(2, min_version=0).policy_versions.unique().tolist() == [2]  # a floor never raises older drops


@pytest.mark.parametrize("bound", [0, 1, 2, 3])
def test_a_paced_generator_and_a_prefetching_learner_waste_nothing_and_stay_within_the_bound(bound):
    """A deterministic interleaving: the generator samples when the hub wants groups of its version (at most a
    batch of prompts at a time) and loads each new version; the learner trains one batch while the next is
    leased, asking each lease for the groups fit for the version it will train them at. Every group trained is
    within the bound, none is dropped as stale, and the learner never lacks a batch for long."""
    step, prompts = 4, 3
    h = hub(max_staleness=bound)
    h.report_version(0, groups_per_step=step)
    generator_version = learner_version = 0
    training = None                     # (batch, version it is trained at)
    prefetched = None
    trained, seed = 0, 0
    for _tick in range(400):
        # the generator: one engine call if anything is wanted
        wanted = h.budget(generator_version)["wanted"]
        for _ in range(min(prompts, wanted)):
            seed += 1
            h.put(make_group(version=generator_version, seed=seed).to_bytes())
        generator_version = learner_version   # it loads the newest weights between engine calls
        # the learner: finish the batch in training, take the prefetched one, lease the next
        if training is not None:
            batch, at_version = training
            assert int(batch.policy_versions.max()) <= at_version
            assert int(at_version - batch.policy_versions.min()) <= bound
            learner_version += 1
            h.ack([batch.batch_id])
            h.report_version(learner_version)
            trained += 1
            training = None
        if prefetched is not None:
            training, prefetched = (prefetched, learner_version), None
        if prefetched is None:
            trains_at = learner_version + (1 if training is not None else 0)
            prefetched = h.take(step, min_version=max(0, trains_at - bound))
            if training is None and prefetched is not None:
                training, prefetched = (prefetched, learner_version), None
    assert trained >= 100
    assert h.counters.dropped_stale == 0 and h.counters.refused_stale == 0


@pytest.mark.slow
def test_budget_and_min_version_over_http(tmp_path):
    with LiveServer(make_config(tmp_path, max_staleness=1)) as live:
        client = HubClient(live.url)
        assert client.rollout_budget(0)["wanted"] is None
        client.report_version(0, groups_per_step=3)
        assert client.hub_stats()["groups_per_step"] == 3
        assert client.rollout_budget(0) == {"wanted": 6, "learner_version": 0, "groups_per_step": 3,
                                            "queue_depth": 0}
        for i, version in enumerate([0, 0, 1, 1]):
            if version == 1:
                client.report_version(1)
            client.upload_group(make_group(version=version, seed=i))
        batch = client.get_batch(2, min_version=1)
        assert batch.policy_versions.unique().tolist() == [1]
        assert client.hub_stats()["dropped_stale"] == 2
        for params in ({"policy_version": -1}, {"policy_version": 0, "wait_s": -1}, {}):
            response = client.session.get(f"{live.url}/v1/rollouts/budget", params=params)
            assert response.status_code == 422, params
        response = client.session.get(f"{live.url}/v1/batch", params={"num_groups": 1, "min_version": -2})
        assert response.status_code == 422
        response = client.session.post(f"{live.url}/v1/learner/version", json={"version": 2, "groups_per_step": 0})
        assert response.status_code == 422
