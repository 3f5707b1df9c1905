"""The FastAPI application: reference logprobs, rollout hub, weight relay, health and metrics.

Each job has its routers: the hub (``ref_server/hub/routes.py``), scoring (``ref_server/scoring/*_routes.py``),
the weight relay (``ref_server/relay/routes.py``), health and metrics (``ref_server/operations.py``); this module
adds what they share: bearer-token auth, request metrics (5xx included), and the lifespan hook. Every bad input is answered with a 4xx and ``{"detail": ...}``
naming the problem (FastAPI's ``HTTPException``); the server keeps serving.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ref_server import operations
from ref_server.hub import routes as hub_routes
from ref_server.metrics import ServerMetrics
from ref_server.relay import routes as weights
from ref_server.scoring import completions_routes, logprobs_routes, prm_routes, tokenizer_routes
from ref_server.state import ServerState

__all__ = ["ServerState", "create_app"]


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
    for module in (logprobs_routes, completions_routes, tokenizer_routes, hub_routes, weights, operations):
        app.include_router(module.router)
    if state.prm is not None:  # vLLM's /pooling for a process reward model (ref_server.prm_model)
        app.state.prm = state.prm
        app.include_router(prm_routes.router)

    @app.middleware("http")
    async def _auth_and_metrics(request: Request, call_next):
        started = time.perf_counter()
        if state.token is not None and request.url.path != "/healthz":
            supplied = request.headers.get("authorization", "")
            if not hmac.compare_digest(supplied.encode(), f"Bearer {state.token}".encode()):
                response = JSONResponse({"detail": "missing or wrong bearer token"}, status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                metrics.observe(request, response.status_code, started)
                return response
        try:
            response = await call_next(request)
        except Exception:  # an unhandled error is a 500 to the client: count it before it propagates
            metrics.observe(request, 500, started)
            raise
        metrics.observe(request, response.status_code, started)
        return response

    return app
