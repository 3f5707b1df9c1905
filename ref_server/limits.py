"""Every request's body, bounded in one place: :class:`RequestGuard`, a pure ASGI middleware around the whole app.

* **Size**: each route has a body limit (:meth:`ref_server.body_limits.BodyLimits.for_route`): the binary uploads and the big scoring
  bodies take ``max_request_bytes`` (weights: ``max_weight_bytes``), every other route ``max_json_body_bytes``.
  A declared ``Content-Length`` above it is refused before a byte is read; a chunked body is counted as it arrives
  and refused the moment it passes the limit, so no route ever holds more than its limit. 413.
* **Time**: the whole body must arrive within ``body_timeout_s`` plus one second per ``min_body_bytes_per_s`` bytes
  received (uvicorn's keep-alive timeout only covers the wait between requests), else 408. A client trickling one
  byte a second is cut off after ``body_timeout_s``; a big upload at a reasonable rate is not.
* **Strict JSON**: a route whose body FastAPI parses (a pydantic model parameter: acknowledgements, version
  reports, the weight-sync rendezvous) gets its body checked by :func:`shared.protocol.strict_json.loads` first
  (no JSON, an empty body, NaN/Infinity literals, nesting, numbers out of range: 400, as on every route; a body
  of the wrong shape is FastAPI's 422). The big JSON routes parse their bodies themselves with the same loader.
* **Disconnects**: a client that goes away mid-body is answered 499 (nginx's "client closed request"), without a
  traceback, and counted as such, never as a 500.
* **Auth and metrics**: the bearer token (every path but ``open_paths``: /healthz, and the API docs unless
  ``ref_server.public_docs`` is false), then every answer counted by endpoint and
  status (an unhandled error as 500, then re-raised to Starlette's error middleware).

413 and 408 answers carry ``Connection: close``: uvicorn then drops the rest of the body instead of reading it.
Every answer of the guard has the shape the path's clients read (:func:`ref_server.http.error_body`: OpenAI's on
the OpenAI-style routes).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import TYPE_CHECKING, Any

from fastapi import HTTPException
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse
from starlette.routing import Match

from ref_server.body_limits import BodyLimits
from ref_server.http import error_body
from shared.protocol import strict_json

if TYPE_CHECKING:
    from starlette.routing import Router
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from ref_server.metrics import ServerMetrics
    from ref_server.state import ServerState

log = logging.getLogger("grpo.ref_server.limits")

CLIENT_CLOSED = 499  # nginx's status for "the client closed the connection before the answer"
_PARSE_INLINE_BYTES = 64 * 1024  # strict-JSON checks of bigger bodies run in the thread pool


class BodyRefused(HTTPException):
    """A body the guard refuses (413, 408) or that its client abandoned (499). An ``HTTPException``, so that
    FastAPI's body reading and the routes' ``read_body`` let it through to the answer unchanged."""

    def __init__(self, status: int, reason: str, detail: str) -> None:
        super().__init__(status, detail, headers={"Connection": "close"})
        self.reason = reason


class BodyReader:
    """``receive`` of one request, counted against its limit and deadline; ``refused`` names why it refused."""

    def __init__(self, receive: Receive, limit: int, limits: BodyLimits) -> None:
        self._receive, self.limit, self.limits = receive, limit, limits
        self.started = time.monotonic()
        self.size = 0
        self.done = False
        self.refused: str | None = None

    @property
    def disconnected(self) -> bool:
        return self.refused == "disconnected"

    async def receive(self) -> Message:
        if self.done:  # after the body: the app may wait for a disconnect (streaming answers, long polls)
            return await self._receive()
        remaining = self.started + self.limits.timeout_s + self.size / self.limits.min_bytes_per_s - time.monotonic()
        try:
            message = await asyncio.wait_for(self._receive(), timeout=max(remaining, 0.0))
        except asyncio.TimeoutError:
            raise self._refuse(408, "body_timeout", f"request body not received within its deadline ({self.size} "
                               f"bytes in {time.monotonic() - self.started:.0f} s)") from None
        if message["type"] == "http.disconnect":
            raise self._refuse(CLIENT_CLOSED, "disconnected", "client disconnected before sending its whole body")
        self.size += len(message.get("body", b""))
        if self.size > self.limit:
            raise self._refuse(413, "too_large", f"request body exceeds the {self.limit}-byte limit of this endpoint")
        self.done = not message.get("more_body", False)
        return message

    def _refuse(self, status: int, reason: str, detail: str) -> BodyRefused:
        self.refused = reason
        return BodyRefused(status, reason, detail)

    async def read_all(self) -> bytes:
        chunks = []
        while not self.done:
            chunks.append((await self.receive()).get("body", b""))
        return b"".join(chunks)


class _Answer:
    """What the client was answered: ``send`` of one request, recording the status."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.status: int | None = None

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self._send(message)


