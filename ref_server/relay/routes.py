"""The weight relay's endpoints (the learner publishes versions, generators download them) and the weight-sync
rendezvous (/v1/weights/sync/...) through which the learner and the generators form their process groups.

Only the HTTP side lives here: the relay's files are :class:`shared.weight_sync.relay_store.WeightStore`, the
rendezvous is :class:`shared.weight_sync.rendezvous.SyncRendezvous`, the bodies are
:mod:`shared.protocol.weight_sync_messages`; uploads come only from the learner session
(:mod:`ref_server.session_routes`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, Request
from starlette.concurrency import run_in_threadpool

from ref_server.http import OCTET, State, binary_body
from ref_server.relay.open_file import OpenFileResponse, open_version
from ref_server.session_routes import check_learner
from shared.protocol.weight_sync_messages import (
    Announcement,
    JoinRequest,
    MemberAnswer,
    MemberPoll,
    MemberReport,
    OfferPost,
    SenderInfo,
    SenderWork,
)
from shared.weight_sync.relay_store import WeightsConflict, WeightsRejected, WeightsTooLarge
from shared.weight_sync.rendezvous import RendezvousError

router = APIRouter(tags=["weights"])
VersionPath = Annotated[int, Path(ge=0, lt=10**10, description="Weights version (the learner's policy version).")]


@router.get("/v1/weights")
async def weights_version(state: State) -> dict:
    """The newest published weights version (null before the first)."""
    return {"version": state.weights.current}


# -- weight-sync rendezvous (shared/protocol/weight_sync_messages.py tells the sequence) ------------------------
def _rendezvous_error(exc: RendezvousError) -> HTTPException:
    return HTTPException(exc.status, str(exc))


@router.get("/v1/weights/sync")
async def sync_status(state: State) -> dict:
    """The rendezvous at a glance: the registered sender (if any), the announced version, members per state."""
    return state.sync.summary() | {"relay_version": state.weights.current}


@router.put("/v1/weights/sync/sender")
async def register_sender(info: SenderInfo, state: State) -> dict:
    """The learner's sender registers (again after a restart: members of the old one are sent to rejoin)."""
    state.sync.register_sender(info)
    return {"registered": info.sender_id}


@router.delete("/v1/weights/sync/sender/{sender_id}")
async def unregister_sender(sender_id: str, state: State) -> dict:
    state.sync.unregister_sender(sender_id)
    return {"unregistered": sender_id}


@router.post("/v1/weights/sync/announce")
async def announce(body: Announcement, state: State) -> dict:
    """The sender holds ``version`` in its buffer: members that poll are told to receive it (and ask the sender
    for it through their group)."""
    try:
        state.sync.announce(body.sender_id, body.version)
    except RendezvousError as exc:
        raise _rendezvous_error(exc) from None
    return {"announced": body.version}


@router.get("/v1/weights/sync/work")
async def sender_work(state: State, sender_id: str,
                      wait_s: Annotated[float, Query(ge=0, le=60)] = 0.0) -> SenderWork:
    """Long-poll of the sender: join requests to answer and members that stopped polling."""
    try:
        return await state.sync.work(sender_id, min(wait_s, state.max_long_poll_s))
    except RendezvousError as exc:
        raise _rendezvous_error(exc) from None


@router.post("/v1/weights/sync/offers")
async def post_offer(body: OfferPost, state: State) -> dict:
    try:
        state.sync.offer(body.sender_id, body.offer)
    except RendezvousError as exc:
        raise _rendezvous_error(exc) from None
    return {"offered": body.offer.member_id}


@router.post("/v1/weights/sync/members/{member_id}/state")
async def member_state(member_id: str, body: MemberReport, state: State) -> dict:
    try:
        state.sync.set_state(body.sender_id, member_id, body.state, body.reason, body.version)
    except RendezvousError as exc:
        raise _rendezvous_error(exc) from None
    return {"member_id": member_id, "state": body.state}


@router.post("/v1/weights/sync/members")
async def join(request: JoinRequest, state: State) -> dict:
    """A generator asks to join; the answer is its member id (the offer comes through polling)."""
    try:
        return {"member_id": state.sync.join(request)}
    except RendezvousError as exc:
        raise _rendezvous_error(exc) from None


@router.post("/v1/weights/sync/members/{member_id}/poll")
async def member_poll(member_id: str, body: MemberPoll, state: State) -> MemberAnswer:
    """Between engine calls: connect (with the offer), receive (the announced version), wait, idle or rejoin."""
    return await state.sync.poll(member_id, body.version, min(body.wait_s, state.max_long_poll_s))


@router.delete("/v1/weights/sync/members/{member_id}")
async def leave(member_id: str, state: State) -> dict:
    try:
        state.sync.leave(member_id)
    except RendezvousError as exc:
        raise _rendezvous_error(exc) from None
    return {"left": member_id}


# -- the relay's versioned files (after /v1/weights/sync/...: 'sync' is not a version) ------------------------
@router.put("/v1/weights/{version}", openapi_extra=binary_body("a safetensors state dict"))
async def upload_weights(request: Request, version: VersionPath,
                         state: State) -> dict:
    """Publish a new weights version, streamed to disk (never held in memory whole). Refused (409) from anyone but
    the registered learner session or beyond ``max_version_ahead``; refused (400) when its tensors are not the
    registered layout's (names, dtypes, shapes), naming the first difference."""
    check_learner(request, state, version, "weights upload")
    try:
        size = await state.weights.receive(version, request.stream())
    except WeightsTooLarge as exc:
        raise HTTPException(413, str(exc)) from None
    except WeightsConflict as exc:
        raise HTTPException(409, str(exc)) from None
    except WeightsRejected as exc:
        raise HTTPException(400, str(exc)) from None
    return {"version": version, "bytes": size}


@router.get("/v1/weights/{version}", responses={200: {"content": {OCTET: {}}}})
async def download_weights(version: VersionPath, state: State):
    """A stored version, opened here: one pruned meanwhile is a 404 (the generator reads the current version
    again), never a 500 (see :mod:`ref_server.relay.open_file`)."""
    path = state.weights.path_for(version)
    file = await run_in_threadpool(open_version, path)
    if file is None:
        raise HTTPException(404, f"weights version {version} is not available (current: {state.weights.current})")
    return OpenFileResponse(file, path.name, OCTET)
