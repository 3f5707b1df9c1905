"""The FastAPI application: reference logprobs, rollout hub, weight relay, health and metrics.

Every bad input is answered with a 4xx and ``{"detail": ...}`` naming the problem; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass

from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, Field, StrictInt, ValidationError
from starlette.concurrency import run_in_threadpool

from ref_server.hub import HubFull, RolloutHub
from ref_server.metrics import ServerMetrics
from ref_server.scorer import ReferenceScorer, Row, ScorerBusy, ScoringError
from ref_server.weights import WeightsConflict, WeightsRejected, WeightsTooLarge, WeightStore
from shared.protocol import decode_logprob_request, encode_logprob_response
from shared.wire import WireError

OCTET = "application/octet-stream"


class HTTPProblem(Exception):
    """Raised anywhere in a handler to answer ``status`` with ``{"detail": detail}``."""

    def __init__(self, status: int, detail, headers: dict[str, str] | None = None) -> None:
        super().__init__(str(detail))
        self.status, self.detail, self.headers = status, detail, headers or {}


class LogprobRequest(BaseModel):
    """JSON body of ``POST /v1/logprobs``."""

    input_ids: list[list[StrictInt]] = Field(description="Token ids of each row: prompt then completion.")
    prompt_lengths: list[StrictInt] = Field(description="Prompt tokens at the start of each row (>= 1).")
    temperature: float = Field(1.0, gt=0, description="Logits are divided by this before the softmax.")


class LogprobResponse(BaseModel):
    logprobs: list[list[float]] = Field(description="Row i: one logprob per token after prompt_lengths[i].")


class VersionReport(BaseModel):
    version: StrictInt = Field(ge=0, description="The learner's current policy version.")


@dataclass
class ServerState:
    """What the app serves; built by ``ref_server.server`` (or by tests with a tiny model)."""

    scorer: ReferenceScorer | None
    hub: RolloutHub
    weights: WeightStore
    model_name: str | None
    vocab_size: int | None
    max_context: int | None
    max_request_bytes: int
    max_request_tokens: int
    max_long_poll_s: float
    token: str | None = None


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPProblem(413, f"request body of {declared} bytes exceeds the {limit}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPProblem(413, f"request body exceeds the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def validate_rows(state: ServerState, input_ids: list[list[int]], prompt_lengths: list[int],
                  temperature: float) -> list[Row]:
    if not input_ids:
        raise HTTPProblem(422, "input_ids is empty: send at least one row")
    if len(input_ids) != len(prompt_lengths):
        raise HTTPProblem(422, f"input_ids has {len(input_ids)} rows but prompt_lengths has {len(prompt_lengths)}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise HTTPProblem(422, f"temperature must be a finite number > 0, got {temperature}")
    total = sum(len(row) for row in input_ids)
    if total > state.max_request_tokens:
        raise HTTPProblem(413, f"request holds {total} tokens, more than the {state.max_request_tokens}-token budget")
    rows = []
    for i, (ids, plen) in enumerate(zip(input_ids, prompt_lengths)):
        if not 1 <= plen <= len(ids):
            raise HTTPProblem(422, f"row {i}: prompt_length {plen} must be between 1 and the row length {len(ids)}")
        if state.max_context is not None and len(ids) > state.max_context:
            raise HTTPProblem(422, f"row {i}: {len(ids)} tokens exceed the model's context of {state.max_context}")
        bad = next((j for j, t in enumerate(ids) if not 0 <= t < (state.vocab_size or 0)), None)
        if bad is not None:
            raise HTTPProblem(422, f"row {i}, position {bad}: token id {ids[bad]} is outside [0, {state.vocab_size})")
        rows.append(Row(ids, plen))
    return rows


def create_app(state: ServerState, on_ready: Callable[[], None] | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if on_ready is not None:
            on_ready()
        yield

    app = FastAPI(title="grpo-stack reference server", version="1", lifespan=lifespan,
                  description="Reference logprobs for any tool, the rollout hub and the weight relay.")
    metrics = ServerMetrics(state)
    app.state.server = state
    app.state.metrics = metrics

    @app.exception_handler(HTTPProblem)
    async def _problem(request: Request, exc: HTTPProblem) -> JSONResponse:
        return JSONResponse({"detail": exc.detail}, status_code=exc.status, headers=exc.headers)

    @app.middleware("http")
    async def _auth_and_metrics(request: Request, call_next):
        started = time.perf_counter()
        path = request.url.path
        if state.token is not None and path != "/healthz":
            supplied = request.headers.get("authorization", "")
            if not hmac.compare_digest(supplied.encode(), f"Bearer {state.token}".encode()):
                response = JSONResponse({"detail": "missing or wrong bearer token"}, status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                metrics.observe(request, response.status_code, started)
                return response
        response = await call_next(request)
        metrics.observe(request, response.status_code, started)
        return response

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok", "model": state.model_name, "reference_model_loaded": state.scorer is not None,
                "vocab_size": state.vocab_size, "max_context": state.max_context,
                "queue_depth": state.hub.depth(), "weights_version": state.weights.current,
                "learner_version": state.hub.learner_version}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/logprobs", response_model=LogprobResponse, openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": LogprobRequest.model_json_schema()},
        OCTET: {"schema": {"type": "string", "format": "binary",
                           "description": "safetensors: input_ids (flat), row_lengths, prompt_lengths"}}}}})
    async def logprobs(request: Request):
        """Per-token reference logprobs of every row's tokens after its prompt (JSON or safetensors)."""
        if state.scorer is None:
            raise HTTPProblem(503, "no reference model is loaded (beta = 0 mode)")
        body = await read_body(request, state.max_request_bytes)
        binary = request.headers.get("content-type", "").split(";")[0].strip() == OCTET
        if binary:
            try:
                input_ids, prompt_lengths, temperature = decode_logprob_request(body)
            except WireError as exc:
                raise HTTPProblem(400, str(exc)) from None
        else:
            try:
                parsed = LogprobRequest.model_validate_json(body)
            except ValidationError as exc:
                problems = [{"loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors(include_url=False)]
                raise HTTPProblem(422, problems) from None
            input_ids, prompt_lengths, temperature = parsed.input_ids, parsed.prompt_lengths, parsed.temperature
        rows = validate_rows(state, input_ids, prompt_lengths, temperature)
        try:
            future = state.scorer.submit(rows, temperature)
        except ScorerBusy as exc:
            raise HTTPProblem(503, str(exc), {"Retry-After": "1"}) from None
        try:
            result = await asyncio.wrap_future(future)
        except ScoringError as exc:
            raise HTTPProblem(503, f"scoring failed: {exc}", {"Retry-After": "5"}) from None
        metrics.tokens_scored.inc(sum(t.numel() for t in result))
        if binary:
            return Response(encode_logprob_response(result), media_type=OCTET)
        return {"logprobs": [t.tolist() for t in result]}

    @app.post("/v1/rollouts", openapi_extra={"requestBody": {"required": True, "content": {
        OCTET: {"schema": {"type": "string", "format": "binary", "description": "an encoded RolloutGroup"}}}}})
    async def upload_rollout(request: Request) -> JSONResponse:
        """Queue one rollout group. 429 with Retry-After when the queue is full; the answer carries its depth."""
        body = await read_body(request, state.max_request_bytes)
        try:
            answer = await run_in_threadpool(state.hub.put, body)
        except HubFull as exc:
            raise HTTPProblem(429, str(exc), {"Retry-After": "1", "X-Queue-Depth": str(state.hub.depth())}) from None
        except (WireError, ValueError) as exc:
            raise HTTPProblem(422 if not isinstance(exc, WireError) else 400, str(exc)) from None
        return JSONResponse(answer, headers={"X-Queue-Depth": str(answer["queue_depth"])})

    @app.get("/v1/batch", responses={200: {"content": {OCTET: {}}}, 204: {"description": "not enough groups"}})
    async def take_batch(num_groups: int = Query(ge=1, le=4096, description="Groups in the batch."),
                         timeout: float = Query(0.0, ge=0, description="Seconds to wait for enough groups.")):
        """The oldest ready groups as one encoded TrainBatch (reference logprobs attached); 204 if too few."""
        wait = min(timeout, state.max_long_poll_s)
        batch = await run_in_threadpool(state.hub.take, num_groups, wait)
        headers = {"X-Queue-Depth": str(state.hub.depth())}
        if batch is None:
            return Response(status_code=204, headers=headers)
        return Response(batch.to_bytes(), media_type=OCTET, headers=headers)

    @app.post("/v1/learner/version")
    async def learner_version(report: VersionReport) -> dict:
        """The learner's current policy version; groups it makes stale are dropped (and counted)."""
        try:
            dropped = await run_in_threadpool(state.hub.report_version, report.version)
        except ValueError as exc:
            raise HTTPProblem(409, str(exc)) from None
        return {"version": report.version, "dropped_stale": dropped, "queue_depth": state.hub.depth()}

    @app.get("/v1/hub/stats")
    async def hub_stats() -> dict:
        return {**asdict(state.hub.counters), "queue_depth": state.hub.depth(),
                "ready": state.hub.ready_depth(), "capacity": state.hub.capacity,
                "learner_version": state.hub.learner_version, "max_staleness": state.hub.max_staleness}

    @app.get("/v1/weights")
    async def weights_version() -> dict:
        """The newest published weights version (null before the first)."""
        return {"version": state.weights.current}

    @app.put("/v1/weights/{version}", openapi_extra={"requestBody": {"required": True, "content": {
        OCTET: {"schema": {"type": "string", "format": "binary", "description": "a safetensors state dict"}}}}})
    async def upload_weights(version: int, request: Request) -> dict:
        """Publish a new weights version, streamed to disk (never held in memory whole)."""
        try:
            size = await state.weights.receive(version, request.stream())
        except WeightsTooLarge as exc:
            raise HTTPProblem(413, str(exc)) from None
        except WeightsConflict as exc:
            raise HTTPProblem(409, str(exc)) from None
        except WeightsRejected as exc:
            raise HTTPProblem(400, str(exc)) from None
        return {"version": version, "bytes": size}

    @app.get("/v1/weights/{version}", responses={200: {"content": {OCTET: {}}}})
    async def download_weights(version: int):
        path = state.weights.path_for(version)
        if path is None:
            raise HTTPProblem(404, f"weights version {version} is not available (current: {state.weights.current})")
        return FileResponse(path, media_type=OCTET, filename=path.name)

    return app
