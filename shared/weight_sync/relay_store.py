"""The weight relay: versioned safetensors files on disk, written as they stream in and served as files.

Neither direction holds a state dict in memory: an upload is copied chunk by chunk into a temporary file that is
renamed into place only once complete and valid (so a half-written version is never served), and a download is a
file response (``ref_server/relay/routes.py``). The newest ``keep`` versions are kept; older ones are deleted.
A file is published only when its safetensors header (:mod:`shared.protocol.safetensors_header`) is valid and its
tensors tile the rest of the file exactly, and, once a learner registered its model's layout
(``POST /v1/learner/session``), only when its tensor names, dtypes and shapes are that layout's: weights
that would not load into the model never reach a generator.

The layout comes from the learner's registration, which the hub keeps (``ref_server/session.py``): the store is
given a way to read it, and is told to drop what no longer matches when a learner registers another.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from shared.protocol.safetensors_header import HeaderError, check_data_offsets, read_header
from shared.weight_sync.layout import Layout

log = logging.getLogger("grpo.ref_server.weights")
_NAME = re.compile(r"^v(\d{10})\.safetensors$")


class WeightsRejected(ValueError):
    """An upload that cannot become a version (not newer than the current one, malformed, too large)."""


class WeightsTooLarge(WeightsRejected):
    """The upload passed the configured size limit (HTTP 413)."""


class WeightsConflict(WeightsRejected):
    """The version is not newer than the current one (HTTP 409)."""


def _flush_to_disk(fh) -> None:
    fh.flush()
    os.fsync(fh.fileno())


# the relay's allow-list: what the rollout wire takes (names of the one table in safetensors_header.py)
RELAY_DTYPES = frozenset({"BOOL", "U8", "I8", "I16", "I32", "I64", "F16", "BF16", "F32", "F64"})


class WeightStore:
    def __init__(self, directory: str | Path, *, keep: int = 2, max_bytes: int,
                 layout: Callable[[], Layout | None] = lambda: None) -> None:
        """``layout``: the registered learner's model layout (None: none registered); uploads must match it."""
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.max_bytes = max_bytes
        self.layout = layout
        self._lock = threading.Lock()
        for tmp in self.directory.glob("*.partial"):
            tmp.unlink()
        self.versions = sorted(int(m.group(1)) for p in self.directory.iterdir() if (m := _NAME.match(p.name)))

    def drop_mismatched(self) -> None:
        """A learner registered another layout: stored versions that do not match it are deleted (they would not
        load into the model)."""
        with self._lock:
            for stored in list(self.versions):
                problem = self._file_mismatch(self.directory / f"v{stored:010d}.safetensors")
                if problem is not None:
                    log.warning("weights version %d does not match the registered layout (%s): deleted", stored,
                                problem)
                    (self.directory / f"v{stored:010d}.safetensors").unlink(missing_ok=True)
                    self.versions.remove(stored)

    def _file_mismatch(self, path: Path) -> str | None:
        try:
            with open(path, "rb") as fh:
                head = fh.read(8)
                header = read_header(head + fh.read(min(int.from_bytes(head, "little"), 2**27)), RELAY_DTYPES)
        except (OSError, HeaderError) as exc:
            return str(exc)
        layout = self.layout()
        return layout.mismatch(header) if layout is not None else None

    @property
    def current(self) -> int | None:
        return self.versions[-1] if self.versions else None

    def path_for(self, version: int) -> Path | None:
        path = self.directory / f"v{version:010d}.safetensors"
        return path if version in self.versions and path.exists() else None

    async def receive(self, version: int, chunks: AsyncIterator[bytes]) -> int:
        """Stream an upload to disk; publish it as ``version`` once complete. Returns the byte count."""
        if version < 0 or version >= 10**10:
            raise WeightsRejected(f"version must be in [0, 1e10), got {version}")
        current = self.current
        if current is not None and version <= current:
            raise WeightsConflict(f"version {version} is not newer than the current version {current}")
        final = self.directory / f"v{version:010d}.safetensors"
        # its own temporary file: the same version may be uploaded twice at once (a request sent again while the
        # first is still being received), and a shared name would let one truncate or remove the other's file
        partial = final.with_name(f"{final.stem}.{uuid.uuid4().hex}.partial")
        size = 0
        try:
            # the disk work runs in a worker thread: a multi-GB upload must not stall the other endpoints
            with open(partial, "wb") as fh:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise WeightsTooLarge(f"upload exceeds the {self.max_bytes}-byte limit for weights")
                    await asyncio.to_thread(fh.write, chunk)
                await asyncio.to_thread(_flush_to_disk, fh)
            await asyncio.to_thread(self._publish, partial, final, version, size)
        finally:
            partial.unlink(missing_ok=True)
        log.info("published weights version %d (%.1f MB)", version, size / 2**20)
        return size

    def _publish(self, partial: Path, final: Path, version: int, size: int) -> None:
        self._check_file(partial, size)
        with self._lock:
            current = self.current
            if current is not None and version <= current:
                raise WeightsConflict(f"version {version} is not newer than the current version {current}")
            os.replace(partial, final)
            self.versions.append(version)
            self._prune()

    def _check_file(self, path: Path, size: int) -> None:
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise WeightsRejected("weights upload is not safetensors: shorter than 8 bytes")
            header_size = int.from_bytes(head, "little")
            if header_size > size - 8:
                raise WeightsRejected("weights upload is not safetensors: truncated header")
            try:
                header = read_header(head + fh.read(min(header_size, 2**27)), RELAY_DTYPES)
                end = check_data_offsets(header)
            except HeaderError as exc:
                raise WeightsRejected(f"weights upload: {exc}") from None
        if (layout := self.layout()) is not None and (problem := layout.mismatch(header)) is not None:
            raise WeightsRejected(f"weights upload does not match the model's layout: {problem}")
        if 8 + header_size + end != size:
            raise WeightsRejected(f"weights upload is truncated: {size} bytes, header describes {8 + header_size + end}")

    def _prune(self) -> None:
        while len(self.versions) > self.keep:
            old = self.versions.pop(0)
            (self.directory / f"v{old:010d}.safetensors").unlink(missing_ok=True)

    def keep_newest(self) -> None:
        """At shutdown: only the newest version stays on disk (what a resumed run's generators load first); the
        others were kept for downloads in flight, and there are none any more."""
        with self._lock:
            keep, self.keep = self.keep, 1
            self._prune()
            self.keep = keep
