"""The client's weight-sync calls send and return the typed messages, and their JSON on the wire is what the
hub's routes always took and gave (same keys, same order); the modules vLLM's workers import stay light."""

import json
import subprocess
import sys

import pytest

from shared.protocol.client import HubClient
from shared.protocol.weight_sync_messages import (
    Announcement,
    JoinRequest,
    MemberAnswer,
    MemberPoll,
    MemberReport,
    Offer,
    OfferPost,
    PendingJoin,
    SenderInfo,
    SenderWork,
    SyncStatus,
)

OFFER = {"member_id": "m1-g", "group_id": "tcp://127.0.0.1:4000", "host": "127.0.0.1", "port": 4000,
         "world_size": 2, "first_rank": 1, "backend": "gloo", "transport": "collective", "relay_version": 3,
         "bucket_bytes": 64, "timeout_s": 5.0, "ipc_handle": None, "layout": [["w", "F32", [2, 3]]],
         "metadata": {"grpo_weights": "lora_adapter", "grpo_lora_scaling": "2.0"}}  # metadata: what versions hold


class Recorder:
    """Stands in for the transport: records each request and answers with the next canned JSON."""

    def __init__(self, answers):
        self.calls, self.answers = [], list(answers)

    def __call__(self, method, path, **kwargs):
        self.calls.append((method, path, kwargs))
        answer = self.answers.pop(0) if self.answers else {}

        class Response:
            def json(self):
                return answer

        return Response()


@pytest.fixture
def client():
    hub = HubClient("http://hub.invalid", timeout_s=7.0)
    yield hub
    hub.close()


def body(recorder, index=-1) -> str:
    """The request body as requests would serialise it (json.dumps of the ``json`` argument)."""
    return json.dumps(recorder.calls[index][2]["json"])


def test_the_senders_calls_send_the_bodies_the_routes_always_took(client):
    client._request = rec = Recorder([])
    info = SenderInfo(sender_id="s1", host="127.0.0.1", backend="gloo", device_uuid=None,
                      layout=[["w", "F32", [2, 3]]], bucket_bytes=64, timeout_s=5.0, member_idle_s=900.0)
    client.sync_register_sender(info)
    assert rec.calls[-1][:2] == ("PUT", "/v1/weights/sync/sender")
    assert body(rec) == json.dumps({"sender_id": "s1", "host": "127.0.0.1", "backend": "gloo", "device_uuid": None,
                                    "layout": [["w", "F32", [2, 3]]], "bucket_bytes": 64, "timeout_s": 5.0,
                                    "member_idle_s": 900.0})
    client.sync_announce(Announcement(sender_id="s1", version=4))
    assert rec.calls[-1][:2] == ("POST", "/v1/weights/sync/announce")
    assert body(rec) == json.dumps({"sender_id": "s1", "version": 4})
    client.sync_offer(OfferPost(sender_id="s1", offer=Offer(**OFFER)))
    assert rec.calls[-1][:2] == ("POST", "/v1/weights/sync/offers")
    assert body(rec) == json.dumps({"sender_id": "s1", "offer": OFFER})
    client.sync_member_state("m1-g", MemberReport(sender_id="s1", state="dropped", reason="gone"))
    assert rec.calls[-1][:2] == ("POST", "/v1/weights/sync/members/m1-g/state")
    assert body(rec) == json.dumps({"sender_id": "s1", "state": "dropped", "reason": "gone", "version": None})


def test_the_generators_calls_send_the_old_bodies_and_return_typed_answers(client):
    poll_answer = {"action": "connect", "announced": 3, "offer": OFFER, "reason": None}
    status = {"sender": {"sender_id": "s1", "backend": "gloo", "host": "h", "device_uuid": None}, "announced": 3,
              "members": {"active": 1}, "dropped_total": 0, "relay_version": 3}
    client._request = rec = Recorder([{"member_id": "m1-g"}, poll_answer, status])
    member = client.sync_join(JoinRequest(generator_id="g", transport="collective", workers=1))
    assert member == "m1-g" and rec.calls[-1][:2] == ("POST", "/v1/weights/sync/members")
    assert body(rec) == json.dumps({"generator_id": "g", "transport": "collective", "workers": 1,
                                    "device_uuid": None})
    answer = client.sync_poll(member, MemberPoll(version=2, wait_s=1.5))
    assert rec.calls[-1][:2] == ("POST", "/v1/weights/sync/members/m1-g/poll")
    assert body(rec) == json.dumps({"version": 2, "wait_s": 1.5}) and rec.calls[-1][2]["timeout_s"] == 8.5
    assert isinstance(answer, MemberAnswer) and answer.action == "connect" and answer.announced == 3
    assert isinstance(answer.offer, Offer) and answer.offer.model_dump(mode="json") == OFFER  # what engines get
    got = client.sync_status()
    assert isinstance(got, SyncStatus) and got.sender.backend == "gloo" and got.relay_version == 3
    assert got.members == {"active": 1}


def test_the_senders_long_poll_returns_typed_work_whose_json_is_the_hubs_old_answer(client):
    old = {"joins": [{"member_id": "m2-g", "generator_id": "g", "transport": "ipc", "workers": 2,
                      "device_uuid": "GPU-1"}], "silent": ["m1-x"], "http_members": 1}
    client._request = rec = Recorder([old])
    work = client.sync_work("s1", wait_s=2.0)
    assert rec.calls[-1][:2] == ("GET", "/v1/weights/sync/work")
    assert rec.calls[-1][2]["params"] == {"sender_id": "s1", "wait_s": 2.0}
    assert isinstance(work, SenderWork) and isinstance(work.joins[0], PendingJoin)
    assert work.joins[0].workers == 2 and work.silent == ["m1-x"] and work.http_members == 1
    assert work.members is None  # an older hub does not list the members it holds: the sender drops none
    # the hub builds the same object from a join request: its JSON is byte for byte the old dict's
    request = JoinRequest(generator_id="g", transport="ipc", workers=2, device_uuid="GPU-1")
    built = SenderWork(joins=[PendingJoin(member_id="m2-g", **request.model_dump())], silent=["m1-x"],
                       http_members=1)
    assert json.dumps(built.model_dump(mode="json", exclude={"members"})) == json.dumps(old)


@pytest.mark.slow  # a fresh interpreter (subprocess)
def test_the_modules_vllm_workers_import_stay_light():
    code = ("import sys; import shared.weight_sync.group_receiver, shared.weight_sync.ipc; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'pydantic', 'requests', 'fastapi', "
            "'transformers', 'ref_server', 'generator', 'learner'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
