"""The FastAPI application: reference logprobs, rollout hub, weight relay, health and metrics.

Each job has its routers: the hub (``ref_server/hub/routes.py``, its curriculum ``ref_server/hub/curriculum_routes.py``),
reference scoring (``ref_server/scoring/logprobs_routes.py``), joined scorers (``ref_server/scorer_pool/routes.py``), the endpoints in
other tools' shapes (``ref_server/tool_api/*_routes.py``), the learner session (``ref_server/session_routes.py``),
the weight relay (``ref_server/relay/routes.py``), health and metrics (``ref_server/operations.py``); this module
adds what they share: the request guard (:mod:`ref_server.limits`: bearer-token auth, body limits and deadlines,
strict JSON, request metrics with 5xx and disconnects told apart), short error bodies and the lifespan hook. Every
bad input is answered with a 4xx and a short ``{"detail": ...}`` naming the problem (OpenAI's ``{"error": ...}`` on
the OpenAI-style routes: :func:`ref_server.http.error_body`), never echoing the input; the server keeps serving.
The API docs (``/docs``, ``/redoc``, ``/openapi.json``; their scripts and styles served by this server,
:mod:`ref_server.api_docs`, so they render offline) open without the token unless ``ref_server.public_docs`` is
false: a browser cannot send a bearer token to open them, and they describe the API, not its data.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from ref_server import operations, session_routes
from ref_server.api_docs import install_api_docs
from ref_server.http import install_short_errors
from ref_server.hub import curriculum_routes
from ref_server.hub import routes as hub_routes
from ref_server.limits import RequestGuard
from ref_server.metrics import ServerMetrics
from ref_server.relay import routes as weights
from ref_server.scorer_pool import routes as scorer_routes
from ref_server.scoring import logprobs_routes
from ref_server.state import ServerState
from ref_server.tool_api import completions_routes, prm_routes, tokenizer_routes

__all__ = ["ServerState", "create_app"]


def create_app(state: ServerState, on_ready: Callable[[], None] | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if on_ready is not None:
            on_ready()
        yield

    app = FastAPI(title="grpo-stack reference server", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Reference logprobs for any tool, the rollout hub and the weight relay.")
    docs_paths = install_api_docs(app)
    metrics = ServerMetrics(state)
    app.state.server = state
    app.state.metrics = metrics
    for module in (logprobs_routes, completions_routes, tokenizer_routes, scorer_routes, hub_routes,
                   curriculum_routes, session_routes, weights, operations):
        app.include_router(module.router)
    if state.prm is not None:  # vLLM's /pooling for a process reward model (ref_server.prm_model)
        app.state.prm = state.prm
        app.include_router(prm_routes.router)

    install_short_errors(app)
    open_paths = {"/healthz"}
    if state.public_docs:
        open_paths |= {app.openapi_url, *docs_paths}
    if state.token is not None:
        _document_bearer_auth(app, open_paths)
    app.add_middleware(RequestGuard, state=state, metrics=metrics, router=app.router,
                       open_paths=frozenset(p for p in open_paths if p))
    return app


def _document_bearer_auth(app: FastAPI, open_paths: set[str | None]) -> None:
    """The schema says every operation but the open ones needs the bearer token, so /docs offers an "Authorize"
    button and its "Try it out" requests carry the token."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            schema.setdefault("components", {})["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer", "description": "ref_server.token (or GRPO_TOKEN)"}}
            for path, operations in schema.get("paths", {}).items():
                for operation in operations.values():
                    if path not in open_paths:
                        operation["security"] = [{"bearer": []}]
        return app.openapi_schema

    app.openapi = openapi
