"""Scoring and uploading on a thread of its own, so the engine keeps decoding while rewards run and requests wait.

Complete groups queue here; the thread takes all that are waiting, scores them (``RolloutLoop.build_group``: the
reward functions, dynamic sampling, the group's checks), applies the failure rule and uploads them in one request,
at most one request every ``upload_interval_s`` (a generator finishing a group every few milliseconds would
otherwise send a request for each). An error on the thread (a reward failing too often, a hub out of retries, a
livelock) is kept and raised in the schedule's thread by :meth:`GroupUploader.raise_if_failed`.
"""

from __future__ import annotations

import threading
import time

from generator.continuous.groups import OpenGroup


class GroupUploader:
    def __init__(self, loop, upload_interval_s: float, max_groups: int | None = None) -> None:
        self.loop = loop
        self.upload_interval_s = upload_interval_s
        self.max_groups = max_groups
        self._waiting: list[OpenGroup] = []
        self._working = 0            # groups taken by the thread and not yet uploaded
        self._closing = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="grpo-uploader", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Complete groups not yet uploaded (waiting or being scored/uploaded)."""
        with self._cond:
            return len(self._waiting) + self._working

    def put(self, group: OpenGroup) -> None:
        with self._cond:
            self._waiting.append(group)
            self._cond.notify()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Upload what is complete (a stop lets the current uploads finish), then end the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()

    def _take(self) -> list[OpenGroup] | None:
        """The next batch, once ``upload_interval_s`` has passed since the last upload; None: closing, none left."""
        with self._cond:
            while True:
                if self._waiting and (self._closing or time.monotonic() >= self._next_upload):
                    batch, self._waiting = self._waiting, []
                    self._working = len(batch)
                    return batch
                if self._closing and not self._waiting:
                    return None
                wait = self._next_upload - time.monotonic() if self._waiting else None
                self._cond.wait(wait)

    def _run(self) -> None:
        self._next_upload = 0.0
        while (batch := self._take()) is not None:
            try:
                self._upload(batch)
            except BaseException as exc:  # noqa: BLE001 -- raised again in the schedule's thread
                self._error = exc
                with self._cond:
                    self._waiting.clear()
                    self._working = 0
                return
            with self._cond:
                self._working = 0
            self._next_upload = time.monotonic() + self.upload_interval_s

    def _upload(self, batch: list[OpenGroup]) -> None:
        loop, stats = self.loop, self.loop.stats
        groups = []
        for open_group in batch:
            group = loop.build_group(open_group.example, open_group.prompt_ids, open_group.samples,
                                     policy_version=open_group.opened_version)
            stats.prompts += 1
            if group is not None:
                groups.append(group)
        loop.failures.check()   # a reward failing too often: stop before uploading this batch
        loop.record_kept(len(batch), len(groups))
        if self.max_groups is not None:
            groups = groups[:max(0, self.max_groups - stats.groups_uploaded)]
        if groups:
            loop.upload(groups)
        loop.progress.update(stats, loop.policy_version)