class RequestGuard:
    """The ASGI middleware (see the module docstring); ``router`` is the app's, to find each request's route;
    ``open_paths`` answer without the token."""

    def __init__(self, app: ASGIApp, state: ServerState, metrics: ServerMetrics, router: Router,
                 open_paths: frozenset[str] = frozenset({"/healthz"})) -> None:
        self.app, self.state, self.metrics, self.router = app, state, metrics, router
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        answer = _Answer(send)
        reader = BodyReader(receive, self.state.limits.json_bytes, self.state.limits)
        try:
            await self._guarded(scope, reader, answer.send)
        except BodyRefused as exc:  # refused before the app ran, or raised through it
            await _answer_refusal(exc, answer, scope["path"])
        except ClientDisconnect:
            reader.refused = "disconnected"
        except Exception:
            if not reader.disconnected:
                self.metrics.observe(scope["path"], 500, started)
                raise  # a real server error: Starlette's error middleware logs it and answers 500
        if reader.refused is not None:
            self.metrics.refused.labels(reason=reader.refused).inc()
        status = answer.status or 500
        if reader.disconnected:
            status = CLIENT_CLOSED  # whatever the app made of a client that left, it is no server error
            log.debug("client disconnected mid-body: %s %s", scope["method"], scope["path"])
        self.metrics.observe(scope["path"], status, started)

    async def _guarded(self, scope: Scope, reader: BodyReader, send: Send) -> None:
        state = self.state
        headers = dict(scope["headers"])
        path = scope["path"]
        if state.token is not None and path not in self.open_paths:
            supplied = headers.get(b"authorization", b"")
            if not hmac.compare_digest(supplied, f"Bearer {state.token}".encode()):
                body = error_body(path, 401, "missing or wrong bearer token", code="invalid_api_key")
                await JSONResponse(body, 401, {"WWW-Authenticate": "Bearer"})(scope, reader.receive, send)
                return
        route = self._route(scope)
        reader.limit = limit = state.limits.for_route(scope["method"], getattr(route, "path", None))
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            raise reader._refuse(413, "too_large", f"request body of {int(declared)} bytes exceeds the {limit}-byte "
                                 "limit of this endpoint")
        if getattr(route, "body_field", None) is None:
            await self.app(scope, reader.receive, send)
            return
        body = await reader.read_all()  # a FastAPI-parsed JSON body: small, checked strictly before FastAPI sees it
        # an empty body is no JSON either: 400, not FastAPI's 422 "Field required"
        if body or route.body_field.field_info.is_required():
            try:
                if len(body) > _PARSE_INLINE_BYTES:
                    await run_in_threadpool(strict_json.loads, body)
                else:
                    strict_json.loads(body)
            except strict_json.StrictJSONError as exc:
                reader.refused = "bad_json"
                # 400: malformed JSON is a bad request on every route; a body of the wrong shape stays FastAPI's 422
                await JSONResponse(error_body(path, 400, f"request body: {exc}"), 400)(scope, reader.receive, send)
                return
        await self.app(scope, _replay(body, reader), send)

    def _route(self, scope: Scope) -> Any:
        for route in self.router.routes:
            match, _ = route.matches(scope)
            if match is Match.FULL:
                return route
        return None


async def _answer_refusal(exc: BodyRefused, answer: _Answer, path: str) -> None:
    if answer.status is not None or exc.status_code == CLIENT_CLOSED:
        return  # an answer has started (nothing more can be sent), or nobody is there to read one
    response = JSONResponse(error_body(path, exc.status_code, exc.detail), exc.status_code, exc.headers)
    await response({"type": "http"}, _no_body, answer.send)


async def _no_body() -> Message:
    return {"type": "http.disconnect"}


def _replay(body: bytes, reader: BodyReader):
    """``receive`` that hands the app the already-read body once, then waits on the real connection."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await reader.receive()

    return receive
