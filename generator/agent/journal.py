"""Which episodes a generator process is driving, kept in a file, so that the next generator started on the same
folder counts what a killed one lost (``episodes_dropped_at_restart``).

An episode lives in the generator's memory until its batch's groups go to the rollout loop: a process killed
(SIGKILL, OOM, a node lost) meanwhile loses the batch, and nothing of it was uploaded. It cannot count that loss
itself, so each process keeps a file, ``<generator.weights_dir>/agent-episodes/<host>-<pid>-<n>.open``, listing
the ids of the episodes it is driving (written when a batch opens them, emptied when the batch is handed on,
deleted at a clean exit) and holds an exclusive ``flock`` on it for its life. The kernel releases that lock when
the process ends, however it ends, so a file nobody holds is a dead process's: a generator starting on the folder
takes its lock, counts the ids in it and deletes it (checking it still is the file at that path: two generators
starting at once count it once).
"""

from __future__ import annotations

import fcntl
import itertools
import os
import socket
from pathlib import Path

FOLDER = "agent-episodes"   # under generator.weights_dir
SUFFIX = ".open"
_instances = itertools.count()


def journal_dir(weights_dir: str | Path) -> Path:
    return Path(weights_dir) / FOLDER


class EpisodeJournal:
    """This process's file of the episodes it is driving, locked while it lives."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / f"{socket.gethostname()}-{os.getpid()}-{next(_instances)}{SUFFIX}"
        self._file = open(self.path, "a", encoding="utf-8")   # noqa: SIM115 - held (and locked) for the life
        fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def opened(self, episode_ids: list[str]) -> None:
        """A batch's episodes are being driven: one write, so a kill leaves all of them listed or none."""
        self._file.write("".join(f"{episode_id}\n" for episode_id in episode_ids))
        self._file.flush()

    def handed_on(self) -> None:
        """The batch is over (its groups go to the loop, or were dropped and counted): nothing is being driven."""
        self._file.truncate(0)

    def close(self) -> None:
        """A clean exit: the file goes (deleted while still locked, so no starting generator counts it)."""
        self.path.unlink(missing_ok=True)
        self._file.close()


def claim_orphans(folder: str | Path) -> dict[str, int]:
    """The journals in ``folder`` that no live process holds (their process was killed), each deleted once
    counted: file name -> episodes it listed (those that listed none left out)."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    found = {}
    for path in sorted(folder.glob(f"*{SUFFIX}")):
        count = _claim(path)
        if count:
            found[path.name] = count
    return found


def _claim(path: Path) -> int | None:
    """The episodes a dead process's journal lists, the file deleted; None when a live process holds it or
    another generator claimed it first."""
    try:
        file = open(path, encoding="utf-8")   # noqa: SIM115 - closed below, after the lock's checks
    except FileNotFoundError:
        return None
    with file:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None   # its process lives
        try:
            if os.stat(path).st_ino != os.fstat(file.fileno()).st_ino:
                return None
        except FileNotFoundError:
            return None   # claimed (and deleted) by another generator between our open and our lock
        count = sum(1 for line in file if line.strip())
        path.unlink()
        return count
