"""The endpoint's routes, OpenAI's shapes under ``/episodes/{id}/v1`` (so ``openai.OpenAI(base_url=...)`` works
unmodified), the reward that closes an episode, and the claim an external agent takes episodes with.

Every body is read up to ``max_request_bytes`` (413) within ``body_timeout_s`` (408), parsed as strict JSON (400)
and checked against its model (400 naming the field); every error, the router's 404/405 and the bearer token's 401
included, is answered in OpenAI's shape (shared/protocol/openai_errors.py), as the ref server's OpenAI routes are.
Rendering, tokenizing and sampling run on worker threads, off the event loop.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import Any, Literal

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from generator.agent.calls import MODEL_NAME, CallError, CallHandler
from generator.agent.episodes import EpisodeGone
from shared.protocol import strict_json
from shared.protocol.bounded_body import read_bounded
from shared.protocol.openai_errors import openai_error

OPEN_PATHS = frozenset({"/healthz"})
# A call holds a thread until its turn is sampled, and a claim until an episode is free or its wait ends. anyio's
# one shared pool (40 threads) would cap the engine's batch at 40 calls and let 40 waiting claims stall every call,
# so each has its own limiter. Calls are bounded anyway by the open episodes (one call per episode at a time: a
# second is refused 409 before it takes a thread).
CALL_THREADS = 4096
CLAIM_THREADS = 256


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")   # OpenAI's other parameters are accepted and not used


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatRequest(_Open):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    logprobs: bool = False
    n: Literal[1] = 1
    stream: Literal[False] = False


class CompletionRequest(_Open):
    model: str | None = None
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int | None = Field(16, ge=1)
    stop: str | list[str] | None = None
    logprobs: int | None = Field(None, ge=0)
    n: Literal[1] = 1
    stream: Literal[False] = False
    echo: Literal[False] = False


class RewardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: float | None = Field(None, allow_inf_nan=False)
    steps: list[float] | None = Field(None, min_length=1)


def _error(status: int, message: Any, *, param: str | None = None, code: str | None = None,
           headers: dict | None = None) -> JSONResponse:
    return JSONResponse(openai_error(status, message, param=param, code=code), status, headers)


async def _body(request: Request, limit: int, timeout_s: float) -> bytes:
    try:
        return await asyncio.wait_for(read_bounded(request, limit, lambda reason: CallError(413, reason)), timeout_s)
    except asyncio.TimeoutError:
        raise CallError(408, f"request body not received within {timeout_s} s") from None


def parsed(body: bytes, model: type[BaseModel]) -> Any:
    """``body`` as ``model``; a 400 CallError naming the first problem."""
    try:
        value = strict_json.loads(body)
        if model is RewardRequest and isinstance(value, (int, float)) and not isinstance(value, bool):
            value = {"reward": value}   # a bare number is the reward
        return model.model_validate(value)
    except strict_json.StrictJSONError as exc:
        raise CallError(400, f"body: {exc}") from None
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise CallError(400, f"{where}: {first['msg']}", param=str(first["loc"][0]) if first["loc"] else None) from None


def install_errors(app: FastAPI, token: str | None) -> None:
    """The bearer token on every path but /healthz, and every error in OpenAI's shape."""

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if token is not None and request.url.path not in OPEN_PATHS:
            supplied = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(supplied, f"Bearer {token}".encode()):
                return _error(401, "missing or wrong bearer token", code="invalid_api_key",
                              headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = exc.detail
        if exc.status_code in (404, 405):
            message = (f"Invalid URL ({request.method} {request.url.path}); this endpoint serves POST "
                       "/episodes/{id}/v1/chat/completions, /episodes/{id}/v1/completions, /episodes/{id}/reward, "
                       "GET /episodes/{id}/v1/models and POST /episodes (claim one)")
        return _error(exc.status_code, message)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return _error(400, [{"loc": e.get("loc", ()), "msg": str(e.get("msg", ""))} for e in exc.errors()[:10]])

    @app.exception_handler(CallError)
    async def call_error(request: Request, exc: CallError):
        return _error(exc.status, exc.message, param=exc.param, code=exc.code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):   # logged by Starlette; never its text or traceback
        return _error(500, "internal server error (logged by the generator)")


def _claim_until(book, deadline: float):
    """An episode to claim, waiting until ``deadline`` at most (a claim that queued for a thread waits no longer)."""
    return book.claim(max(deadline - time.monotonic(), 0.0))


def build_app(handler: CallHandler, token: str | None, max_bytes: int, body_timeout_s: float) -> FastAPI:
    app = FastAPI(title="grpo-stack agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)
    install_errors(app, token)
    book, (call_threads, claim_threads) = handler.book, (anyio.CapacityLimiter(CALL_THREADS), anyio.CapacityLimiter(CLAIM_THREADS))

    async def episode_call(episode_id: str, request: Request, model: type[BaseModel], answer) -> JSONResponse:
        call = parsed(await _body(request, max_bytes, body_timeout_s), model)
        try:
            episode = book.begin_call(episode_id)
        except EpisodeGone as exc:
            raise CallError(404, str(exc), code="episode_not_found") from None
        except RuntimeError as exc:
            raise CallError(409, str(exc), code="episode_busy") from None
        try:
            return JSONResponse(await anyio.to_thread.run_sync(answer, episode, call, limiter=call_threads))
        finally:
            book.end_call(episode)

    @app.post("/episodes/{episode_id}/v1/chat/completions")
    async def chat(episode_id: str, request: Request):
        return await episode_call(episode_id, request, ChatRequest, handler.chat)

    @app.post("/episodes/{episode_id}/v1/completions")
    async def completions(episode_id: str, request: Request):
        return await episode_call(episode_id, request, CompletionRequest, handler.completion)

    @app.get("/episodes/{episode_id}/v1/models")
    async def models(episode_id: str):
        return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "grpo-stack"}]}

    @app.post("/episodes/{episode_id}/reward")
    async def reward(episode_id: str, request: Request):
        given = parsed(await _body(request, max_bytes, body_timeout_s), RewardRequest)
        if (given.reward is None) == (given.steps is None):
            raise CallError(400, "body: give a reward (a number, or {\"reward\": x}) or step rewards "
                            "({\"steps\": [...]}, one per model turn from the first), not both", param="reward")
        try:
            episode = book.reward(episode_id, given.reward, given.steps)
        except EpisodeGone as exc:
            raise CallError(404, str(exc), code="episode_not_found") from None
        except ValueError as exc:
            raise CallError(400, str(exc), param="steps") from None
        except RuntimeError as exc:
            raise CallError(409, str(exc), code="episode_busy") from None
        return {"id": episode.id, "reward": episode.reward, "closed": True}

    @app.post("/episodes")
    async def claim(request: Request, wait_s: float = 30.0):
        episode = await anyio.to_thread.run_sync(_claim_until, book, time.monotonic() + min(max(wait_s, 0.0), 60.0),
                                                 limiter=claim_threads)
        if episode is None:
            return JSONResponse({"id": None, "example": None, "base_url": None}, 200)
        return {"id": episode.id, "example": episode.example,
                "base_url": f"{request.base_url}episodes/{episode.id}/v1"}

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    return app
