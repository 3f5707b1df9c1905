"""A difficulty curriculum: each prompt's pass rate over its last appearances, and whether to draw it again.

A group's outcome is its *solved share*: the share of its completions whose total reward is at least ``threshold``.
:class:`PassRateTable` keeps each ``example_id``'s last ``window`` shares. A prompt whose recorded shares (at least
``min_appearances`` of them) are all 1.0 (solved always) or all 0.0 (solved never) gives GRPO no signal: every
completion of its group gets the same advantage. Such a prompt is skipped (``mode: skip``) or drawn with probability
``keep_prob`` (``mode: downweight``). :class:`CurriculumStream` applies the rule to a :class:`PromptStream`'s draws
and never skips everything: when every prompt would be skipped it draws normally and says so once."""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from generator.datasets.base import Example, PromptStream

log = logging.getLogger(__name__)

Mode = Literal["skip", "downweight"]
MODES = ("skip", "downweight")


def solved_share(totals: Iterable[float], threshold: float) -> float:
    """The share of a group's completions whose total reward is at least ``threshold``."""
    totals = list(totals)
    if not totals:
        raise ValueError("solved_share: a group without completions")
    return sum(1 for t in totals if t >= threshold) / len(totals)


class PassRateTable:
    """Each prompt's last ``window`` solved shares, and the curriculum's verdict on drawing it again."""

    def __init__(self, *, window: int = 4, min_appearances: int = 2, threshold: float = 1.0, mode: Mode = "skip",
                 keep_prob: float = 0.1, seed: int | str = 0) -> None:
        if window < 1:
            raise ValueError(f"curriculum window must be >= 1, got {window}")
        if not 1 <= min_appearances <= window:
            raise ValueError(f"curriculum min_appearances must be in [1, window={window}], got {min_appearances}")
        if mode not in MODES:
            raise ValueError(f"curriculum mode must be one of {list(MODES)}, got {mode!r}")
        if not 0.0 <= keep_prob <= 1.0:
            raise ValueError(f"curriculum keep_prob must be in [0, 1], got {keep_prob}")
        self.window, self.min_appearances, self.threshold = window, min_appearances, threshold
        self.mode, self.keep_prob = mode, keep_prob
        self._shares: dict[str, deque[float]] = {}
        self._settled: set[str] = set()   # kept up to date by record(): draws ask it without a scan of the table
        self._rng = random.Random(f"curriculum/{seed}")

    def record(self, example_id: str, share: float) -> None:
        """One appearance of ``example_id`` whose group solved ``share`` (0..1) of its completions."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"curriculum: solved share of {example_id!r} must be in [0, 1], got {share}")
        shares = self._shares.setdefault(example_id, deque(maxlen=self.window))
        shares.append(float(share))
        settled = len(shares) >= self.min_appearances and (all(s == 1.0 for s in shares)
                                                            or all(s == 0.0 for s in shares))
        (self._settled.add if settled else self._settled.discard)(example_id)

    def shares(self, example_id: str) -> list[float]:
        return list(self._shares.get(example_id, ()))

    def is_settled(self, example_id: str) -> bool:
        """Solved always or never in each of its last appearances (at least ``min_appearances`` of them)."""
        return example_id in self._settled

    def skip_set(self) -> set[str]:
        return set(self._settled)

    def settles_all(self, ids: set[str]) -> bool:
        """Every one of ``ids`` is settled (a size check first: the usual answer, no, costs no scan)."""
        return len(self._settled) >= len(ids) and ids <= self._settled

    def should_draw(self, example_id: str) -> bool:
        """Whether to use a drawn ``example_id``: always for an unsettled prompt; for a settled one never (skip) or
        with probability ``keep_prob`` (downweight)."""
        if not self.is_settled(example_id):
            return True
        return self.mode == "downweight" and self._rng.random() < self.keep_prob


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
        return [next(self) for _ in range(n)]

    def observe(self, example: Example, totals: list[float]) -> None:
        """Record a scored group of ``example``: its solved share joins the prompt's window."""
        self.table.record(example.example_id, solved_share(totals, self.table.threshold))


def curriculum_stream(stream: PromptStream, cfg, seed: int) -> PromptStream | CurriculumStream:
    """``stream`` behind the curriculum of ``cfg`` (generator.curriculum) when it is enabled."""
    if not cfg.enabled:
        return stream
    return CurriculumStream(stream, PassRateTable(window=cfg.window, min_appearances=cfg.min_appearances,
                                                  threshold=cfg.threshold, mode=cfg.mode, keep_prob=cfg.keep_prob,
                                                  seed=seed))
