"""The weight relay's endpoints (the learner publishes versions, generators download them) and the weight-sync
rendezvous (/v1/weights/sync/...) through which the learner and the generators form their process groups.

Only the HTTP side lives here: the relay's files are :class:`shared.weight_sync.relay_store.WeightStore`, the
rendezvous is :class:`shared.weight_sync.rendezvous.SyncRendezvous`, the bodies are
:mod:`shared.protocol.weight_sync_messages`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.concurrency import run_in_threadpool

from ref_server.http import OCTET, State, binary_body
from ref_server.relay.open_file import OpenFileResponse, open_version
from shared.protocol.client import LEARNER_SESSION_HEADER
from shared.protocol.records import MAX_VERSION
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
from shared.weight_sync.layout import Layout
from shared.weight_sync.relay_store import (
    NotTheLearner,
    SessionTaken,
    WeightsConflict,
    WeightsRejected,
    WeightsTooLarge,
)
from shared.weight_sync.rendezvous import RendezvousError

router = APIRouter(tags=["weights"])
VersionPath = Annotated[int, Path(ge=0, lt=10**10, description="Weights version (the learner's policy version).")]


# -- the learner's registration: versions and weights are scoped to the learner that registered -------------
class LearnerRegistration(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: StrictInt = Field(ge=0, lt=MAX_VERSION, description="The version the learner holds now (it may be "
                               "lower than the hub's: a registration resets it).")
    groups_per_step: StrictInt | None = Field(None, ge=1, le=1_000_000, description="The learner's global batch in "
                                              "groups (paces the generators).")
    layout: list[tuple[str, str, list[Annotated[int, Field(ge=0)]]]] | None = Field(
        None, max_length=1_000_000, description="[name, dtype, shape] of each tensor of the model, in order: weights "
        "uploads must match it. Omitted: the registered layout stays.")
    resume_session: str | None = Field(None, min_length=1, max_length=64, description="A resumed learner's session "
                                       "id (kept in its checkpoint folder): it takes that session back, even while "
                                       "it is live. Without it, a registration is refused while another session is "
                                       "live (ref_server.learner_session_ttl_s).")
    trained_batches: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(
        [], max_length=100_000, description="With resume_session: batch ids whose groups the learner's checkpoint "
        "holds and whose acknowledgement may not have reached the hub; their leases stay held (the learner "
        "acknowledges them next). Every other lease held by the earlier session is released at once.")


def newest_allowed(state) -> int:
    """The highest version a report, an upload or a registration may name: ``ref_server.max_version_ahead`` past
    the newest the hub knows (the learner's reported version, the relay's newest weights)."""
    return max(state.hub.learner_version, state.weights.current or 0) + state.max_version_ahead


def check_learner(request: Request, state, version: int, what: str) -> None:
    """A report or upload of ``version``: from the registered learner session (once one registered), and at most
    ``max_version_ahead`` past the newest version the hub knows. 409 with the reason otherwise."""
    try:
        state.weights.check_session(request.headers.get(LEARNER_SESSION_HEADER))
    except NotTheLearner as exc:
        raise HTTPException(409, f"{what} refused: {exc}") from None
    if version > newest_allowed(state):
        # a runaway version makes every queued and future group look stale and stalls the run
        raise HTTPException(409, f"{what} refused: version {version} is more than {state.max_version_ahead} "
                            f"(ref_server.max_version_ahead) ahead of the hub's {newest_allowed(state) - state.max_version_ahead}")


@router.post("/v1/learner/session")
async def register_learner(body: LearnerRegistration, state: State) -> dict:
    """A learner starts: a new session (version reports and weights uploads must carry its id in the
    X-Learner-Session header; an earlier session's are refused; refused, 409, while another session is live unless
    it presents that session's id as ``resume_session``), the earlier session's leases released at once (but those a
    resuming learner's checkpoint holds), its version (which may move the hub's back: the
    way to recover from a wrong version without restarting the hub) and its model's layout (uploads that do not
    match it are refused). The version may be at most ``ref_server.max_version_ahead`` past the hub's newest."""
    if body.version > newest_allowed(state):
        raise HTTPException(409, f"registration refused: version {body.version} is more than "
                            f"{state.max_version_ahead} (ref_server.max_version_ahead) ahead of the hub's newest")
    try:
        layout = Layout.from_json(body.layout) if body.layout is not None else None
    except ValueError as exc:
        raise HTTPException(422, f"layout: {exc}") from None
    try:
        session, resumed = await run_in_threadpool(state.weights.register_learner, body.version, layout,
                                                   body.resume_session)
    except SessionTaken as exc:
        raise HTTPException(409, f"registration refused: {exc}") from None
    # the earlier session's leases: its learner will not train them (a resumed one keeps what its checkpoint holds)
    released, kept = await run_in_threadpool(state.hub.hand_over, body.trained_batches if resumed else [])
    dropped = await run_in_threadpool(state.hub.report_version, body.version, body.groups_per_step, True)
    return {"session": session, "resumed": resumed, "version": body.version, "dropped_stale": dropped,
            "released_groups": released, "kept_leases": kept, "session_ttl_s": state.weights.session_ttl_s}


@router.post("/v1/learner/session/renew")
async def renew_learner_session(request: Request, state: State) -> dict:
    """The registered learner's heartbeat (X-Learner-Session): its session stays live. 409 from anyone else."""
    try:
        state.weights.check_session(request.headers.get(LEARNER_SESSION_HEADER))
    except NotTheLearner as exc:
        raise HTTPException(409, f"heartbeat refused: {exc}") from None
    return {"session_ttl_s": state.weights.session_ttl_s}


@router.delete("/v1/learner/session")
async def end_learner_session(request: Request, state: State) -> dict:
    """The registered learner exits (X-Learner-Session): a new learner may register at once. 409 from anyone
    else."""
    try:
        await run_in_threadpool(state.weights.end_session, request.headers.get(LEARNER_SESSION_HEADER))
    except NotTheLearner as exc:
        raise HTTPException(409, f"ending the session refused: {exc}") from None
    return {"ended": True}


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
