"""The learner session's store (ref_server/session.py) without a server: what it keeps on disk is what the hub
wrote before the session left the weight relay (``learner.json``, ``layout.json``: a resumed run reads both back),
and a registered layout makes the relay drop stored weights that do not match it, before it is saved."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import save

from ref_server.session import LearnerSessionStore, NotTheLearner, SessionTaken
from shared.weight_sync.layout import Layout
from shared.weight_sync.relay_store import WeightStore

ROWS = [["w", "F32", [4]]]


def test_a_registration_is_written_as_before_and_read_back_live_after_a_restart(tmp_path):
    store = LearnerSessionStore(tmp_path, ttl_s=60.0)
    assert store.id is None and not store.live() and not (tmp_path / "learner.json").exists()
    session, resumed = store.register(3, Layout.from_json(ROWS))
    assert not resumed and len(session) == 32
    assert json.loads((tmp_path / "learner.json").read_text()) == {"session": session, "version": 3, "ended": False}
    assert json.loads((tmp_path / "layout.json").read_text()) == ROWS
    store.note_version(4)
    assert json.loads((tmp_path / "learner.json").read_text())["version"] == 4
    again = LearnerSessionStore(tmp_path, ttl_s=60.0)   # a hub restart: the session, live for a fresh TTL
    assert (again.id, again.learner_version, again.layout.to_json(), again.live()) == (session, 4, ROWS, True)
    with pytest.raises(SessionTaken, match="another learner's session is live"):
        again.register(0, None)
    with pytest.raises(NotTheLearner):
        again.check("someone-else")
    assert again.register(5, None, resume=session) == (session, True)
    assert again.layout.to_json() == ROWS   # None keeps the registered layout
    again.end(session)
    assert json.loads((tmp_path / "learner.json").read_text()) == {"session": session, "version": 5, "ended": True}
    ended = LearnerSessionStore(tmp_path, ttl_s=60.0)
    assert ended.id == session and not ended.live() and ended.register(0, None)[0] != session


def test_a_file_from_before_the_move_is_read_and_an_unreadable_one_means_no_session(tmp_path, caplog):
    (tmp_path / "learner.json").write_text('{"session": "abc", "version": 5}')   # before "ended" was written
    store = LearnerSessionStore(tmp_path)
    assert (store.id, store.learner_version, store.layout, store.ended) == ("abc", 5, None, False)
    (tmp_path / "learner.json").write_text("{}")
    (tmp_path / "layout.json").write_text(json.dumps(ROWS))
    with caplog.at_level(logging.WARNING, logger="grpo.ref_server.session"):
        store = LearnerSessionStore(tmp_path)
    assert (store.id, store.layout) == (None, None) and "unreadable" in caplog.text


def test_a_new_layout_drops_the_stored_weights_that_do_not_match_it_before_it_is_saved(tmp_path):
    session = LearnerSessionStore(tmp_path)
    (tmp_path / "v0000000001.safetensors").write_bytes(save({"w": torch.zeros(4)}))
    (tmp_path / "v0000000002.safetensors").write_bytes(save({"w": torch.zeros(8)}))
    weights = WeightStore(tmp_path, max_bytes=2**20, layout=lambda: session.layout)
    seen = []
    session.register(0, None, adopt_layout=lambda: seen.append("no layout: not called"))
    assert seen == [] and weights.versions == [1, 2]

    def adopt():
        seen.append(json.loads((tmp_path / "layout.json").read_text()))  # the layout on disk is still the old one
        weights.drop_mismatched()

    session.register(0, Layout.from_json(ROWS), resume=session.id, adopt_layout=adopt)
    assert seen == [None] and weights.versions == [1] and not (tmp_path / "v0000000002.safetensors").exists()


def test_before_any_registration_a_request_without_a_session_passes_and_one_naming_a_session_does_not(tmp_path):
    """A fresh hub serves tools (no session id) before its learner registers, but not a learner of another hub (a
    session id this store never issued): that one would set the fresh hub's version and weights."""
    store = LearnerSessionStore(tmp_path)
    store.check(None)
    with pytest.raises(NotTheLearner, match="names one it never issued"):
        store.check("a" * 32)
    session, _ = store.register(0, None)
    store.check(session)
    with pytest.raises(NotTheLearner, match="not the registered learner session"):
        store.check(None)
