"""Joined reference scorers (``grpo scorer --hub URL``): register, pull scoring jobs, post results, heartbeat, leave.

* ``POST /v1/scorers``: register; answers the scorer's id, the hub's instance id, the lease and the model it must
  load. A scorer whose model differs (name, vocabulary size or config digest) is refused 409 with the reason.
  ``"role": "teacher"`` (``grpo scorer --teacher``) joins the teacher's pool (ref_server.teacher_model) instead of
  the reference's; every later route finds the scorer's pool by its id.
* ``GET /v1/scorers/{id}/work?wait_s=``: long poll; 200 with a safetensors job (``X-Job-Id``) or 204.
* ``POST /v1/scorers/{id}/results/{job}``: the job's safetensors result; 200 ``{"status": "scored"|"duplicate"}``,
  422 with the reason for a result that does not fit its job (the job goes back to the queue), 404 for an unknown
  job or scorer.
* ``POST /v1/scorers/{id}/jobs/{job}/failed`` ``{"reason"}``: the scorer could not score a job it holds (its forward
  raised); the job goes back to the queue at once, counted against the job and the scorer (``requeued``/``unknown``).
* ``POST /v1/scorers/{id}/heartbeat`` (renews its leases; 404: register again), ``DELETE /v1/scorers/{id}`` (leave:
  its jobs go back to the queue at once).
* A scorer quarantined for bad results (``ref_server.scorer_max_bad_results``, :mod:`ref_server.scorer_pool.pool`) is
  answered 403 with the reason on every route, registration under its name included: it must stop.
Every route needs the hub's token like any other; a result body is bounded by ``ref_server.max_request_bytes``.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Path, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from ref_server.http import OCTET, State, binary_body, long_poll, read_body
from ref_server.scorer_pool.job_wire import BadResult, encode_job, result_job_id
from ref_server.scorer_pool.pool import ScorerPool, ScorerQuarantined, UnknownJob, UnknownScorer
from ref_server.state import ServerState
from shared.protocol.wire import WireError

router = APIRouter(tags=["scorers"])
LONG_POLL_SLICE_S = 0.5  # a long-polling scorer is checked this often for having gone away
Id = Annotated[str, Path(max_length=64)]  # looked up, never used as a path or a name


class ScorerRegistration(BaseModel):
    name: str = Field(max_length=128, description="The scorer's name (grpo scorer --id), for the logs.")
    model: str | None = Field(None, max_length=512, description="The reference model's folder name.")
    vocab_size: int = Field(ge=1, description="The loaded model's vocabulary size.")
    config_digest: str | None = Field(None, max_length=128, description="sha256 of the model's config.json "
                                      "(ref_server.scorer_pool.remote.model_identity).")
    role: Literal["reference", "teacher"] = Field("reference", description="Which model the scorer serves: the "
                                                  "reference (ref_server.model) or the teacher (teacher_model).")


def _pool(state: ServerState, scorer_id: str | None = None, role: str = "reference") -> ScorerPool:
    """The pool of ``role``, or the one that gave out ``scorer_id`` (the reference's when none did: it answers
    404, register again); 404 when this hub scores no such model."""
    teacher = state.teacher if isinstance(state.teacher, ScorerPool) else None
    if role == "teacher" or (scorer_id is not None and teacher is not None and teacher.owns(scorer_id)):
        if teacher is None:
            raise HTTPException(404, "this hub scores no teacher (no ref_server.teacher_model): it takes no "
                                "teacher scorers")
        return teacher
    if not isinstance(state.scorer, ScorerPool):
        if teacher is not None and scorer_id is not None:
            return teacher  # an id of neither pool: the teacher's answers 404 (register again)
        raise HTTPException(404, "this hub scores no reference logprobs (no ref_server.model, or beta = 0): "
                            "it takes no scorers")
    return state.scorer


def _model_mismatch(state: ServerState, body: ScorerRegistration, pool: ScorerPool) -> str | None:
    teacher = body.role == "teacher"
    expected = (state.teacher_identity if teacher else state.model_identity) or {}
    vocab_size = pool.vocab_size if teacher else state.vocab_size
    if body.vocab_size != vocab_size:
        return f"the scorer's model has vocab_size {body.vocab_size}, the hub's {vocab_size}"
    for key in ("model", "config_digest"):
        theirs, ours = getattr(body, key), expected.get(key)
        if ours is not None and theirs is not None and theirs != ours:
            where = "ref_server.teacher_model" if teacher else "ref_server.model"
            return f"the scorer's model {key} is {theirs!r}, the hub's is {ours!r} ({where})"
    return None


@router.post("/v1/scorers")
async def register(body: ScorerRegistration, state: State) -> dict:
    """Join as a reference (or teacher) scorer; 409 with the reason when its model is not the hub's."""
    pool = _pool(state, role=body.role)
    problem = _model_mismatch(state, body, pool)
    if problem is not None:
        raise HTTPException(409, problem)
    try:
        scorer_id = pool.register(body.name)
    except ScorerQuarantined as exc:
        raise HTTPException(403, str(exc)) from None
    identity = state.teacher_identity if body.role == "teacher" else state.model_identity
    return {"scorer_id": scorer_id, "hub_instance": state.instance, "lease_s": pool.lease_s,
            "model": (identity or {}).get("model"), "vocab_size": pool.vocab_size if body.role == "teacher"
            else state.vocab_size}


