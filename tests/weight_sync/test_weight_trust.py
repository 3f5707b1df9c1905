"""Weights and versions checked against the learner before the hub takes them (issue 22, item 4), on a live hub on
127.0.0.1 with the tiny model: weights whose tensors are not the registered layout's are refused naming the first
difference, versions and version reports are bounded and scoped to the registered learner session, a wrong
version is undone by a registration (no hub restart), and the learner reports a refusal of its own weights."""

from __future__ import annotations

import time

import pytest
import requests
import torch
from safetensors.torch import save

from generator.engines.hf import TransformersEngine
from shared.config.schema import WeightSyncConfig
from shared.protocol.client import LEARNER_SESSION_HEADER, HubClient, HubError, LearnerSession, RetryPolicy
from shared.weight_sync.layout import Layout
from shared.weight_sync.publisher import WeightPublisher
from shared.weight_sync.receiver import WeightReceiver
from shared.weight_sync.sender import WeightsRefusedError
from tests.live_server import LiveServer, make_config
from tests.ref_server.helpers import make_group

pytestmark = pytest.mark.slow  # a live hub in every test
AHEAD = 10
HTTP = WeightSyncConfig(transport="http", timeout_s=5.0, poll_s=0.2)


def client(url: str, session: LearnerSession | None = None) -> HubClient:
    c = HubClient(url, retry=RetryPolicy(max_retry_s=5, initial_backoff_s=0.05, max_backoff_s=0.2))
    c.learner = session
    return c


def layout_of(model) -> Layout:
    return Layout.build([(n, tuple(p.shape)) for n, p in model.named_parameters()], torch.float32)


def put(url: str, version: int, body: bytes, session: str | None = None) -> requests.Response:
    headers = {"Content-Type": "application/octet-stream"}
    if session is not None:
        headers[LEARNER_SESSION_HEADER] = session
    return requests.put(f"{url}/v1/weights/{version}", data=body, headers=headers, timeout=30)


@pytest.fixture
def live(tmp_path):
    with LiveServer(make_config(tmp_path, max_version_ahead=AHEAD)) as server:
        yield server


def test_hostile_weights_are_refused_and_generators_started_afterwards_load_the_learners(live, tiny_model,
                                                                                        tiny_model_dir, tmp_path):
    learner = client(live.url)
    learner.register_learner(0, 2, layout_of(tiny_model).to_json())
    session = learner.learner.id
    params = dict(tiny_model.named_parameters())
    first = next(iter(params))
    wrong_names = save({"not.a.weight": torch.zeros(4)})
    wrong_shape = save({n: (p.detach()[:1] if n == first else p.detach()).contiguous() for n, p in params.items()})
    wrong_dtype = save({n: p.detach().to(torch.float16 if n == first else torch.float32) for n, p in params.items()})
    extra = save({**{n: p.detach() for n, p in params.items()}, "extra.weight": torch.zeros(2)})
    answers = [put(live.url, 5, body, session) for body in (wrong_names, wrong_shape, wrong_dtype, extra)]
    assert [a.status_code for a in answers] == [400] * 4
    details = [a.json()["detail"] for a in answers]
    assert f"tensor '{first}' is missing" in details[0]
    assert f"tensor '{first}' has shape [1, " in details[1]
    assert f"tensor '{first}' is 'F16', the model's is F32" in details[2]
    assert "tensor 'extra.weight' is not in the model (1 such)" in details[3]
    # the right tensors from anyone but the learner's session, or too far ahead: refused too
    right = save({n: p.detach() for n, p in params.items()})
    assert put(live.url, 5, right).status_code == 409
    assert put(live.url, AHEAD + 1, right, session).status_code == 409
    assert live.state.weights.current is None and not list((tmp_path / "weights").glob("*.partial"))
    # the learner's own publish goes through, and a generator started now loads it
    publish_and_close(registered_publisher(live, tiny_model, learner)[1], 1)
    assert live.state.weights.current == 1
    engine = TransformersEngine(tiny_model_dir)
    with torch.no_grad():
        for p in engine.model.parameters():
            p.zero_()
    receiver = WeightReceiver(engine, client(live.url), HTTP, "gen-after", tmp_path / "gen")
    assert receiver.sync(0) == 1
    loaded = dict(engine.model.named_parameters())
    assert all(torch.equal(loaded[n].detach(), p.detach()) for n, p in params.items())


