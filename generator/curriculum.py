"""A difficulty curriculum: each prompt's pass rate over its last appearances, and whether to draw it again.

A group's outcome is its *solved share*: the share of its completions whose total reward is at least ``threshold``.
:class:`PassRateTable` keeps each ``example_id``'s last ``window`` shares. A prompt whose recorded shares (at least
``min_appearances`` of them) are all 1.0 (solved always) or all 0.0 (solved never) gives GRPO no signal: every
completion of its group gets the same advantage. Such a prompt is skipped (``mode: skip``) or drawn with probability
``keep_prob`` (``mode: downweight``). :class:`CurriculumStream` applies the rule to a :class:`PromptStream`'s draws
and never skips everything: when every prompt would be skipped it draws normally and says so once.

With ``generator.curriculum.shared`` (the default) the table is the hub's (:class:`HubPassRateTable`): every
generator of the run reports to it and skips the same prompts, and it lives in the hub's spool folder, so a
restarted hub (`grpo run --resume`) keeps it; an older hub without the route leaves each generator its own."""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Literal

from shared.pass_rates import PassRates
from shared.protocol.curriculum_messages import MAX_SHARES_PER_REPORT, CurriculumReport

if TYPE_CHECKING:
    from generator.datasets.base import Example, PromptStream
    from shared.protocol.client import HubClient

log = logging.getLogger(__name__)

Mode = Literal["skip", "downweight"]
MODES = ("skip", "downweight")


def solved_share(totals: Iterable[float], threshold: float) -> float:
    """The share of a group's completions whose total reward is at least ``threshold``."""
    totals = list(totals)
    if not totals:
        raise ValueError("solved_share: a group without completions")
    return sum(1 for t in totals if t >= threshold) / len(totals)


class PassRateTable(PassRates):
    """The generator's own pass-rate table (shared/pass_rates.py), and the curriculum's verdict on drawing a prompt
    again."""

    def __init__(self, *, window: int = 4, min_appearances: int = 2, threshold: float = 1.0, mode: Mode = "skip",
                 keep_prob: float = 0.1, seed: int | str = 0) -> None:
        super().__init__(window=window, min_appearances=min_appearances)
        if mode not in MODES:
            raise ValueError(f"curriculum mode must be one of {list(MODES)}, got {mode!r}")
        if not 0.0 <= keep_prob <= 1.0:
            raise ValueError(f"curriculum keep_prob must be in [0, 1], got {keep_prob}")
        self.threshold, self.mode, self.keep_prob = threshold, mode, keep_prob
        self._rng = random.Random(f"curriculum/{seed}")

    def skip_set(self) -> set[str]:
        return self.settled()

    def should_draw(self, example_id: str) -> bool:
        """Whether to use a drawn ``example_id``: always for an unsettled prompt; for a settled one never (skip) or
        with probability ``keep_prob`` (downweight)."""
        if not self.is_settled(example_id):
            return True
        return self.mode == "downweight" and self._rng.random() < self.keep_prob

    def sync(self, drawn: int, skipped: int) -> None:
        """Before a draw: nothing to do for the generator's own table (:class:`HubPassRateTable` asks the hub)."""


