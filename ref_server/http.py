"""What every router needs: the server's state (the ``State`` dependency), reading a bounded body, the binary
media type. No router is imported here: ``ref_server.state`` and what it imports never import a router."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request

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