def test_version_reports_are_bounded_and_scoped_to_the_registered_learner(live, tmp_path):
    anyone = client(live.url)
    hub = live.state.hub
    for version in (2**53 - 1, AHEAD + 1):  # before any learner registered: bounded all the same
        with pytest.raises(HubError) as refused:
            anyone.report_version(version)
        assert refused.value.status == 409 and f"more than {AHEAD}" in str(refused.value.detail)
    assert anyone.report_version(AHEAD)["version"] == AHEAD and hub.learner_version == AHEAD
    with pytest.raises(HubError) as refused:  # a registration is bounded too
        client(live.url).register_learner(2 * AHEAD + 1)
    assert refused.value.status == 409 and hub.learner_version == AHEAD
    learner = client(live.url)
    learner.register_learner(12, groups_per_step=4)
    assert hub.learner_version == 12 and hub.groups_per_step == 4
    assert learner.report_version(13)["version"] == 13
    with pytest.raises(HubError) as refused:  # no session named: not the learner
        anyone.report_version(14)
    assert refused.value.status == 409 and "not the registered learner session" in str(refused.value.detail)
    with pytest.raises(HubError) as refused:
        learner.report_version(13 + AHEAD + 1)
    assert refused.value.status == 409 and hub.learner_version == 13
    # a hub restart keeps the session and the learner's version
    live.__exit__(None, None, None)
    with LiveServer(make_config(tmp_path, max_version_ahead=AHEAD)) as again:
        assert again.state.hub.learner_version == 13
        learner.base_url = again.url
        assert learner.report_version(14)["version"] == 14
        with pytest.raises(HubError):
            client(again.url).report_version(15)


def test_a_wrong_version_is_undone_by_the_learner_registering_again_without_a_hub_restart(live):
    hub = live.state.hub
    learner = client(live.url)
    learner.register_learner(3, groups_per_step=2)
    learner.report_version(3 + AHEAD)  # a wrong version (a misconfigured run, a bug in the learner)
    assert hub.learner_version == 3 + AHEAD
    uploader = client(live.url)
    assert uploader.upload_group(make_group(version=3, seed=1))["accepted"] is False  # stale now
    with pytest.raises(HubError) as refused:  # a stray process cannot register over the live learner ...
        client(live.url).register_learner(4)
    assert refused.value.status == 409 and "another learner's session is live" in str(refused.value.detail)
    # ... and the learner registering again (its restart, presenting its session) moves the hub back
    session = learner.learner.id
    answer = learner.register_learner(4, groups_per_step=2, resume_session=session)
    assert answer["resumed"] is True and answer["session"] == session
    assert hub.learner_version == 4 and learner.report_version(5)["version"] == 5
    assert uploader.upload_group(make_group(version=4, seed=2))["accepted"] is True


def test_the_learner_reports_a_refusal_of_its_own_weights_as_an_error(tmp_path, tiny_model):
    with LiveServer(make_config(tmp_path, max_version_ahead=AHEAD, learner_session_ttl_s=0.5)) as live:
        _refused_after_takeover(live, tiny_model)


def registered_publisher(live, model, learner: HubClient | None = None) -> tuple[HubClient, WeightPublisher]:
    """A learner's client registered with the hub (``learner`` when given, already registered) and a publisher of
    ``model`` over the HTTP relay in its session."""
    if learner is None:
        learner = client(live.url)
        learner.register_learner(0, 2, layout_of(model).to_json())
    return learner, WeightPublisher(model, lambda: client(live.url, learner.learner), HTTP, rank=0, world=1,
                                    device=torch.device("cpu"), relay_version=None)


def publish_and_close(publisher: WeightPublisher, version: int) -> None:
    """One version published and delivered without a refusal, then the publisher closed."""
    try:
        publisher.publish(version)
        assert publisher.sender.wait_idle(30) and publisher.sender.error is None
    finally:
        publisher.close()