class HubPassRateTable(PassRateTable):
    """The table the hub holds for every generator (ref_server/hub/curriculum.py): :meth:`sync` reports the groups
    scored since the last sync (and the draws) and reads the hub's settled prompts when they changed, at most every
    ``sync_interval_s`` (one request per engine call at most, never one per draw); its settled set decides the
    draws. :meth:`record` keeps the generator's own table too: when the hub has no curriculum route (an older hub,
    404) the generator decides alone from then on, and says so once."""

    def __init__(self, client: HubClient, *, sync_interval_s: float = 1.0, **rule) -> None:
        super().__init__(**rule)
        self.client, self.sync_interval_s = client, sync_interval_s
        self.on_hub = True
        self._pending: list[tuple[str, float]] = []
        self._pending_lock = threading.Lock()   # the continuous schedule scores (record) on its uploader's thread
        self._reported = (0, 0)                  # drawn, skipped: the totals the hub was told
        self._version: str | None = None
        self._hub_settled: set[str] = set()
        self._synced_at = -math.inf

    def record(self, example_id: str, share: float) -> bool:
        changed = super().record(example_id, share)
        if self.on_hub:
            with self._pending_lock:
                self._pending.append((example_id, float(share)))
        return changed

    def is_settled(self, example_id: str) -> bool:
        return example_id in self._hub_settled if self.on_hub else super().is_settled(example_id)

    def settled(self) -> set[str]:
        return set(self._hub_settled) if self.on_hub else super().settled()

    def settled_count(self) -> int:
        return len(self._hub_settled) if self.on_hub else super().settled_count()

    def settles_all(self, ids: set[str]) -> bool:
        if not self.on_hub:
            return super().settles_all(ids)
        return len(self._hub_settled) >= len(ids) and ids <= self._hub_settled

    def sync(self, drawn: int, skipped: int) -> None:
        if not self.on_hub or time.monotonic() - self._synced_at < self.sync_interval_s:
            return
        with self._pending_lock:
            pending, self._pending = self._pending, []
        chunks = [pending[i:i + MAX_SHARES_PER_REPORT] for i in range(0, len(pending), MAX_SHARES_PER_REPORT)]
        for i, shares in enumerate(chunks or [[]]):
            first = i == 0   # the draws travel once
            answer = self.client.curriculum_report(CurriculumReport(
                window=self.window, min_appearances=self.min_appearances, shares=shares, since=self._version,
                drawn=drawn - self._reported[0] if first else 0, skipped=skipped - self._reported[1] if first else 0))
            if answer is None:
                self.on_hub = False
                log.warning("curriculum: the hub has no POST /v1/curriculum (an older hub): this generator keeps "
                            "its own pass-rate table")
                return
            self._reported = (drawn, skipped)
            if answer.settled is not None:
                self._hub_settled = set(answer.settled)
            self._version = answer.version
        self._synced_at = time.monotonic()


class CurriculumStream:
    """A :class:`PromptStream` whose draws the curriculum may pass over; the stream keeps its own seeding and order.

    ``skipped_share`` is the share of drawn prompts passed over."""

    def __init__(self, stream: PromptStream, table: PassRateTable) -> None:
        self.stream, self.table = stream, table
        self.ids = {e.example_id for e in stream.examples}
        self.drawn = 0      # prompts the stream gave
        self.skipped = 0    # of them, passed over
        self._warned_all_skipped = False

    @property
    def examples(self) -> list[Example]:
        return self.stream.examples

    @property
    def epoch(self) -> int:
        return self.stream.epoch

    @property
    def skipped_share(self) -> float:
        return self.skipped / self.drawn if self.drawn else 0.0

    def __iter__(self) -> Iterator[Example]:
        return self

    def _everything_settled(self) -> bool:
        return self.table.settles_all(self.ids)

    def __next__(self) -> Example:
        if self._everything_settled():
            if not self._warned_all_skipped:
                self._warned_all_skipped = True
                log.warning("curriculum: every prompt is solved always or never in its last %d appearances; "
                            "drawing them normally", self.table.window)
            self.drawn += 1
            return next(self.stream)
        while True:
            example = next(self.stream)
            self.drawn += 1
            if self.table.should_draw(example.example_id):
                return example
            self.skipped += 1

    def take(self, n: int) -> list[Example]:
        """``n`` prompts for one engine call: the table is brought up to date first (a hub-held one asks the hub)."""
        self.table.sync(self.drawn, self.skipped)
        return [next(self) for _ in range(n)]

    def observe(self, example: Example, totals: list[float]) -> None:
        """Record a scored group of ``example``: its solved share joins the prompt's window."""
        self.table.record(example.example_id, solved_share(totals, self.table.threshold))


def curriculum_stream(stream: PromptStream, cfg, seed: int, client: HubClient | None = None,
                      sync_interval_s: float = 1.0) -> PromptStream | CurriculumStream:
    """``stream`` behind the curriculum of ``cfg`` (generator.curriculum) when it is enabled: the hub's table
    through ``client`` when ``cfg.shared`` (and a client is given), else the generator's own."""
    if not cfg.enabled:
        return stream
    rule = dict(window=cfg.window, min_appearances=cfg.min_appearances, threshold=cfg.threshold, mode=cfg.mode,
                keep_prob=cfg.keep_prob, seed=seed)
    if cfg.shared and client is not None:
        # a client of its own: the continuous schedule draws on one thread and uploads on another
        return CurriculumStream(stream, HubPassRateTable(client.sibling(), sync_interval_s=sync_interval_s, **rule))
    return CurriculumStream(stream, PassRateTable(**rule))
