"""The weight relay's endpoints: the learner publishes versions, generators download them."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Request
from fastapi.responses import FileResponse

from ref_server.routes.common import OCTET, State, binary_body
from ref_server.weights import WeightsConflict, WeightsRejected, WeightsTooLarge

router = APIRouter(tags=["weights"])
VersionPath = Annotated[int, Path(ge=0, lt=10**10, description="Weights version (the learner's policy version).")]


@router.get("/v1/weights")
async def weights_version(state: State) -> dict:
    """The newest published weights version (null before the first)."""
    return {"version": state.weights.current}


@router.put("/v1/weights/{version}", openapi_extra=binary_body("a safetensors state dict"))
async def upload_weights(request: Request, version: VersionPath,
                         state: State) -> dict:
    """Publish a new weights version, streamed to disk (never held in memory whole)."""
    newest_allowed = state.hub.learner_version + state.max_version_ahead
    if version > newest_allowed:
        # a version far ahead would make every queued and future group look stale and stall the run
        raise HTTPException(409, f"weights version {version} is more than {state.max_version_ahead} ahead of the "
                            f"learner's reported version {state.hub.learner_version}")
    try:
        size = await state.weights.receive(version, request.stream())
    except WeightsTooLarge as exc:
        raise HTTPException(413, str(exc)) from None
    except WeightsConflict as exc:
        raise HTTPException(409, str(exc)) from None
    except WeightsRejected as exc:
        raise HTTPException(400, str(exc)) from None
    return {"version": version, "bytes": size}


@router.get("/v1/weights/{version}", responses={200: {"content": {OCTET: {}}}})
async def download_weights(version: VersionPath, state: State):
    path = state.weights.path_for(version)
    if path is None:
        raise HTTPException(404, f"weights version {version} is not available (current: {state.weights.current})")
    return FileResponse(path, media_type=OCTET, filename=path.name)
