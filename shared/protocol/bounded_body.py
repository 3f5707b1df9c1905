"""A request body read no further than its limit: one home for every server of the project (the ref server's
routes, the generator's agent endpoint). Refused as soon as a declared ``Content-Length`` or the bytes received
pass the limit, never read whole first."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


async def read_bounded(request: Any, limit: int, refuse: Callable[[str], Exception]) -> bytes:
    """The body of ``request`` (a Starlette request: ``headers`` and ``stream()``); ``refuse(reason)`` is raised
    past ``limit`` bytes (the caller's 413)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise refuse(f"request body of {declared} bytes exceeds the {limit}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise refuse(f"request body exceeds the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)
