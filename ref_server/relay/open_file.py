"""A relay download answered from a file the route opened itself.

The relay deletes old versions whenever a newer one is published (``WeightStore._prune``) or a learner registers
another layout. Starlette's ``FileResponse`` takes a path and stats and opens it only when the answer is sent, after
the route returned: a version pruned in that window ended in an unhandled error (500, or a 200 cut off after its
headers). Here the route opens the file first, so a version that is gone is its 404 and a version deleted after the
open is still sent whole (an unlinked file stays readable through its open descriptor)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, TYPE_CHECKING

import anyio
from starlette.responses import Response

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

CHUNK_BYTES = 1024 * 1024


def open_version(path: Path | None) -> IO[bytes] | None:
    """``path`` opened for reading, or None when there is none or it was deleted meanwhile (blocking: call it in a
    worker thread)."""
    if path is None:
        return None
    try:
        return open(path, "rb")  # noqa: SIM115 (closed by OpenFileResponse once sent)
    except FileNotFoundError:
        return None


class OpenFileResponse(Response):
    """The whole of an open file (closed once sent, or when the client leaves), with its size as Content-Length."""

    def __init__(self, file: IO[bytes], filename: str, media_type: str) -> None:
        self.file = file
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        size = os.fstat(file.fileno()).st_size
        self.init_headers({"content-length": str(size),
                           "content-disposition": f'attachment; filename="{filename}"'})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as task_group:

                async def send_file() -> None:
                    await self._send_file(send, scope.get("method", "GET").upper() == "HEAD")
                    task_group.cancel_scope.cancel()

                task_group.start_soon(send_file)
                while (await receive())["type"] != "http.disconnect":  # a client that leaves ends the reading
                    pass
                task_group.cancel_scope.cancel()
        finally:
            self.file.close()

    async def _send_file(self, send: Send, header_only: bool) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        more = not header_only
        while more:
            chunk = await anyio.to_thread.run_sync(self.file.read, CHUNK_BYTES)
            more = len(chunk) == CHUNK_BYTES
            await send({"type": "http.response.body", "body": chunk, "more_body": more})
        if header_only:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
