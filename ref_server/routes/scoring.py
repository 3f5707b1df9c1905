"""``POST /v1/logprobs``: per-token reference logprobs for any tool (JSON, or safetensors for throughput)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, StrictInt, ValidationError

from ref_server.routes.common import OCTET, State, read_body
from ref_server.scorer import Row, ScorerBusy, ScoringError
from ref_server.state import ServerState
from shared.protocol import MIN_TEMPERATURE, decode_logprob_request, encode_logprob_response
from shared.wire import WireError

router = APIRouter(tags=["scoring"])


class LogprobRequest(BaseModel):
    """JSON body of ``POST /v1/logprobs``."""

    input_ids: list[list[StrictInt]] = Field(description="Token ids of each row: prompt then completion.")
    prompt_lengths: list[StrictInt] = Field(description="Prompt tokens at the start of each row (>= 1).")
    temperature: float = Field(1.0, ge=MIN_TEMPERATURE, allow_inf_nan=False,
                               description="Logits are divided by this before the softmax.")


class LogprobResponse(BaseModel):
    logprobs: list[list[float]] = Field(description="Row i: one logprob per token after prompt_lengths[i].")


def validate_rows(state: ServerState, input_ids: list[list[int]], prompt_lengths: list[int]) -> list[Row]:
    """Rows the scorer can take, or a 413/422 naming the first problem."""
    if not input_ids:
        raise HTTPException(422, "input_ids is empty: send at least one row")
    if len(input_ids) != len(prompt_lengths):
        raise HTTPException(422, f"input_ids has {len(input_ids)} rows but prompt_lengths has {len(prompt_lengths)}")
    total = sum(len(row) for row in input_ids)
    if total > state.max_request_tokens:
        raise HTTPException(413, f"request holds {total} tokens, more than the {state.max_request_tokens}-token "
                            "budget")
    rows = []
    for i, (ids, plen) in enumerate(zip(input_ids, prompt_lengths)):
        if not 1 <= plen <= len(ids):
            raise HTTPException(422, f"row {i}: prompt_length {plen} must be between 1 and the row length {len(ids)}")
        if state.max_context is not None and len(ids) > state.max_context:
            raise HTTPException(422, f"row {i}: {len(ids)} tokens exceed the model's context of {state.max_context}")
        bad = next((j for j, t in enumerate(ids) if not 0 <= t < (state.vocab_size or 0)), None)
        if bad is not None:
            raise HTTPException(422, f"row {i}, position {bad}: token id {ids[bad]} is outside [0, {state.vocab_size})")
        rows.append(Row(ids, plen))
    return rows


def _parse(body: bytes, binary: bool) -> tuple[list[list[int]], list[int], float]:
    if binary:
        try:
            return decode_logprob_request(body)
        except WireError as exc:
            raise HTTPException(400, str(exc)) from None
    try:
        parsed = LogprobRequest.model_validate_json(body)
    except ValidationError as exc:
        problems = [{"loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors(include_url=False)]
        raise HTTPException(422, problems) from None
    return parsed.input_ids, parsed.prompt_lengths, parsed.temperature


@router.post("/v1/logprobs", response_model=LogprobResponse, openapi_extra={"requestBody": {"required": True,
             "content": {"application/json": {"schema": LogprobRequest.model_json_schema()},
                         OCTET: {"schema": {"type": "string", "format": "binary",
                                            "description": "safetensors: input_ids (flat), row_lengths, "
                                                           "prompt_lengths"}}}}})
async def logprobs(request: Request, state: State):
    """Per-token reference logprobs of every row's tokens after its prompt (JSON or safetensors)."""
    if state.scorer is None:
        raise HTTPException(503, "no reference model is loaded (beta = 0 mode)")
    body = await read_body(request, state.max_request_bytes)
    binary = request.headers.get("content-type", "").split(";")[0].strip() == OCTET
    input_ids, prompt_lengths, temperature = _parse(body, binary)
    rows = validate_rows(state, input_ids, prompt_lengths)
    try:
        future = state.scorer.submit(rows, temperature)
    except ScorerBusy as exc:
        raise HTTPException(503, str(exc), {"Retry-After": "1"}) from None
    try:
        result = await asyncio.wrap_future(future)
    except ScoringError as exc:
        raise HTTPException(503, f"scoring failed: {exc}", {"Retry-After": "5"}) from None
    request.app.state.metrics.tokens_scored.inc(sum(t.numel() for t in result))
    if binary:
        return Response(encode_logprob_response(result), media_type=OCTET)
    return {"logprobs": [t.tolist() for t in result]}
