"""``POST /v1/logprobs``: per-token reference logprobs for any tool (JSON, or safetensors for throughput); the
teacher's (ref_server.teacher_model) for a request naming it (``"model": "teacher"`` or ``?model=teacher``)."""

from __future__ import annotations

import itertools

import numpy as np
import pydantic_core
import torch
from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, StrictInt, ValidationError
from starlette.concurrency import run_in_threadpool

from ref_server.http import OCTET, State, read_body
from ref_server.scoring.context import row_fits
from ref_server.scoring.scorer import Row, ScorerBusy, ScoringError
from ref_server.state import ServerState
from shared.protocol import strict_json
from shared.protocol.logprob_messages import decode_logprob_request_tensors, encode_logprob_response
from shared.protocol.records import MIN_TEMPERATURE
from shared.protocol.wire import WireError

router = APIRouter(tags=["scoring"])


class LogprobRequest(BaseModel):
    """JSON body of ``POST /v1/logprobs``."""

    input_ids: list[list[StrictInt]] = Field(description="Token ids of each row: prompt then completion.")
    prompt_lengths: list[StrictInt] = Field(description="Prompt tokens at the start of each row (>= 1).")
    temperature: float = Field(1.0, ge=MIN_TEMPERATURE, allow_inf_nan=False,
                               description="Logits are divided by this before the softmax.")
    model: str | None = Field(None, max_length=512, description="Which model scores: null or 'reference' (the "
                              "reference model), 'teacher' (ref_server.teacher_model), or either's folder name.")


class LogprobResponse(BaseModel):
    logprobs: list[list[float]] = Field(description="Row i: one logprob per token after prompt_lengths[i].")


def validate_rows(state: ServerState, input_ids: list[list[int]], prompt_lengths: list[int]) -> list[Row]:
    """Rows the scorer can take, or a 413/422 naming the first problem (JSON body: lists of Python ints)."""
    if not input_ids:
        raise HTTPException(422, "input_ids is empty: send at least one row")
    if len(input_ids) != len(prompt_lengths):
        raise HTTPException(422, f"input_ids has {len(input_ids)} rows but prompt_lengths has {len(prompt_lengths)}")
    total = sum(len(row) for row in input_ids)
    if total > state.max_request_tokens:
        raise HTTPException(413, f"request holds {total} tokens, more than the {state.max_request_tokens}-token "
                            "budget")
    try:  # one C-level pass over the ids (numpy: torch.tensor(list) is ~10x slower); ints beyond int64 are no ids
        flat = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(input_ids), dtype=np.int64, count=total))
        plens = torch.from_numpy(np.asarray(prompt_lengths, dtype=np.int64))
    except (OverflowError, ValueError):
        return _validate_slowly(state, input_ids, prompt_lengths)
    return validate_tensor_rows(state, flat, torch.tensor([len(r) for r in input_ids], dtype=torch.long), plens)


def _validate_slowly(state: ServerState, input_ids: list[list[int]], prompt_lengths: list[int]) -> list[Row]:
    for i, (ids, plen) in enumerate(zip(input_ids, prompt_lengths)):
        _check_row(state, i, len(ids), plen)
        bad = next((j for j, t in enumerate(ids) if not 0 <= t < (state.vocab_size or 0)), None)
        if bad is not None:
            raise HTTPException(422, f"row {i}, position {bad}: token id {ids[bad]} is outside [0, {state.vocab_size})")
    raise HTTPException(422, "a prompt length or token id is out of range")  # unreachable: the fast path overflowed


def _check_row(state: ServerState, i: int, length: int, plen: int) -> None:
    if not 1 <= plen <= length:
        raise HTTPException(422, f"row {i}: prompt_length {plen} must be between 1 and the row length {length}")
    if not row_fits(state.max_context, length):  # the hub's intake refuses such groups by the same rule
        raise HTTPException(422, f"row {i}: {length} tokens exceed the model's context of {state.max_context}")


def validate_tensor_rows(state: ServerState, flat: torch.Tensor, row_lengths: torch.Tensor,
                         prompt_lengths: torch.Tensor) -> list[Row]:
    """Rows (views of ``flat``) the scorer can take, or a 413/422 naming the first problem.

    Every check is a tensor operation over the whole request; only a failing request is looked at row by row, to
    name the first bad row exactly as a row-by-row check would (prompt length, then context, then token ids).
    """
    n = row_lengths.numel()
    if n == 0:
        raise HTTPException(422, "input_ids is empty: send at least one row")
    if prompt_lengths.numel() != n:
        raise HTTPException(422, f"input_ids has {n} rows but prompt_lengths has {prompt_lengths.numel()}")
    if flat.numel() > state.max_request_tokens:
        raise HTTPException(413, f"request holds {flat.numel()} tokens, more than the {state.max_request_tokens}-"
                            "token budget")
    bad_row = (prompt_lengths < 1) | (prompt_lengths > row_lengths)
    if state.max_context is not None:
        bad_row |= row_lengths > state.max_context
    vocab = state.vocab_size or 0
    # min/max in numpy: single-threaded reductions, no [N] mask, and no waking torch's intra-op thread pool on the
    # event loop (on a busy machine each parallel op there can wait milliseconds for a sleeping worker thread)
    ids = flat.numpy()
    ids_ok = ids.size == 0 or (int(ids.min()) >= 0 and int(ids.max()) < vocab)
    if bool(bad_row.any()) or not ids_ok:
        bad_token = (flat < 0) | (flat >= vocab)
        ends = row_lengths.cumsum(0)
        token_rows = torch.searchsorted(ends, bad_token.nonzero().flatten(), right=True)
        candidates = [int(token_rows[0])] if token_rows.numel() else []
        if bool(bad_row.any()):
            candidates.append(int(bad_row.nonzero()[0]))
        first = min(candidates)
        _check_row(state, first, int(row_lengths[first]), int(prompt_lengths[first]))
        start = int(ends[first] - row_lengths[first])
        j = int(bad_token[start:int(ends[first])].nonzero()[0])
        raise HTTPException(422, f"row {first}, position {j}: token id {int(flat[start + j])} is outside "
                            f"[0, {state.vocab_size})")
    return [Row(ids, plen) for ids, plen in zip(torch.split(flat, row_lengths.tolist()), prompt_lengths.tolist())]


