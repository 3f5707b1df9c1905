"""The learner session: which learner the hub takes version reports and weights uploads from.

A learner registers (``POST /v1/learner/session``, :mod:`ref_server.session_routes`) with its version and its
model's layout and gets a session id; its later reports and uploads carry it (``X-Learner-Session``), and anyone
else's are refused (:class:`NotTheLearner`). The registration is kept in ``learner.json`` (the session, the
learner's last version, whether it ended) and ``layout.json`` in the relay's folder, so a hub restart keeps it. The
hub (version reports) and the relay (uploads, which must match the layout) both read it here; neither owns it.

A live session cannot be taken over: while the registered learner has been heard from (a registration, a version
report, an upload, a heartbeat) within ``ttl_s``, a registration that does not present its session id (``resume``,
which a resumed learner reads from its checkpoint folder) is refused (:class:`SessionTaken`). Without a token (the
default on 127.0.0.1) any local process could otherwise register and make the hub refuse the real learner. A session
that has gone quiet past the TTL (a learner that crashed and will not resume), or that its learner ended (a clean
exit), can be replaced by any new registration. A hub restart gives the kept session a fresh TTL (the hub's downtime
is not the learner's silence).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from shared.weight_sync.layout import Layout

log = logging.getLogger("grpo.ref_server.session")

LEARNER_FILE = "learner.json"   # the registered learner's session and last version
LAYOUT_FILE = "layout.json"     # its model's layout


class SessionRefused(ValueError):
    """A request the learner session does not allow (HTTP 409)."""


class NotTheLearner(SessionRefused):
    """A version report or upload that does not name the registered learner session."""


class SessionTaken(SessionRefused):
    """A new learner registration while the registered session is live."""


class LearnerSessionStore:
    def __init__(self, directory: str | Path, *, ttl_s: float = 60.0) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # the registered learner: its session id, its model's layout, its last version (None: none registered)
        self.id: str | None = None
        self.layout: Layout | None = None
        self.learner_version: int | None = None
        self.ttl_s = ttl_s
        self.seen = time.monotonic()   # when the session was last heard from (a restart: now)
        self.ended = False             # its learner ended it (a clean exit): replaceable at once
        self._load()

    def live(self) -> bool:
        """A registered session that its learner has not ended and was heard from within ``ttl_s``."""
        return self.id is not None and not self.ended and time.monotonic() - self.seen < self.ttl_s

    def register(self, version: int, layout: Layout | None, resume: str | None = None,
                 adopt_layout: Callable[[], None] = lambda: None) -> tuple[str, bool]:
        """A learner (re)starts: its session, its version, and its model's layout (``None`` keeps the registered
        one; ``adopt_layout`` is called once a new one is set, before it is saved: the relay drops the stored
        versions that do not match it). Returns ``(session id, resumed)``: a learner presenting the registered
        session id (``resume``) takes it back (the same id); otherwise a new session id, whose registration is
        refused (:class:`SessionTaken`) while the registered session is live. An earlier session's reports and
        uploads are refused from then on."""
        with self._lock:
            resumed = resume is not None and resume == self.id
            if not resumed and self.live():
                quiet = time.monotonic() - self.seen
                raise SessionTaken(
                    f"another learner's session is live (heard from {quiet:.0f}s ago; it is replaceable once quiet "
                    f"for {self.ttl_s:.0f}s, ref_server.learner_session_ttl_s). A resumed learner takes its "
                    "session back with --resume (its id is in its checkpoint_dir); a second learner cannot join "
                    "a running one")
            if not resumed:
                self.id = uuid.uuid4().hex
            self.seen, self.ended = time.monotonic(), False
            self.learner_version = version
            if layout is not None:
                self.layout = layout
                adopt_layout()
            self._save(with_layout=True)
            return self.id, resumed

    def check(self, session: str | None) -> None:
        """Refuse (:class:`NotTheLearner`) a report or upload from anyone but the registered learner session, once
        one is registered (before that, any request without a session id may: a hub used without a learner, by
        tools and tests; one naming a session this hub never issued may not). The registered learner's requests keep
        its session live."""
        if self.id is None and session is not None:
            # a learner of another hub (this port's earlier run, a hub restarted on empty folders) would otherwise
            # set this one's version and weights before its own learner registers
            raise NotTheLearner("this hub has no learner session registered, and the request names one it never "
                                "issued (a learner of an earlier hub on this address, or the hub restarted "
                                "with an empty ref_server.weights_dir): restart the learner to register")
        if self.id is not None and session != self.id:
            raise NotTheLearner("not the registered learner session (another learner registered since, or the "
                                "request did not come from the learner): restart the learner to register again")
        if self.id is not None:
            self.seen = time.monotonic()

    def end(self, session: str | None) -> None:
        """The registered learner ends its session (a clean exit): a new learner may register at once. Reports and
        uploads from anyone else are still refused until one does."""
        self.check(session)
        with self._lock:
            if self.id is not None and not self.ended:
                self.ended = True
                self._save()

    def note_version(self, version: int) -> None:
        """The registered learner's version report was accepted: kept across hub restarts."""
        with self._lock:
            if self.id is not None and version != self.learner_version:
                self.learner_version = version
                self._save()

    def _save(self, with_layout: bool = False) -> None:
        """learner.json (small: rewritten at each version report) and, at a registration, layout.json."""
        if with_layout:
            self._write(LAYOUT_FILE, self.layout.to_json() if self.layout is not None else None)
        self._write(LEARNER_FILE, {"session": self.id, "version": self.learner_version, "ended": self.ended})

    def _write(self, name: str, record: object) -> None:
        tmp = self.directory / (name + ".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.directory / name)

    def _load(self) -> None:
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
        self.id, self.learner_version, self.layout = session, version, layout
        self.ended = record.get("ended") is True
