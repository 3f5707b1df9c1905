"""The curriculum's endpoint: generators report solved shares and read the settled prompts
(ref_server/hub/curriculum.py)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException
from starlette.concurrency import run_in_threadpool

from ref_server.http import State
from ref_server.hub.curriculum import RuleMismatch
from shared.protocol.curriculum_messages import CurriculumAnswer, CurriculumReport

router = APIRouter(tags=["hub"])


@router.post("/v1/curriculum")
async def curriculum_report(report: CurriculumReport, state: State) -> CurriculumAnswer:
    """Record the solved share of each group a generator scored since its last report (and its draws), and answer
    the settled prompts (solved always or never in their last appearances, every generator's together) unless the
    generator holds their version already (``since``). 409 when the report's window or min_appearances differ from
    those the hub's table counts (another generator's)."""
    try:
        return await run_in_threadpool(state.curriculum.report, report)
    except RuleMismatch as exc:
        raise HTTPException(409, str(exc)) from None


@router.get("/v1/curriculum")
async def curriculum_stats(state: State) -> dict:
    """The table's size and rule, and the generators' draws: prompts tracked and settled, drawn and skipped."""
    return await run_in_threadpool(state.curriculum.stats)