def _known(pool: ScorerPool, fn, *args):
    try:
        return fn(*args)
    except UnknownScorer as exc:
        raise HTTPException(404, str(exc.args[0])) from None
    except ScorerQuarantined as exc:
        raise HTTPException(403, str(exc)) from None


@router.get("/v1/scorers/{scorer_id}/work")
async def work(request: Request, scorer_id: Id, state: State,
               wait_s: float = Query(0.0, ge=0, le=60, allow_inf_nan=False,
                                     description="Seconds to wait for a job.")) -> Response:
    """The next scoring job (safetensors, leased to this scorer) or 204 when none came within ``wait_s``."""
    pool = _pool(state, scorer_id)
    deadline = time.monotonic() + min(wait_s, state.max_long_poll_s)
    while True:
        wait = min(max(deadline - time.monotonic(), 0.0), LONG_POLL_SLICE_S)
        spec = await long_poll(state, _known, pool, pool.take, scorer_id, wait)
        if await request.is_disconnected():
            if spec is not None:
                pool.release(scorer_id, spec.job_id)
            return Response(status_code=204)
        if spec is not None:
            data = await run_in_threadpool(encode_job, spec)
            return Response(data, media_type=OCTET, headers={"X-Job-Id": spec.job_id})
        if time.monotonic() >= deadline:
            return Response(status_code=204)


@router.post("/v1/scorers/{scorer_id}/results/{job_id}",
             openapi_extra=binary_body("safetensors: logprobs (flat float32), top_logprobs and top_ids for top-k"))
async def result(request: Request, scorer_id: Id, job_id: Id, state: State) -> dict:
    """A scored job: resolves it if it is the first valid result (``scored``), else ``duplicate`` (ignored)."""
    body = await read_body(request, state.max_request_bytes)
    try:  # malformed bytes are a 400 on every route, whatever else is wrong
        named = result_job_id(body)
    except WireError as exc:
        raise HTTPException(400, str(exc)) from None
    pool = _pool(state, scorer_id)
    if named != job_id:
        problem = f"the result names job {named!r}, the path {job_id!r}"
        await run_in_threadpool(_known, pool, pool.bad_result, scorer_id, problem)
        raise HTTPException(422, problem)
    try:
        status = await run_in_threadpool(_known, pool, pool.finish, scorer_id, job_id, body)
    except UnknownJob as exc:
        raise HTTPException(404, str(exc.args[0])) from None
    except BadResult as exc:
        raise HTTPException(422, f"scoring result for job {job_id}: {exc}; the job goes back to the queue") from None
    return {"status": status}


class JobFailure(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = Field(..., min_length=1, max_length=2000, description="Why the scorer could not score the job.")


@router.post("/v1/scorers/{scorer_id}/jobs/{job_id}/failed")
async def failed(scorer_id: Id, job_id: Id, body: JobFailure, state: State) -> dict:
    """The scorer could not score a job it holds (its forward raised): the job goes back to the queue at once, the
    failure counted against the job and the scorer (``requeued``; ``unknown``: it does not hold that job)."""
    pool = _pool(state, scorer_id)
    return {"status": await run_in_threadpool(_known, pool, pool.fail, scorer_id, job_id, body.reason)}


@router.post("/v1/scorers/{scorer_id}/heartbeat")
async def heartbeat(scorer_id: Id, state: State) -> dict:
    """The scorer is alive: its leases run another lease; 404 when the hub does not know it (register again)."""
    pool = _pool(state, scorer_id)
    held = _known(pool, pool.heartbeat, scorer_id)
    return {"jobs": held, "lease_s": pool.lease_s, "hub_instance": state.instance}


@router.delete("/v1/scorers/{scorer_id}")
async def leave(scorer_id: Id, state: State) -> dict:
    """The scorer stops: the jobs it holds go back to the queue for the others at once."""
    pool = _pool(state, scorer_id)
    return {"requeued": _known(pool, pool.leave, scorer_id)}
