"""What the OpenAI-shaped endpoints (``/v1/completions`` and the tokenizer's) share: errors answered as
``{"error": {"message", "type", "param", "code"}}`` (:class:`OpenAIError`), not FastAPI's ``{"detail": ...}``;
JSON bodies parsed and answered without FastAPI's encoder; the served tokenizer or a 503."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pydantic_core
from fastapi import HTTPException, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from ref_server.http import openai_error, read_body
from ref_server.tool_api.tokenizer import ServedTokenizer
from shared.protocol import strict_json

if TYPE_CHECKING:
    from ref_server.state import ServerState


class OpenAIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status (the same
    shape the request guard and the exception handlers give these paths: :func:`ref_server.http.openai_error`)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    @classmethod
    def from_http(cls, exc: HTTPException) -> OpenAIError:
        return cls(exc.status_code, str(exc.detail), headers=exc.headers)

    def response(self) -> Response:
        return json_response(openai_error(self.status, self.message, param=self.param, code=self.code), self.status,
                             self.headers)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """JSON bytes built in Rust (pydantic-core; non-finite floats become null), skipping FastAPI's encoder."""
    return Response(pydantic_core.to_json(body), status_code=status, headers=headers, media_type="application/json")


def openapi_body(model: type[BaseModel]) -> dict:
    """OpenAPI ``requestBody`` of a JSON endpoint that parses its body itself."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


async def parse_json_body(request: Request, state: ServerState, model: type[BaseModel]):
    """The body validated as ``model`` (strict JSON: no NaN/Infinity, bounded nesting; parsed in the thread pool);
    a 413 or 400 :class:`OpenAIError` naming the first problem otherwise."""
    try:
        body = await read_body(request, state.max_request_bytes)
    except HTTPException as exc:
        raise OpenAIError.from_http(exc) from None
    return await run_in_threadpool(_validate, body, model)


def _validate(body: bytes, model: type[BaseModel]):
    try:
        return model.model_validate(strict_json.loads(body))
    except strict_json.StrictJSONError as exc:
        raise OpenAIError(400, f"body: {exc}", param=str(exc.path[0]) if exc.path else None) from None
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        param = str(first["loc"][0]) if first["loc"] else None
        if param == "prompt" and len(first["loc"]) > 1:  # a union: name the accepted shapes, not each branch
            message = "prompt: must be a text, a list of texts, a list of token ids or a list of token-id lists"
        else:
            message = f"{'.'.join(str(part) for part in first['loc']) or 'body'}: {first['msg']}"
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 and param != "prompt" else ""
        raise OpenAIError(400, message + more, param=param) from None


def served_tokenizer(state: ServerState) -> ServedTokenizer:
    if state.scorer is None:
        raise OpenAIError(503, "no model is loaded (beta = 0 mode)", headers={"Retry-After": "60"})
    if state.tokenizer is None:
        raise OpenAIError(503, "the model folder has no tokenizer that transformers can load")
    return state.tokenizer
