"""The rollout hub's endpoints: generators upload groups, the learner leases batches and acknowledges them."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, StrictInt
from starlette.concurrency import run_in_threadpool

from ref_server.http import OCTET, State, binary_body, long_poll, read_body
from ref_server.hub.intake import HubFull
from ref_server.session_routes import check_learner
from shared.protocol.records import MAX_VERSION
from shared.protocol.wire import WireError, decode_messages

LONG_POLL_SLICE_S = 0.5  # a long-polling GET /v1/batch checks this often whether its client is still there
MAX_GROUPS_PER_UPLOAD = 4096  # one request's groups (the request's size is bounded by ref_server.max_request_bytes)

router = APIRouter(tags=["hub"])


class VersionReport(BaseModel):
    version: StrictInt = Field(ge=0, lt=MAX_VERSION, description="The learner's current policy version.")
    groups_per_step: StrictInt | None = Field(None, ge=1, le=1_000_000, description=(
        "Groups the learner trains per optimizer step, all ranks together: paces the generators "
        "(GET /v1/rollouts/budget). Omitted: the hub keeps what it was told before."))


class BatchIds(BaseModel):
    batch_ids: list[str] = Field(max_length=4096, description="Batch ids from GET /v1/batch (X-Batch-Id).")


class ReleasedBatches(BatchIds):
    batch_ids: list[str] = Field([], max_length=4096, description="Batch ids from GET /v1/batch (X-Batch-Id).")
    request_ids: list[Annotated[str, Field(max_length=64)]] = Field([], max_length=4096, description=(
        "request_id values of GET /v1/batch calls: the lease granted to each is handed back, and a call not granted "
        "yet grants nothing (a learner that stops while its long poll may be answered)."))


class RenewedBatches(BatchIds):
    trained: bool = Field(False, description="The learner has trained these batches and holds them only for its "
                          "next checkpoint: they no longer delay newly sampled groups (GET /v1/rollouts/budget).")


async def _queue(state, put, payload):
    """``put(payload)`` on the hub's thread pool, its refusals as HTTP errors: 429 with Retry-After when the queue
    is full, 400 for bytes that are not a message, 422 for a well-formed group the hub cannot take."""
    try:
        return await run_in_threadpool(put, payload)
    except HubFull as exc:
        raise HTTPException(429, str(exc), {"Retry-After": "1", "X-Queue-Depth": str(state.hub.depth())}) from None
    except WireError as exc:
        raise HTTPException(400, str(exc)) from None
    except ValueError as exc:  # ProtocolError, GroupRejected: well-formed bytes, unacceptable content
        raise HTTPException(422, str(exc)) from None


@router.post("/v1/rollouts", openapi_extra=binary_body("an encoded RolloutGroup"))
async def upload_rollout(request: Request, state: State) -> JSONResponse:
    """Queue one rollout group. 429 with Retry-After when the queue is full; the answer carries its depth."""
    body = await read_body(request, state.max_request_bytes)
    answer = await _queue(state, state.hub.put, body)
    return JSONResponse(answer, headers={"X-Queue-Depth": str(answer["queue_depth"])})


@router.post("/v1/rollouts/batch", openapi_extra=binary_body(
    "several encoded RolloutGroups in one container (shared.protocol.wire.encode_messages: U8 tensors message/0..N-1)"))
async def upload_rollouts(request: Request, state: State) -> JSONResponse:
    """Queue several rollout groups (an engine call's worth) in one request: one answer per group, in order.

    A bad group is refused alone: its answer is ``{"accepted": false, "refused": reason, "status": 400 or 422}``
    and the others are queued (400 for the whole request only when the container itself is malformed). 429 with
    Retry-After when the queue fills part-way: the groups before are queued, and the same request sent again answers
    them as duplicates."""
    body = await read_body(request, state.max_request_bytes)
    try:
        messages = await run_in_threadpool(decode_messages, body, MAX_GROUPS_PER_UPLOAD)  # big bodies: off the loop
    except WireError as exc:
        raise HTTPException(400, str(exc)) from None
    answers = await _queue(state, state.hub.put_many, messages)
    depth = state.hub.depth()
    return JSONResponse({"answers": answers, "queue_depth": depth}, headers={"X-Queue-Depth": str(depth)})


@router.get("/v1/rollouts/budget")
async def rollout_budget(state: State,
                         policy_version: int = Query(ge=0, lt=MAX_VERSION,
                                                     description="The version the generator samples with."),
                         wait_s: float = Query(0.0, ge=0, allow_inf_nan=False,
                                               description="Seconds to wait while nothing is wanted.")) -> dict:
    """How many groups sampled at ``policy_version`` the learner can still train within ``max_staleness``
    (``wanted``; null while the learner has not reported its step size). Waits up to ``wait_s`` while that is 0
    and the learner's version does not change. Generators ask before each engine call."""
    return await long_poll(state, state.hub.budget, policy_version, min(wait_s, state.max_long_poll_s))


@router.get("/v1/batch", responses={200: {"content": {OCTET: {}}}, 204: {"description": "not enough groups"}})
async def take_batch(request: Request, state: State,
                     num_groups: int = Query(ge=1, le=4096, description="Groups in the batch."),
                     timeout: float = Query(0.0, ge=0, allow_inf_nan=False,
                                            description="Seconds to wait for enough groups."),
                     min_version: int | None = Query(None, ge=0, lt=MAX_VERSION, description=(
                         "Oldest policy version the learner can train in this batch (it knows the version it will "
                         "train it at): older queued groups are dropped as stale first.")),
                     request_id: str | None = Query(None, min_length=1, max_length=64, description=(
                         "The learner's id for this call: POST /v1/batch/release can name it to hand back whatever it "
                         "grants, even before the answer arrives."))):
    """Lease the oldest ready groups as one encoded TrainBatch (reference logprobs attached); 204 if too few.

    Acknowledge it with ``POST /v1/batch/ack`` once trained; unacknowledged, its groups return to the queue after
    the hub's lease timeout. A long poll waits in slices and stops when its client has gone: a batch leased for a
    client that disconnected is handed back at once (front of the queue), not after the lease timeout."""
    deadline = time.monotonic() + min(timeout, state.max_long_poll_s)
    while True:
        wait = min(max(deadline - time.monotonic(), 0.0), LONG_POLL_SLICE_S)
        batch = await long_poll(state, state.hub.take, num_groups, wait, min_version, request_id)
        if await request.is_disconnected():
            if batch is not None:
                await run_in_threadpool(state.hub.release, [batch.batch_id])
            return Response(status_code=204)  # nobody reads it; the metrics count the request as the client's
        if batch is not None or time.monotonic() >= deadline:
            break
    headers = {"X-Queue-Depth": str(state.hub.depth())}
    if batch is None:
        return Response(status_code=204, headers=headers)
    return Response(batch.to_bytes(), media_type=OCTET, headers={**headers, "X-Batch-Id": batch.batch_id})


@router.post("/v1/batch/ack")
async def ack_batches(body: BatchIds, state: State) -> dict:
    """The learner applied these batches: their groups are consumed. Per id: acked, already, late or unknown."""
    return {"batches": await run_in_threadpool(state.hub.ack, body.batch_ids)}


@router.post("/v1/batch/release")
async def release_batches(body: ReleasedBatches, state: State) -> dict:
    """Hand back leases that will not be trained (a stopping learner): their groups are queued again at once, at
    the front. Per batch id: released or unknown; per request id: released, or cancelled (granted nothing yet)."""
    return {"batches": await run_in_threadpool(state.hub.release, body.batch_ids, body.request_ids)}


@router.post("/v1/batch/renew")
async def renew_leases(body: RenewedBatches, state: State) -> dict:
    """Keep these leases for another lease timeout (the learner acknowledges at its next checkpoint)."""
    return {"batches": await run_in_threadpool(state.hub.renew, body.batch_ids, body.trained),
            "lease_timeout_s": state.hub.lease_timeout_s}


@router.post("/v1/learner/version")
async def learner_version(report: VersionReport, request: Request, state: State) -> dict:
    """The learner's current policy version; groups it makes stale are dropped (and counted). 409 when it is older
    than the last, more than ``ref_server.max_version_ahead`` ahead, or not from the registered learner session."""
    check_learner(request, state, report.version, "version report")
    try:
        dropped = await run_in_threadpool(state.hub.report_version, report.version, report.groups_per_step)
    except ValueError as exc:
        raise HTTPException(409, str(exc)) from None
    await run_in_threadpool(state.session.note_version, report.version)  # kept across hub restarts
    return {"version": report.version, "dropped_stale": dropped, "queue_depth": state.hub.depth()}


@router.get("/v1/hub/stats")
async def hub_stats(state: State) -> dict:
    hub = state.hub
    leased = hub.leased_depth()  # first: it expires overdue leases, which moves groups and counters read below
    return {**asdict(hub.counters), "queue_depth": hub.depth(), "ready": hub.ready_depth(),
            "leased_groups": leased, "capacity": hub.capacity, "learner_version": hub.learner_version,
            "groups_per_step": hub.groups_per_step,
            "max_staleness": hub.max_staleness, "lease_timeout_s": hub.lease_timeout_s,
            "learner_session_ttl_s": state.session.ttl_s,
            "temperature": hub.temperature,
            # per model scored (reference, teacher): who scores it and the groups waiting for its logprobs
            "scoring_pools": state.scoring_health()}
