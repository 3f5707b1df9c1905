"""The weight relay: versioned safetensors files on disk, written as they stream in and served as files.

Neither direction holds a state dict in memory: an upload is copied chunk by chunk into a temporary file that is
renamed into place only once complete and valid (so a half-written version is never served), and a download is a
file response (``ref_server/relay/routes.py``). The newest ``keep`` versions are kept; older ones are deleted.
A file is published only when its safetensors header (:mod:`shared.protocol.safetensors_header`) is valid and its
tensors tile the rest of the file exactly, and, once a learner registered its model's layout
(:meth:`WeightStore.register_learner`), only when its tensor names, dtypes and shapes are that layout's: weights
that would not load into the model never reach a generator.

The store also keeps the learner's registration (``learner.json`` and ``layout.json`` beside the versions, so a hub restart keeps it):
the session id that version reports and uploads must carry, the layout, and the learner's last version.

A live session cannot be taken over: while the registered learner has been heard from (a registration, a version
report, an upload, a heartbeat) within ``session_ttl_s``, a registration that does not present its session id
(``resume``, which a resumed learner reads from its checkpoint folder) is refused (:class:`SessionTaken`). Without a
token (the default on 127.0.0.1) any local process could otherwise register and make the hub refuse the real
learner. A session that has gone quiet past the TTL (a learner that crashed and will not resume), or that its
learner ended (a clean exit), can be replaced by any new registration. A hub restart gives the kept session a fresh
TTL (the hub's downtime is not the learner's silence).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator
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


class NotTheLearner(WeightsConflict):
    """A version report or upload that does not name the registered learner session (HTTP 409)."""


class SessionTaken(WeightsConflict):
    """A new learner registration while the registered session is live (HTTP 409)."""


LEARNER_FILE = "learner.json"   # the registered learner's session and last version
LAYOUT_FILE = "layout.json"     # its model's layout


def _flush_to_disk(fh) -> None:
    fh.flush()
    os.fsync(fh.fileno())


# the relay's allow-list: what the rollout wire takes (names of the one table in safetensors_header.py)
RELAY_DTYPES = frozenset({"BOOL", "U8", "I8", "I16", "I32", "I64", "F16", "BF16", "F32", "F64"})


class WeightStore:
    def __init__(self, directory: str | Path, *, keep: int = 2, max_bytes: int, session_ttl_s: float = 60.0) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        for tmp in self.directory.glob("*.partial"):
            tmp.unlink()
        self.versions = sorted(int(m.group(1)) for p in self.directory.iterdir() if (m := _NAME.match(p.name)))
        # the registered learner: its session id, its model's layout, its last version (None: none registered)
        self.session: str | None = None
        self.layout: Layout | None = None
        self.learner_version: int | None = None
        self.session_ttl_s = session_ttl_s
        self.session_seen = time.monotonic()   # when the session was last heard from (a restart: now)
        self.session_ended = False             # its learner ended it (a clean exit): replaceable at once
        self._load_learner()

    # -- the registered learner ------------------------------------------------------------------------------
    def session_live(self) -> bool:
        """A registered session that its learner has not ended and was heard from within ``session_ttl_s``."""
        return (self.session is not None and not self.session_ended
                and time.monotonic() - self.session_seen < self.session_ttl_s)

    def register_learner(self, version: int, layout: Layout | None, resume: str | None = None) -> tuple[str, bool]:
        """A learner (re)starts: its session, its version, and its model's layout (``None`` keeps the registered
        one). Returns ``(session id, resumed)``: a learner presenting the registered session id (``resume``) takes
        it back (the same id); otherwise a new session id, whose registration is refused (:class:`SessionTaken`)
        while the registered session is live. An earlier session's reports and uploads are refused from then on.
        Stored versions that do not match the layout are deleted: they would not load into the model."""
        with self._lock:
            resumed = resume is not None and resume == self.session
            if not resumed and self.session_live():
                quiet = time.monotonic() - self.session_seen
                raise SessionTaken(
                    f"another learner's session is live (heard from {quiet:.0f}s ago; it is replaceable once quiet "
                    f"for {self.session_ttl_s:.0f}s, ref_server.learner_session_ttl_s). A resumed learner takes its "
                    "session back with --resume (its id is in its checkpoint_dir); a second learner cannot join "
                    "a running one")
            if not resumed:
                self.session = uuid.uuid4().hex
            self.session_seen, self.session_ended = time.monotonic(), False
            self.learner_version = version
            if layout is not None:
                self.layout = layout
                for stored in list(self.versions):
                    problem = self._file_mismatch(self.directory / f"v{stored:010d}.safetensors")
                    if problem is not None:
                        log.warning("weights version %d does not match the registered layout (%s): deleted", stored,
                                    problem)
                        (self.directory / f"v{stored:010d}.safetensors").unlink(missing_ok=True)
                        self.versions.remove(stored)
            self._save_learner(with_layout=True)
            return self.session, resumed

    def check_session(self, session: str | None) -> None:
        """Refuse (:class:`NotTheLearner`) a report or upload from anyone but the registered learner session, once
        one is registered (before that, anyone may: a hub used without a learner, by tools and tests). The
        registered learner's requests keep its session live."""
        if self.session is not None and session != self.session:
            raise NotTheLearner("not the registered learner session (another learner registered since, or the "
                                "request did not come from the learner): restart the learner to register again")
        if self.session is not None:
            self.session_seen = time.monotonic()

    def end_session(self, session: str | None) -> None:
        """The registered learner ends its session (a clean exit): a new learner may register at once. Reports and
        uploads from anyone else are still refused until one does."""
        self.check_session(session)
        with self._lock:
            if self.session is not None and not self.session_ended:
                self.session_ended = True
                self._save_learner()

    def note_version(self, version: int) -> None:
        """The registered learner's version report was accepted: kept across hub restarts."""
        with self._lock:
            if self.session is not None and version != self.learner_version:
                self.learner_version = version
                self._save_learner()

    def _save_learner(self, with_layout: bool = False) -> None:
        """learner.json (small: rewritten at each version report) and, at a registration, layout.json."""
        if with_layout:
            self._write(LAYOUT_FILE, self.layout.to_json() if self.layout is not None else None)
        self._write(LEARNER_FILE, {"session": self.session, "version": self.learner_version,
                                   "ended": self.session_ended})

    def _write(self, name: str, record: object) -> None:
        tmp = self.directory / (name + ".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.directory / name)

    def _load_learner(self) -> None:
        path = self.directory / LEARNER_FILE
        if not path.exists():
            return
        try:
            record = json.loads(path.read_text())
            session, version = record["session"], record["version"]
            layout_path = self.directory / LAYOUT_FILE
            rows = json.loads(layout_path.read_text()) if layout_path.exists() else None
            layout = Layout.from_json(rows) if rows is not None else None
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("%s is unreadable (%s): no learner registered until one registers", path, exc)
            return
        self.session, self.learner_version, self.layout = session, version, layout
        self.session_ended = record.get("ended") is True

    def _file_mismatch(self, path: Path) -> str | None:
        try:
            with open(path, "rb") as fh:
                head = fh.read(8)
                header = read_header(head + fh.read(min(int.from_bytes(head, "little"), 2**27)), RELAY_DTYPES)
        except (OSError, HeaderError) as exc:
            return str(exc)
        return self.layout.mismatch(header) if self.layout is not None else None

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
        if self.layout is not None and (problem := self.layout.mismatch(header)) is not None:
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