def _refused_after_takeover(live, tiny_model):
    learner, publisher = registered_publisher(live, tiny_model)
    try:
        publisher.publish(1)
        assert publisher.sender.wait_idle(30) and publisher.sender.error is None
        time.sleep(0.6)  # the learner went quiet past the session TTL: taken for crashed ...
        client(live.url).register_learner(1)  # ... another session takes over: the learner's uploads are refused
        publisher.publish(2)
        assert publisher.sender.wait_idle(30)
        with pytest.raises(WeightsRefusedError) as refused:
            publisher.publish(3)
        assert "version 2" in str(refused.value) and "not the registered learner session" in str(refused.value)
        with pytest.raises(WeightsRefusedError):  # and at the end of the run
            publisher.finish(3)
    finally:
        publisher.close()
    assert live.state.weights.current == 1


def test_an_upload_superseded_by_the_learners_own_newer_version_is_done(live, tiny_model):
    """The race: the upload of version 1 is sent again (its answer lost across a hub restart) after this learner's
    version 2 reached the relay. The relay answers 409 (not newer); the sender counts version 1 as done (the relay
    holds this learner's newer weights) instead of stopping the learner."""
    _, publisher = registered_publisher(live, tiny_model)
    sender = publisher.sender
    try:
        for version in (1, 2):
            publisher.publish(version)
            assert sender.wait_idle(30) and sender.error is None
        assert live.state.weights.current == 2
        with sender.lock:
            sender.transfers.add("relay")
        sender.upload_relay(1)   # the late retry of version 1: 409 "not newer than the current version 2"
        assert sender.error is None and sender.counters.relay_superseded == 1 and sender.relay_version == 2
        publisher.publish(3)     # the learner goes on
        assert sender.wait_idle(30) and sender.error is None
        publisher.finish(3)
    finally:
        publisher.close()
    assert live.state.weights.current == 3


def test_a_resumed_learner_behind_the_relay_is_still_refused(live, tiny_model):
    """The other 409: the relay holds version 5 from before the learner's crash; the resumed learner (the same
    session, a new process) uploads version 3, which it never superseded itself: refused, the learner stops."""
    first, before = registered_publisher(live, tiny_model)
    publish_and_close(before, 5)
    resumed = client(live.url)
    resumed.register_learner(2, 2, resume_session=first.learner.id)
    assert resumed.learner.id == first.learner.id   # the same session: only the process tells them apart
    _, after = registered_publisher(live, tiny_model, resumed)
    try:
        after.publish(3)
        assert after.sender.wait_idle(30)
        with pytest.raises(WeightsRefusedError) as refused:
            after.publish(4)
        assert "version 3" in str(refused.value) and "not newer than the current version 5" in str(refused.value)
        assert after.sender.counters.relay_superseded == 0
    finally:
        after.close()
    assert live.state.weights.current == 5


def test_a_learner_of_an_earlier_hub_cannot_set_a_fresh_hubs_version_or_weights(tmp_path, tiny_model):
    """One address, two runs: the first run's hub is gone, a fresh hub (empty folders) serves the next run on the
    same port, and the first run's learner, still shutting down, reports and uploads with its old session. The fresh
    hub registered no learner yet; before, it took both (its version and relay then named an earlier run's weights,
    and the new run's learner refused to start on them). Now both are refused naming the reason, the hub stays
    at nothing, and the new run's learner registers and publishes as usual; tools without a session still report."""
    with LiveServer(make_config(tmp_path / "first", max_version_ahead=AHEAD)) as first:
        old, old_publisher = registered_publisher(first, tiny_model)
        old_publisher.close()
    with LiveServer(make_config(tmp_path / "second", max_version_ahead=AHEAD)) as fresh:
        old.base_url = fresh.url
        with pytest.raises(HubError) as refused:
            old.report_version(3)
        assert refused.value.status == 409 and "names one it never issued" in str(refused.value.detail)
        answer = put(fresh.url, 3, save({n: p.detach() for n, p in tiny_model.named_parameters()}), old.learner.id)
        assert answer.status_code == 409 and "names one it never issued" in answer.json()["detail"]
        assert fresh.state.hub.learner_version == 0 and fresh.state.weights.current is None
        assert client(fresh.url).report_version(0)["version"] == 0   # no session named: a tool, as before
        publish_and_close(registered_publisher(fresh, tiny_model)[1], 1)
        assert fresh.state.weights.current == 1
