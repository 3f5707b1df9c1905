"""The FastAPI application: reference logprobs, rollout hub, weight relay, health and metrics.

Each job has its routers: the hub (``ref_server/hub/routes.py``), scoring (``ref_server/scoring/*_routes.py``),
the weight relay (``ref_server/relay/routes.py``), health and metrics (``ref_server/operations.py``); this module
adds what they share: the request guard (:mod:`ref_server.limits`: bearer-token auth, body limits and deadlines,
strict JSON, request metrics with 5xx and disconnects told apart), short error bodies and the lifespan hook. Every
bad input is answered with a 4xx and a short ``{"detail": ...}`` naming the problem, never echoing the input; the
server keeps serving.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from ref_server import operations
from ref_server.http import install_short_errors
from ref_server.hub import routes as hub_routes
from ref_server.limits import RequestGuard
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

    install_short_errors(app)
    app.add_middleware(RequestGuard, state=state, metrics=metrics, router=app.router)
    return app
