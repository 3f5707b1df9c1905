"""What every router needs: the server's state (the ``State`` dependency), reading a bounded body, the binary
media type, long polls on their own threads (:func:`long_poll`), short error bodies (:func:`install_short_errors`) in the shape each path's clients read
(:func:`error_body`: OpenAI's on the OpenAI-style paths, ``{"detail": ...}`` elsewhere). No router is imported here:
``ref_server.state`` and what it imports never import a router."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import anyio
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ref_server.state import ServerState
from shared.protocol.bounded_body import read_bounded
from shared.protocol.openai_errors import MAX_ERROR_ITEMS, bounded, openai_error

OCTET = "application/octet-stream"
T = TypeVar("T")


def server_state(request: Request) -> ServerState:
    """FastAPI dependency: the state the app was created with."""
    return request.app.state.server


State = Annotated[ServerState, Depends(server_state)]


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes ``limit`` bytes (never read whole first)."""
    return await read_bounded(request, limit, lambda reason: HTTPException(413, reason))


async def long_poll(state: ServerState, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, a call that may block for a long poll's wait, on one of the long polls' own threads
    (``ServerState.long_polls``): never one that short work is waiting for."""
    return await anyio.to_thread.run_sync(fn, *args, limiter=state.long_polls)


def binary_body(schema_description: str) -> dict:
    """OpenAPI ``requestBody`` of an endpoint that takes safetensors bytes."""
    return {"requestBody": {"required": True, "content": {
        OCTET: {"schema": {"type": "string", "format": "binary", "description": schema_description}}}}}


# -- short error bodies, in each client's shape (OpenAI's: shared/protocol/openai_errors.py) ----------------------------
# The paths whose clients speak OpenAI's API (the openai package, lm-evaluation-harness, vLLM's tools): every
# error there, from a route, the router (404, 405) or the request guard (401, 408, 413), is answered in OpenAI's
# shape, which those clients read (they show an empty message for FastAPI's ``{"detail": ...}``).
OPENAI_PATHS = frozenset({"/v1/completions", "/v1/models", "/v1/chat/completions", "/tokenize", "/detokenize",
                          "/tokenizer_info", "/pooling"})
OPENAI_PATH_PREFIXES = ("/v1/models/",)  # GET /v1/models/{model}


def is_openai_path(path: str) -> bool:
    """Whether ``path``'s clients read OpenAI's error shape (see :data:`OPENAI_PATHS`)."""
    return path in OPENAI_PATHS or path.startswith(OPENAI_PATH_PREFIXES)


def error_body(path: str, status: int, message: Any, *, code: str | None = None) -> dict:
    """The error body for a request to ``path``: OpenAI's shape on the OpenAI-style paths (``code`` goes there),
    ``{"detail": message}`` elsewhere (what the hub and relay clients read); bounded either way."""
    if is_openai_path(path):
        return openai_error(status, message, code=code)
    return {"detail": bounded(message)}


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    headers = getattr(exc, "headers", None)
    if exc.status_code in (204, 304):
        return Response(status_code=exc.status_code, headers=headers)
    path, detail = request.url.path, exc.detail
    if is_openai_path(path) and detail in ("Not Found", "Method Not Allowed"):  # the router's: say what is served
        detail = (f"Invalid URL ({request.method} {path}); this server's OpenAI-style routes are POST /v1/completions,"
                  " GET /v1/models, GET /v1/models/{model}, GET /tokenizer_info, POST /tokenize, POST /detokenize and"
                  " POST /pooling (with a process reward model)")
    return JSONResponse(error_body(path, exc.status_code, detail), exc.status_code, headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    """422 naming each problem's place and kind, never the ``input`` FastAPI would echo (70 MB of it, once); 400
    when the body is no JSON at all (malformed is 400 on every route, a body of the wrong shape 422)."""
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return JSONResponse(error_body(request.url.path, 400, "request body: not JSON"), 400)
    detail = [{"loc": [bounded(part) if isinstance(part, str) else part for part in e.get("loc", ())][:8],
               "msg": bounded(str(e.get("msg", ""))), "type": str(e.get("type", ""))[:64]}
              for e in errors[:MAX_ERROR_ITEMS]]
    if len(errors) > MAX_ERROR_ITEMS:
        detail.append({"loc": [], "msg": f"... and {len(errors) - MAX_ERROR_ITEMS} more problems", "type": "more"})
    return JSONResponse(error_body(request.url.path, 422, detail), 422)


async def _server_error(request: Request, exc: Exception) -> Response:
    """The answer to an unhandled exception (Starlette logs it and re-raises after sending this): OpenAI's shape on
    the OpenAI-style paths, never a traceback or the exception's text."""
    return JSONResponse(error_body(request.url.path, 500, "internal server error (logged by the server)"), 500)


def install_short_errors(app: FastAPI) -> None:
    """Every ``HTTPException``, validation error and unhandled exception answered with a bounded body in the shape
    the path's clients read (see :func:`error_body`)."""
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _server_error)