def _parse(body: bytes, binary: bool) -> tuple:
    """Binary: ``(flat, row_lengths, prompt_lengths, temperature)`` tensors; JSON (strict: no NaN/Infinity, bounded
    nesting): ``(rows, prompt_lengths, temperature)`` lists."""
    if binary:
        try:
            return decode_logprob_request_tensors(body)
        except WireError as exc:
            raise HTTPException(400, str(exc)) from None
    try:
        parsed = LogprobRequest.model_validate(strict_json.loads(body))
    except strict_json.StrictJSONError as exc:  # malformed JSON: 400, as malformed safetensors; a bad shape: 422
        raise HTTPException(400, f"request body: {exc}") from None
    except ValidationError as exc:
        problems = [{"loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors(include_url=False)]
        raise HTTPException(422, problems) from None
    return parsed.input_ids, parsed.prompt_lengths, parsed.temperature, parsed.model


def _rows(state: ServerState, body: bytes, binary: bool) -> tuple[list[Row], float, str | None]:
    """The request's rows, temperature and model (None in the binary form: the query names it), parsed and checked
    (run in the thread pool: a big body takes a while)."""
    if binary:
        flat, row_lengths, prompt_lengths, temperature = _parse(body, binary)
        return validate_tensor_rows(state, flat, row_lengths, prompt_lengths), temperature, None
    input_ids, prompt_lengths, temperature, model = _parse(body, binary)
    return validate_rows(state, input_ids, prompt_lengths), temperature, model


def scoring_pool(state: ServerState, model: str | None):
    """The scorer pool that answers for ``model`` (null/'reference'/its folder name: the reference; 'teacher'/its
    folder name: the teacher), or a 503 (that model is not served) / 422 (a name this hub does not know)."""
    reference = (state.model_identity or {}).get("model")
    teacher = (state.teacher_identity or {}).get("model")
    if model in (None, "reference") or (model == reference and model != teacher):
        if state.scorer is None:
            hint = "; this hub scores the teacher: name it with \"model\": \"teacher\"" if state.teacher else ""
            raise HTTPException(503, f"no reference model is loaded (beta = 0 mode){hint}")
        return state.scorer
    if model in ("teacher", teacher):
        if state.teacher is None:
            raise HTTPException(503, "no teacher model is loaded (ref_server.teacher_model is not set)")
        return state.teacher
    known = ", ".join(repr(n) for n in dict.fromkeys(("reference", reference, "teacher", teacher)) if n)
    raise HTTPException(422, f"model {model!r} is not served here; known: {known}")


def _encode(result: list[torch.Tensor], binary: bool) -> Response:
    if binary:
        return Response(encode_logprob_response(result), media_type=OCTET)
    # JSON written in Rust (pydantic-core) from the rows' float lists, not through FastAPI's per-value encoder
    return Response(pydantic_core.to_json({"logprobs": [t.tolist() for t in result]}), media_type="application/json")


@router.post("/v1/logprobs", response_model=LogprobResponse, openapi_extra={"requestBody": {"required": True,
             "content": {"application/json": {"schema": LogprobRequest.model_json_schema()},
                         OCTET: {"schema": {"type": "string", "format": "binary",
                                            "description": "safetensors: input_ids (flat), row_lengths, "
                                                           "prompt_lengths"}}}}})
async def logprobs(request: Request, state: State,
                   model: str | None = Query(None, max_length=512, description="Which model scores (as the JSON "
                                             "field; for the safetensors form): 'reference' or 'teacher'.")):
    """Per-token logprobs of every row's tokens after its prompt (JSON or safetensors), by the reference model or,
    when the request names it, the teacher."""
    if state.scorer is None and state.teacher is None:
        raise HTTPException(503, "no reference model is loaded (beta = 0 mode)")
    body = await read_body(request, state.max_request_bytes)
    binary = request.headers.get("content-type", "").split(";")[0].strip() == OCTET
    # parsing, checking and encoding run in the thread pool: the event loop keeps answering (/healthz) meanwhile
    rows, temperature, named = await run_in_threadpool(_rows, state, body, binary)
    if named is not None and model is not None and named != model:
        raise HTTPException(422, f"the body names model {named!r}, the query {model!r}")
    pool = scoring_pool(state, named or model)
    try:
        future = pool.submit(rows, temperature)
    except ScorerBusy as exc:
        raise HTTPException(503, str(exc), {"Retry-After": "1"}) from None
    try:
        result = await pool.result(future)
    except ScoringError as exc:  # NoScorer too: no joined scorer answered within ref_server.scorer_wait_s
        raise HTTPException(503, f"scoring failed: {exc}", {"Retry-After": "5"}) from None
    request.app.state.metrics.tokens_scored.inc(sum(t.numel() for t in result))
    return await run_in_threadpool(_encode, result, binary)
