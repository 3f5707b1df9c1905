"""The rollout hub's on-disk spool: every accepted group is a file until the learner has trained on it.

* Writing is split in two so that the hub never holds its lock across a disk write: :meth:`RolloutSpool.write_many`
  puts an upload's groups under temporary names and fsyncs them with one wait for the disk (a group commit,
  :meth:`RolloutSpool.flush`; outside the lock), and :meth:`RolloutSpool.commit` renames each file to
  ``{seq:012d}-{group_id}.group``, its queue position (under the lock, a cheap rename). Only then is the group
  acknowledged to its generator.
* Only complete renames count: a half-written file keeps its ``.tmp`` name and is deleted on reload.
* :meth:`RolloutSpool.remove` deletes a group's file once the learner acknowledged it (or the hub dropped it).
* :meth:`RolloutSpool.quarantine` moves the file of a group that kept failing delivery to ``quarantine/``, with a
  ``.reason`` file beside it; reloads never pick it up again (only the spool's top folder is read).
* :meth:`RolloutSpool.set_failures` keeps a group's failed deliveries in ``<file>.failures`` beside it, so that a
  restart (a learner that crashes on a group stops ``grpo run``, hub included) does not start the count again.
* :meth:`RolloutSpool.reload` (at start-up) returns the spooled groups in sequence order, so that a restart, clean
  or not, queues again every group that was accepted and not yet trained on, in the order it had; a file that
  cannot be read or that the hub refuses is moved to ``corrupt/`` and counted, never silently deleted.
* Leases: :meth:`RolloutSpool.write_lease` keeps each lease the learner holds as ``<batch id>.lease`` beside the
  group files (small JSON: the batch id, its groups' sequence numbers, the wall-clock deadline and whether the
  learner trained it; written whole and renamed, as the failure counts), :meth:`RolloutSpool.remove_lease` deletes
  it when the lease is acknowledged or expires, and :meth:`RolloutSpool.reload` returns those found, so that a
  restart, clean or killed, still knows which groups the learner holds (a trained batch acknowledged after the
  restart is consumed, not queued again). A lease file that cannot be read is deleted with a log line: its groups
  are queued again like any spooled group. Not fsynced (like the failure counts): they survive a killed process,
  not a power cut.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shared.protocol.records import RolloutGroup
from shared.protocol.wire import WireError

log = logging.getLogger("grpo.ref_server.spool")


@dataclass
class SpooledGroup:
    """A group found on disk by :meth:`RolloutSpool.reload`, with the sequence number it was committed under."""

    seq: int
    group: RolloutGroup
    path: Path
    failures: int = 0   # failed deliveries recorded before the restart (RolloutSpool.set_failures)


@dataclass
class SpooledLease:
    """A lease file found by :meth:`RolloutSpool.reload`: the batch and its groups' sequence numbers."""

    batch_id: str
    seqs: list[int]
    deadline_unix: float   # wall clock; informative only (a reloaded lease gets a fresh lease timeout)
    trained: bool


@dataclass
class SpoolContents:
    """What :meth:`RolloutSpool.reload` found: the readable groups in sequence order, and how many were not; the
    readable lease files in batch id order."""

    groups: list[SpooledGroup] = field(default_factory=list)
    corrupt: int = 0
    leases: list[SpooledLease] = field(default_factory=list)


