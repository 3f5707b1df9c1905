"""The learner's registration with the hub (issue 22, learner/session.py): refused while another learner's session
is live, it is an error the learner stops on (exit code 1, the hub's reason, no retry loop); resumed, rank 0
presents the session id kept in its checkpoint folder and takes the session back, and acknowledges the batches its
checkpoint holds. Against a live hub on 127.0.0.1 (the model and DeepSpeed play no part in it)."""

from __future__ import annotations

import json

import pytest

from learner.checkpoint import SESSION_FILE, load_session, save_session
from learner.prefetch import HubCalls
from learner.session import SessionRefusedError, register_session
from shared.protocol.client import HubClient, LearnerSession, RetryPolicy
from tests.live_server import LiveServer, make_config
from tests.ref_server.helpers import make_group


def client(url: str, session: LearnerSession | None = None) -> HubClient:
    c = HubClient(url, retry=RetryPolicy(max_retry_s=5, initial_backoff_s=0.05, max_backoff_s=0.2))
    c.learner = session
    return c


def register(url: str, checkpoint_dir, *, resume: bool, unacked=()) -> tuple[LearnerSession, str | None]:
    """Rank 0's registration as the learner makes it; the session its clients share, and the refusal."""
    session = LearnerSession()
    calls = HubCalls(client(url, session))
    try:
        refused = register_session(client(url, session), str(checkpoint_dir), 0, 2, None, resume=resume,
                                   unacked=list(unacked), submit=calls.submit)
        calls.flush()
    finally:
        calls.close()
    return session, refused


@pytest.mark.slow  # a live hub
def test_a_refused_registration_stops_the_learner_and_a_resumed_one_takes_its_session_back(tmp_path):
    with LiveServer(make_config(tmp_path, lease_timeout_s=300.0, max_staleness=1000)) as live:
        first, refused = register(live.url, tmp_path / "ckpt", resume=False)
        assert refused is None and load_session(tmp_path / "ckpt") == first.id  # kept beside the checkpoints
        for i in range(2):
            client(live.url).upload_group(make_group(seed=i))
        held = client(live.url, first).get_batch(2, wait_s=5)  # trained; the checkpoint's ack never arrived
        # a second learner, not resumed (another run started against the same hub by mistake): refused at once
        second, refused = register(live.url, tmp_path / "other-ckpt", resume=False)
        assert second.id is None and "another learner's session is live" in refused
        error = SessionRefusedError(f"the hub refused this learner: {refused}")
        assert error.exit_code == 1 and live.state.session.id == first.id
        # the first learner resumed from its checkpoint: the same session, the held batch acknowledged
        resumed, refused = register(live.url, tmp_path / "ckpt", resume=True, unacked=[held.batch_id])
        assert refused is None and resumed.id == first.id
        stats = live.get("/v1/hub/stats").json()
        assert (stats["consumed"], stats["leased_groups"], stats["queue_depth"]) == (2, 0, 0), stats


def test_an_unreadable_session_file_means_a_new_session(tmp_path):
    assert load_session(tmp_path) is None
    save_session(tmp_path / "ckpt", "abc")
    assert load_session(tmp_path / "ckpt") == "abc"
    for junk in ("not json", json.dumps(["abc"]), json.dumps({"session": 7}), json.dumps({"session": ""})):
        (tmp_path / "ckpt" / SESSION_FILE).write_text(junk)
        assert load_session(tmp_path / "ckpt") is None
