"""The learner session's endpoints (``/v1/learner/session``: register, renew, end) and the check every report and
upload of the learner goes through (:func:`check_learner`, used by the hub's and the relay's routes). The session
itself is :class:`ref_server.session.LearnerSessionStore`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.concurrency import run_in_threadpool

from ref_server.http import State
from ref_server.session import NotTheLearner, SessionTaken
from shared.protocol.client import LEARNER_SESSION_HEADER
from shared.protocol.records import MAX_VERSION
from shared.weight_sync.layout import Layout

router = APIRouter(tags=["weights"])


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
        state.session.check(request.headers.get(LEARNER_SESSION_HEADER))
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
        session, resumed = await run_in_threadpool(state.session.register, body.version, layout,
                                                   body.resume_session, state.weights.drop_mismatched)
    except SessionTaken as exc:
        raise HTTPException(409, f"registration refused: {exc}") from None
    # the earlier session's leases: its learner will not train them (a resumed one keeps what its checkpoint holds)
    released, kept = await run_in_threadpool(state.hub.hand_over, body.trained_batches if resumed else [])
    dropped = await run_in_threadpool(state.hub.report_version, body.version, body.groups_per_step, True)
    return {"session": session, "resumed": resumed, "version": body.version, "dropped_stale": dropped,
            "released_groups": released, "kept_leases": kept, "session_ttl_s": state.session.ttl_s}


@router.post("/v1/learner/session/renew")
async def renew_learner_session(request: Request, state: State) -> dict:
    """The registered learner's heartbeat (X-Learner-Session): its session stays live. 409 from anyone else."""
    try:
        state.session.check(request.headers.get(LEARNER_SESSION_HEADER))
    except NotTheLearner as exc:
        raise HTTPException(409, f"heartbeat refused: {exc}") from None
    return {"session_ttl_s": state.session.ttl_s}


@router.delete("/v1/learner/session")
async def end_learner_session(request: Request, state: State) -> dict:
    """The registered learner exits (X-Learner-Session): a new learner may register at once. 409 from anyone
    else."""
    try:
        await run_in_threadpool(state.session.end, request.headers.get(LEARNER_SESSION_HEADER))
    except NotTheLearner as exc:
        raise HTTPException(409, f"ending the session refused: {exc}") from None
    return {"ended": True}
