"""vLLM's ``POST /pooling`` for a process reward model, served by :class:`ref_server.tool_api.prm.PRMScorer`.

Request (vLLM 0.32.0's ``PoolingCompletionRequest`` / ``PoolingChatRequest``; other vLLM fields are ignored)::

    {"model": "...", "input": "text" | ["text", ...] | [ids] | [[ids], ...], "task": "token_classify",
     "add_special_tokens": true, "use_activation": true}
    {"model": "...", "messages": [{"role": "system", "content": "..."}, ...], "add_generation_prompt": false}

Answer (``PoolingResponse``): ``{"id", "object": "list", "created", "model", "data": [{"index": i, "object":
"pooling", "data": [[p_negative, p_positive], ...]}], "usage": {...}}`` with one row per step tag (per token when
the scorer is ``per_token``). Errors use vLLM's / OpenAI's ``{"error": {"message", "type", "param", "code"}}``:
413 for too many inputs or tokens, 400 for a malformed body. The ref server mounts :data:`router` when
``ref_server.prm_model`` is set; :func:`create_prm_app` is the same endpoint alone, with vLLM's ``/tokenize`` and
``/v1/models``, for a stand-in PRM server of its own.
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from ref_server.http import read_body
from ref_server.tool_api.openai_shape import OpenAIError, json_response, openapi_body
from ref_server.tool_api.prm import PRMInputError, PRMScorer
from shared.protocol import strict_json

router = APIRouter(tags=["prm"])
TASKS = (None, "token_classify", "encode")  # "encode": the name older vLLM gave this pooling task


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: StrictStr = Field(description="system, user or assistant.")
    content: StrictStr = Field(description="The message text.")


class PoolingBase(BaseModel):
    model_config = ConfigDict(extra="ignore")  # vLLM's other fields (encoding_format, priority, ...) are ignored
    model: str | None = Field(None, description="Ignored: the server has one PRM.")
    task: str | None = Field(None, description="Pooling task: 'token_classify' (or null, the model's own).")
    use_activation: bool | None = Field(None, description="Softmax the class logits (default true).")


class PoolingTextRequest(PoolingBase):
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]] = Field(
        description="Prompt text(s) or token ids, one result per prompt.")
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens when encoding text.")


class PoolingChatRequest(PoolingBase):
    messages: list[ChatMessage] = Field(description="One conversation, rendered with the chat template.")
    add_generation_prompt: bool = Field(False, description="Passed to the chat template.")


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True  # vLLM's TokenizeChatRequest default (its pooling chat request's is False)


def prm_scorer(request: Request) -> PRMScorer:
    scorer = getattr(request.app.state, "prm", None)
    if scorer is None:
        raise OpenAIError(503, "no process reward model is loaded (set ref_server.prm_model)")
    return scorer


async def parse(request: Request, scorer: PRMScorer, models: tuple[type[BaseModel], ...]) -> BaseModel:
    """The body as the first model whose marker field it has (``messages`` -> chat), or a 400/413 naming why."""
    try:
        raw = await read_body(request, scorer.max_request_bytes)
    except HTTPException as exc:
        raise OpenAIError.from_http(exc) from None
    try:
        body = await run_in_threadpool(strict_json.loads, raw)  # no NaN/Infinity, bounded depth, off the loop
    except strict_json.StrictJSONError as exc:
        raise OpenAIError(400, f"body: {exc}") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "body: must be a JSON object")
    model = models[0] if len(models) == 1 or "messages" not in body else models[1]
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        param = str(first["loc"][0]) if first["loc"] else None
        raise OpenAIError(400, f"{where}: {first['msg']}", param=param) from None


def request_ids(scorer: PRMScorer, body: BaseModel) -> list[list[int]]:
    if isinstance(body, PoolingChatRequest):
        messages = [m.model_dump() for m in body.messages]
        return [scorer.encode_chat(messages, body.add_generation_prompt)]
    value = body.input
    if isinstance(value, str):
        return scorer.encode_text([value], body.add_special_tokens)
    if not value:
        raise OpenAIError(400, "input: must not be empty", param="input")
    if isinstance(value[0], str):
        return scorer.encode_text(list(value), body.add_special_tokens)
    if isinstance(value[0], int):
        value = [value]
    vocab = scorer.model.config.vocab_size
    if any(not 0 <= t < vocab for row in value for t in row):
        raise OpenAIError(400, f"input: token ids must be in [0, {vocab})", param="input")
    return [list(row) for row in value]


@router.post("/pooling", openapi_extra=openapi_body(PoolingTextRequest))
async def pooling(request: Request) -> Response:
    """vLLM's pooling endpoint for a process reward model: class probabilities at each step tag."""
    try:
        scorer = prm_scorer(request)
        body = await parse(request, scorer, (PoolingTextRequest, PoolingChatRequest))
        if body.task not in TASKS:
            raise OpenAIError(400, f"task: {body.task!r} is not supported; use 'token_classify'", param="task")
        ids = await run_in_threadpool(request_ids, scorer, body)  # tokenising a big input must not stall /healthz
        rows = await run_in_threadpool(scorer.pool, ids, body.use_activation is not False)
    except PRMInputError as exc:
        return OpenAIError(exc.status, str(exc)).response()
    except OpenAIError as exc:
        return exc.response()
    tokens = sum(len(r) for r in ids)
    return json_response({
        "id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": scorer.name,
        "data": [{"index": i, "object": "pooling", "data": data} for i, data in enumerate(rows)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
    })


async def tokenize(request: Request) -> Response:
    """vLLM's ``/tokenize`` for the PRM's tokenizer: ``{"prompt"}`` or ``{"messages"}`` -> ``{"tokens"}``."""
    try:
        scorer = prm_scorer(request)
        body = await parse(request, scorer, (TokenizeRequest,))
        if body.messages is not None:
            tokens = scorer.encode_chat([m.model_dump() for m in body.messages], body.add_generation_prompt)
        elif body.prompt is not None:
            tokens = scorer.encode_text([body.prompt], body.add_special_tokens)[0]
        else:
            raise OpenAIError(400, "body: needs 'prompt' or 'messages'")
    except PRMInputError as exc:
        return OpenAIError(exc.status, str(exc)).response()
    except OpenAIError as exc:
        return exc.response()
    return json_response({"tokens": tokens, "count": len(tokens), "max_model_len": scorer.max_context})


def create_prm_app(scorer: PRMScorer, served_name: str | None = None) -> FastAPI:
    """A stand-in PRM server on its own: ``/pooling``, ``/tokenize`` and ``/v1/models`` like ``vllm serve``."""
    app = FastAPI(title="grpo-stack PRM stand-in", version="1")
    app.state.prm = scorer
    app.include_router(router)
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    name = served_name or scorer.name

    async def models() -> Response:
        return json_response({"object": "list", "data": [{"id": name, "object": "model", "owned_by": "grpo-stack"}]})

    app.add_api_route("/v1/models", models, methods=["GET"])
    return app

