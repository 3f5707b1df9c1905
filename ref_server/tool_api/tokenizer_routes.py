"""The model folder's tokenizer over HTTP, in the shapes vLLM serves and lm-evaluation-harness discovers.

``GET /tokenizer_info`` (special tokens, context), ``POST /tokenize`` ``{"prompt", "add_special_tokens"}`` ->
``{"tokens": [...]}`` and ``POST /detokenize`` ``{"tokens": [...]}`` -> ``{"prompt": "..."}``. lm-eval's
``local-completions`` model uses them (``tokenizer_backend=remote``, picked automatically when both answer) to
count context tokens exactly as the server does. Errors here and on ``/v1/completions`` use the OpenAI shape
``{"error": {"message", "type", "param", "code"}}`` (:class:`ref_server.tool_api.openai_shape.OpenAIError`), not
FastAPI's ``{"detail": ...}``. The tokenizer itself is :class:`ref_server.tool_api.tokenizer.ServedTokenizer`.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr
from starlette.concurrency import run_in_threadpool

from ref_server.http import State
from ref_server.tool_api.openai_shape import (
    OpenAIError,
    json_response,
    openapi_body,
    parse_json_body,
    served_tokenizer,
)

router = APIRouter(tags=["tokenizer"])


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    prompt: StrictStr = Field(description="Text to tokenize.")
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens (BOS) like encode does.")
    model: str | None = Field(None, description="Ignored: the server has one model.")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tokens: list[StrictInt] = Field(description="Token ids to decode (special tokens kept).")
    model: str | None = Field(None, description="Ignored: the server has one model.")


@router.get("/tokenizer_info")
async def tokenizer_info(state: State) -> Response:
    """The tokenizer's special tokens and the model's context (what lm-eval's remote tokenizer reads)."""
    try:
        return json_response(served_tokenizer(state).info())
    except OpenAIError as exc:
        return exc.response()


@router.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest))
async def tokenize(request: Request, state: State) -> Response:
    """``{"prompt": "text"}`` -> ``{"tokens": [ids], "count": n, "max_model_len": context}``."""
    try:
        tokenizer = served_tokenizer(state)
        body = await parse_json_body(request, state, TokenizeRequest)
        # tokenising a long text takes seconds: in the thread pool, so the event loop keeps answering
        return await run_in_threadpool(_tokenize, state, tokenizer, body)
    except OpenAIError as exc:
        return exc.response()


def _tokenize(state, tokenizer, body: TokenizeRequest) -> Response:
    tokens = tokenizer.encode([body.prompt], body.add_special_tokens)[0]
    if len(tokens) > state.max_request_tokens:
        raise OpenAIError(413, f"prompt has {len(tokens)} tokens, more than the {state.max_request_tokens}-token "
                          "budget of one request", param="prompt")
    return json_response({"tokens": tokens, "count": len(tokens), "max_model_len": state.max_context})


@router.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest))
async def detokenize(request: Request, state: State) -> Response:
    """``{"tokens": [ids]}`` -> ``{"prompt": "text"}``."""
    try:
        tokenizer = served_tokenizer(state)
        body = await parse_json_body(request, state, DetokenizeRequest)
        if len(body.tokens) > state.max_request_tokens:
            raise OpenAIError(413, f"{len(body.tokens)} tokens, more than the {state.max_request_tokens}-token "
                              "budget of one request", param="tokens")
        bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise OpenAIError(400, f"tokens[{bad}] = {body.tokens[bad]} is outside [0, {tokenizer.vocab_size})",
                              param="tokens")
        text = await run_in_threadpool(tokenizer.decode, body.tokens)
    except OpenAIError as exc:
        return exc.response()
    return await run_in_threadpool(json_response, {"prompt": text})