class RolloutSpool:
    """Group files under ``directory`` (created if missing). Not locked itself: the hub serialises the calls that
    must be (commit and remove run under its lock; write runs outside it on a name no one else uses)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def write(self, group_id: str, data: bytes) -> Path:
        """The group's bytes, durable on disk under a temporary name (no sequence number yet)."""
        return self.write_many([(group_id, data)])[0]

    def write_many(self, groups: list[tuple[str, bytes]]) -> list[Path]:
        """Group commit: each ``(group id, bytes)`` written under its temporary name, then all of them made durable
        together by one :meth:`flush` (one wait for the disk, not one per group). An error (a full disk) deletes
        the files this call wrote and is raised: none of the groups is spooled."""
        paths, files = [], []
        try:
            for group_id, data in groups:
                tmp = self.directory / f"{group_id}.tmp"
                paths.append(tmp)
                files.append(open(tmp, "wb"))  # closed below, after the flush
                files[-1].write(data)
                files[-1].flush()
            self.flush([fh.fileno() for fh in files])
        except BaseException:
            for fh in files:
                fh.close()
            self.discard(paths)
            raise
        for fh in files:
            fh.close()
        return paths

    @staticmethod
    def flush(fds: list[int]) -> None:
        """The durability wait of a group commit: every file in ``fds`` is fsynced before this returns.

        First the disk writes of all of them are started (``sync_file_range(SYNC_FILE_RANGE_WRITE)``: queued, not
        waited for), then each is fsynced in turn. The first fsync waits for its data and the journal commit; by
        then the others' data is written or in flight and their metadata is in that commit, so their fsyncs find
        little left to wait for. Correctness does not rest on that: each file gets its own fsync."""
        if _start_writeback is not None:
            for fd in fds:
                _start_writeback(fd)
        for fd in fds:
            os.fsync(fd)

    def discard(self, paths: list[Path]) -> None:
        """Delete temporary files of a group commit that will not be committed (an upload that failed)."""
        for tmp in paths:
            tmp.unlink(missing_ok=True)

    def commit(self, tmp: Path, seq: int, group_id: str) -> Path:
        """Rename a written file to its queue position (a half-written spool file is never picked up: only
        complete renames count)."""
        path = self.directory / f"{seq:012d}-{group_id}.group"
        os.replace(tmp, path)
        return path

    def remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)
        _failures_file(path).unlink(missing_ok=True)

    def quarantine(self, path: Path, reason: str) -> Path:
        """Move a group's file to ``quarantine/`` (and write ``reason`` beside it, as ``<name>.reason``)."""
        folder = self.directory / "quarantine"
        folder.mkdir(exist_ok=True)
        (folder / f"{path.name}.reason").write_text(reason + "\n")
        target = folder / path.name
        os.replace(path, target)
        _failures_file(path).unlink(missing_ok=True)
        return target

    def set_failures(self, path: Path, failures: int) -> None:
        """Record a group's failed deliveries beside its file (replaced whole: a crash leaves the old count)."""
        tmp = path.with_name(f"{path.name}.failures.tmp")
        tmp.write_text(f"{failures}\n")
        os.replace(tmp, _failures_file(path))

    def write_lease(self, lease: SpooledLease) -> None:
        """Keep a lease as ``<batch id>.lease`` (replaced whole by a rename: a killed hub leaves the old one)."""
        body = {"batch_id": lease.batch_id, "seqs": lease.seqs, "deadline_unix": lease.deadline_unix,
                "trained": lease.trained}
        path = self._lease_file(lease.batch_id)
        tmp = path.with_name(f"{path.name}.tmp")
        tmp.write_text(json.dumps(body, separators=(",", ":")))
        os.replace(tmp, path)

    def remove_lease(self, batch_id: str) -> None:
        self._lease_file(batch_id).unlink(missing_ok=True)

    def _lease_file(self, batch_id: str) -> Path:
        if not _BATCH_ID.fullmatch(batch_id):   # a batch id becomes a file name: only the hub's own hex ids
            raise ValueError(f"batch id {batch_id!r} is not 32 lowercase hex digits")
        return self.directory / f"{batch_id}.lease"

    def reload(self, check: Callable[[RolloutGroup], None]) -> SpoolContents:
        """The spooled groups in sequence order (temporary files of unfinished writes are deleted).

        ``check`` raises ValueError for a decoded group the hub cannot take back (e.g. sampled at another
        temperature than the hub now batches); such a file, like an unreadable one, is moved to ``corrupt/``."""
        for tmp in self.directory.glob("*.tmp"):
            tmp.unlink()
        for counts in self.directory.glob("*.group.failures"):
            if not counts.with_suffix("").exists():   # its group was consumed just before a crash
                counts.unlink()
        found = SpoolContents()
        for path in sorted(self.directory.glob("*.group")):
            try:
                # Keep the spooled sequence number so that order survives any number of restarts.
                seq = int(path.name.split("-", 1)[0])
                group = RolloutGroup.from_bytes(path.read_bytes())
                check(group)
            except (WireError, ValueError, OSError) as exc:
                found.corrupt += 1
                bad = self.directory / "corrupt"
                bad.mkdir(exist_ok=True)
                os.replace(path, bad / path.name)
                log.error("spool file %s is unreadable (%s); moved to %s", path.name, exc, bad)
                continue
            found.groups.append(SpooledGroup(seq, group, path, _read_failures(path)))
        for path in sorted(self.directory.glob("*.lease")):
            lease = _read_lease(path)
            if lease is None:
                path.unlink(missing_ok=True)
            else:
                found.leases.append(lease)
        return found


_BATCH_ID = re.compile(r"[0-9a-f]{32}")


def _writeback_starter() -> Callable[[int], None] | None:
    """``sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)`` from the C library (Linux; Python's os lacks it), or None
    where there is none: then :meth:`RolloutSpool.flush` only fsyncs, one file after the other."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    call.restype = ctypes.c_int
    sync_file_range_write = 2

    def start(fd: int) -> None:
        call(fd, 0, 0, sync_file_range_write)  # a hint: a failure here is found by the fsync that follows

    return start


_start_writeback = _writeback_starter()


def _read_lease(path: Path) -> SpooledLease | None:
    """The lease in ``path``, or None (logged) when it cannot be read or is not a lease this hub wrote."""
    try:
        body = json.loads(path.read_text())
        lease = SpooledLease(body["batch_id"], body["seqs"], body["deadline_unix"], body["trained"])
        if not (isinstance(lease.batch_id, str) and _BATCH_ID.fullmatch(lease.batch_id)
                and path.name == f"{lease.batch_id}.lease" and isinstance(lease.seqs, list)
                and all(type(seq) is int and seq >= 0 for seq in lease.seqs)
                and type(lease.deadline_unix) in (int, float) and type(lease.trained) is bool):
            raise ValueError("fields of the wrong type or a batch id that is not the file's")
    except (OSError, ValueError, KeyError, TypeError) as exc:   # json's errors are ValueErrors
        log.error("lease file %s is unreadable (%s); ignored, its groups are queued again", path.name, exc)
        return None
    return lease


def _failures_file(path: Path) -> Path:
    return path.with_name(f"{path.name}.failures")


def _read_failures(path: Path) -> int:
    counts = _failures_file(path)
    try:
        return max(0, int(counts.read_text()))
    except FileNotFoundError:
        return 0
    except (OSError, ValueError) as exc:
        log.error("unreadable failure count %s (%s); counting from 0", counts.name, exc)
        return 0
