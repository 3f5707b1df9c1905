"""The learner's session with the hub (issue 22): no other process can take it while it is live, a resumed learner
takes it back, and a new session releases the earlier one's leases at once. On a live hub (uvicorn on 127.0.0.1),
restarted on its spool where the case needs it.

* Without a token (the default on 127.0.0.1) any local process could register and make the hub refuse the real
  learner's reports and uploads. A registration is refused (409) while the registered session is live (heard from
  within ``ref_server.learner_session_ttl_s``: its heartbeat, reports, uploads), unless it presents the session's id
  (a learner resumed from its checkpoint folder). Quiet past the TTL, or ended by its learner, it can be replaced.
* Leases the previous learner process held (kept across a hub restart) do not wait out the lease timeout: a new
  session releases them at once, but those a resuming learner presents as held by its checkpoint; an untrained one
  still counts a failed delivery (a group that crashes the learner is quarantined all the same)."""

from __future__ import annotations

import time

import pytest

from shared.protocol.client import HubClient, HubError, RetryPolicy
from tests.live_server import LiveServer, make_config
from tests.ref_server.helpers import make_group

pytestmark = pytest.mark.slow  # a live hub in every test


def client(url: str) -> HubClient:
    return HubClient(url, retry=RetryPolicy(max_retry_s=5, initial_backoff_s=0.05, max_backoff_s=0.2))


def refused(call) -> str:
    with pytest.raises(HubError) as error:
        call()
    assert error.value.status == 409
    return str(error.value.detail)


def test_a_live_learner_session_cannot_be_taken_over_and_a_quiet_or_ended_one_can(tmp_path):
    config = make_config(tmp_path, learner_session_ttl_s=1.0)
    live = LiveServer(config).__enter__()
    try:
        port = int(live.url.rsplit(":", 1)[1])
        learner = client(live.url)
        assert learner.register_learner(0, 2)["resumed"] is False
        session = learner.learner.id
        intruder = client(live.url)
        for _ in range(3):  # 1.5 s in all, past the TTL: the heartbeat keeps the session live
            time.sleep(0.5)
            learner.renew_learner_session()
            assert "another learner's session is live" in refused(lambda: intruder.register_learner(0))
        assert "another learner's session is live" in refused(
            lambda: intruder.register_learner(0, resume_session="f" * 32))  # a made-up id is no better
        # a hub restart keeps the session, live for a fresh TTL (the hub's downtime is not the learner's silence)
        live.__exit__(None, None, None)
        live = LiveServer(config, port=port).__enter__()
        refused(lambda: intruder.register_learner(0))
        # the learner resumed (its session id from its checkpoint folder) takes the session back, live as it is
        resumed = client(live.url)
        answer = resumed.register_learner(1, 2, resume_session=session)
        assert answer["resumed"] is True and answer["session"] == session and resumed.report_version(2)
        # quiet past the TTL (crashed, no checkpoint to resume from): a new learner may replace it
        time.sleep(1.1)
        newcomer = client(live.url)
        assert newcomer.register_learner(0, 2)["resumed"] is False and newcomer.learner.id != session
        assert "not the registered learner session" in refused(lambda: resumed.report_version(3))
        assert "not the registered learner session" in refused(resumed.renew_learner_session)
        # a learner that exits ends its session: the next one registers at once; others still cannot report
        refused(lambda: intruder.register_learner(0))
        newcomer.end_learner_session()
        refused(lambda: intruder.report_version(1))
        assert intruder.register_learner(0)["resumed"] is False
    finally:
        live.__exit__(None, None, None)


def test_a_new_session_releases_the_earlier_sessions_leases_at_once_but_those_its_checkpoint_holds(tmp_path):
    # leases of five minutes: any lease not released by the registration would still be held at the end
    config = make_config(tmp_path, lease_timeout_s=300.0, learner_session_ttl_s=0.5, max_deliveries=1,
                         max_staleness=1000)
    groups = [make_group(seed=i) for i in range(6)]
    with LiveServer(config) as live:
        learner = client(live.url)
        learner.register_learner(0, 2)
        session = learner.learner.id
        for group in groups:
            client(live.url).upload_group(group)
        trained, prefetched, saved = (learner.get_batch(2, wait_s=5) for _ in range(3))
        # trained and not checkpointed; leased and not trained; trained, checkpointed, acknowledgement lost
        learner.renew_batches([trained.batch_id, saved.batch_id], trained=True)
    with LiveServer(config) as live:  # the hub restarted: the three leases are held again, for 300 s
        assert live.get("/v1/hub/stats").json()["leased_groups"] == 6
        resumed = client(live.url)
        answer = resumed.register_learner(0, 2, resume_session=session, trained_batches=[saved.batch_id])
        assert answer["resumed"] is True and (answer["released_groups"], answer["kept_leases"]) == (4, 1)
        again = resumed.get_batch(4, wait_s=0)  # now, not after the lease timeout
        assert sorted(again.group_ids) == sorted(trained.group_ids + prefetched.group_ids)
        assert resumed.ack_batches([saved.batch_id]) == {saved.batch_id: "acked"}
        stats = live.get("/v1/hub/stats").json()
        # restored leases count no failed delivery (the learner that held them may have gone with the hub)
        assert (stats["consumed"], stats["leased_groups"], stats["quarantined"]) == (2, 4, 0), stats
        resumed.ack_batches([again.batch_id])
        for i in range(6, 10):
            client(live.url).upload_group(make_group(seed=i))
        held_trained, crashed_on = resumed.get_batch(2, wait_s=5), resumed.get_batch(2, wait_s=5)
        resumed.renew_batches([held_trained.batch_id], trained=True)
        time.sleep(0.6)  # the resumed learner crashes on crashed_on and stays down: its session goes quiet
        answer = client(live.url).register_learner(0, 2)  # a new learner, no checkpoint: every lease released
        assert answer["resumed"] is False and (answer["released_groups"], answer["kept_leases"]) == (4, 0)
        stats = live.get("/v1/hub/stats").json()
        # the untrained lease counted a failed delivery (max_deliveries 1: quarantined), the trained one none
        assert (stats["quarantined"], stats["queue_depth"], stats["leased_groups"]) == (2, 2, 0), stats
        queued = [entry.group.group_id for entry in live.state.hub.leases.queue.groups.values()]
        assert sorted(queued) == sorted(held_trained.group_ids) and crashed_on.num_groups == 2
        assert stats["consumed"] == 6
