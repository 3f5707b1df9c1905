"""Health and Prometheus metrics: ``GET /healthz``, ``GET /metrics``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ref_server.http import State

router = APIRouter(tags=["operations"])


@router.get("/healthz")
async def healthz(state: State) -> dict:
    """``reference_model_loaded``: a scorer holds the reference model now (this process's own, or a joined one);
    ``reference_model_configured``: this hub scores the reference at all (groups wait for a scorer meanwhile)."""
    scorer = state.scorer
    loaded = scorer is not None and (scorer.local is not None or scorer.scorers() > 0)
    return {"status": "ok", "model": state.model_name, "reference_model_loaded": loaded,
            "reference_model_configured": scorer is not None,
            "vocab_size": state.vocab_size, "max_context": state.max_context,
            "queue_depth": state.hub.depth(), "weights_version": state.weights.current,
            "learner_version": state.hub.learner_version,
            # who scores the reference: "local", "local + N joined", "N joined", "no scorer" (groups wait); null: nobody
            "scoring": state.scorer.status() if state.scorer is not None else None,
            "scoring_jobs_waiting": state.scorer.queue_depth() if state.scorer is not None else 0,
            # on-policy distillation's teacher (ref_server.teacher_model): its folder and who scores it; null: none
            "teacher_model": (state.teacher_identity or {}).get("model"),
            "teacher_scoring": state.teacher.status() if state.teacher is not None else None,
            # top-k distillation (algorithm.distill.mode topk_forward_kl): the teacher's top-k per token; 0: none
            "teacher_top_k": state.hub.teacher_top_k,
            "teacher_scoring_jobs_waiting": state.teacher.queue_depth() if state.teacher is not None else 0,
            # per model scored: scoring, jobs_waiting, oldest_job_wait_s, down_s (nobody to score) and groups (the
            # hub's groups waiting for its logprobs); the same rule for the reference's and the teacher's scorers
            "scoring_pools": state.scoring_health()}


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
