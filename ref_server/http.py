"""What every router needs: the server's state (the ``State`` dependency), reading a bounded body, the binary
media type, short error bodies (:func:`install_short_errors`). No router is imported here: ``ref_server.state`` and what it imports never import a router."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ref_server.state import ServerState

OCTET = "application/octet-stream"


def server_state(request: Request) -> ServerState:
    """FastAPI dependency: the state the app was created with."""
    return request.app.state.server


State = Annotated[ServerState, Depends(server_state)]


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes ``limit`` bytes (never read whole first)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, f"request body of {declared} bytes exceeds the {limit}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPException(413, f"request body exceeds the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def binary_body(schema_description: str) -> dict:
    """OpenAPI ``requestBody`` of an endpoint that takes safetensors bytes."""
    return {"requestBody": {"required": True, "content": {
        OCTET: {"schema": {"type": "string", "format": "binary", "description": schema_description}}}}}


# -- short error bodies ------------------------------------------------------------------------------------------
MAX_ERROR_TEXT = 300  # characters of any one string in an error body
MAX_ERROR_ITEMS = 10  # items of any one list or object in an error body


def bounded(value: Any, depth: int = 0) -> Any:
    """``value`` cut to a few hundred characters per string and a few items per list, 4 levels deep: an error body
    names the problem and never echoes a big input back."""
    if isinstance(value, str):
        return value if len(value) <= MAX_ERROR_TEXT else value[:MAX_ERROR_TEXT] + f"... ({len(value)} chars)"
    if depth >= 4:
        return "..."
    if isinstance(value, (list, tuple)):
        items = [bounded(v, depth + 1) for v in value[:MAX_ERROR_ITEMS]]
        return items + [f"... ({len(value) - MAX_ERROR_ITEMS} more)"] if len(value) > MAX_ERROR_ITEMS else items
    if isinstance(value, dict):
        return {bounded(str(k), depth + 1): bounded(v, depth + 1)
                for k, v in list(value.items())[:MAX_ERROR_ITEMS]}
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return bounded(str(value), depth)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    headers = getattr(exc, "headers", None)
    if exc.status_code in (204, 304):
        return Response(status_code=exc.status_code, headers=headers)
    return JSONResponse({"detail": bounded(exc.detail)}, exc.status_code, headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    """422 naming each problem's place and kind, never the ``input`` FastAPI would echo (70 MB of it, once)."""
    errors = exc.errors()
    detail = [{"loc": [bounded(part) if isinstance(part, str) else part for part in e.get("loc", ())][:8],
               "msg": bounded(str(e.get("msg", ""))), "type": str(e.get("type", ""))[:64]}
              for e in errors[:MAX_ERROR_ITEMS]]
    if len(errors) > MAX_ERROR_ITEMS:
        detail.append({"loc": [], "msg": f"... and {len(errors) - MAX_ERROR_ITEMS} more problems", "type": "more"})
    return JSONResponse({"detail": detail}, 422)


def install_short_errors(app: FastAPI) -> None:
    """Every ``HTTPException`` and validation error answered with a bounded body (see :func:`bounded`)."""
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
