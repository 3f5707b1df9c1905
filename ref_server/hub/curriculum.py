"""The curriculum's pass-rate table held by the hub for every generator (``POST /v1/curriculum``).

Generators with ``generator.curriculum.enabled`` report the solved share of each group they scored and read back
the settled prompts (shared/pass_rates.py has the rule), so several generators skip the same prompts and a prompt's
appearances count whichever generator drew it. The rule (window, min_appearances) is the generators': the first
report after the hub starts sets it (a table reloaded under another rule is worked out again); a report under
another rule while that one holds is refused (:class:`RuleMismatch`, a 409), as generators of one run share one
config.

Persistence: the table lives in the hub's spool folder (``curriculum.json``), the run state `grpo run --resume`
keeps and `--fresh` deletes. It is written whole and renamed, at most every ``save_interval_s`` while reports come
and at a clean shutdown (:meth:`SharedCurriculum.close`), so a killed hub loses at most that interval's reports.
A file that cannot be read is moved aside (``curriculum.json.corrupt``) with a log line; the table starts empty.

The generators' draws (``drawn``, ``skipped``) are summed here for the hub's /metrics: the share of skipped
prompts beside the learner's version."""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from pathlib import Path

from shared.pass_rates import PassRates, check_rule, check_share
from shared.protocol.curriculum_messages import CurriculumAnswer, CurriculumReport

log = logging.getLogger("grpo.ref_server.curriculum")
FILE_NAME = "curriculum.json"
FORMAT = 1


class RuleMismatch(ValueError):
    """A report under another window or min_appearances than the table's."""


class SharedCurriculum:
    def __init__(self, directory: str | Path | None = None, *, save_interval_s: float = 1.0) -> None:
        self.path = None if directory is None else Path(directory) / FILE_NAME
        self.save_interval_s = save_interval_s
        self.lock = threading.Lock()
        self.rates = PassRates()
        self._rule_held = False           # a report since this process started set the rule
        self._instance = secrets.token_hex(4)
        self._changes = 0                 # the settled set's changes in this process
        self.drawn = self.skipped = self.recorded = 0
        self._dirty, self._saved_at = False, time.monotonic()
        self._save_lock = threading.Lock()   # one writer at a time; the table's lock is not held while writing
        if self.path is not None and self.path.is_file():
            self._load()

    @property
    def version(self) -> str:
        return f"{self._instance}-{self._changes}"

    def report(self, report: CurriculumReport) -> CurriculumAnswer:
        """Record a generator's shares and draws; the settled keys when they differ from ``report.since``."""
        with self.lock:
            self._adopt_rule(report.window, report.min_appearances)
            for key, share in report.shares:
                self._changes += self.rates.record(key, share)
            self.drawn += report.drawn
            self.skipped += report.skipped
            self.recorded += len(report.shares)
            self._dirty = self._dirty or bool(report.shares)
            version = self.version
            settled = None if report.since == version else sorted(self.rates.settled())
            answer = CurriculumAnswer(version=version, settled=settled, tracked=len(self.rates))
        if self._dirty and time.monotonic() - self._saved_at >= self.save_interval_s:
            self.save()
        return answer

    def _adopt_rule(self, window: int, min_appearances: int) -> None:
        rates = self.rates
        if (window, min_appearances) == (rates.window, rates.min_appearances):
            self._rule_held = True
            return
        if self._rule_held:
            raise RuleMismatch(f"this hub's curriculum counts window={rates.window}, min_appearances="
                               f"{rates.min_appearances} (another generator's generator.curriculum); this report "
                               f"has window={window}, min_appearances={min_appearances}: generators sharing a hub "
                               "need the same generator.curriculum")
        if len(rates):
            log.info("curriculum: the table's rule becomes window=%d, min_appearances=%d (was %d, %d)", window,
                     min_appearances, rates.window, rates.min_appearances)
        rates.set_rule(window, min_appearances)
        self._changes += 1
        self._rule_held = True

    # -- metrics ------------------------------------------------------------------------------------------
    def skipped_share(self) -> float:
        return self.skipped / self.drawn if self.drawn else 0.0

    def settled_count(self) -> int:
        return self.rates.settled_count()

    def tracked(self) -> int:
        return len(self.rates)

    def stats(self) -> dict:
        with self.lock:
            return {"tracked": len(self.rates), "settled": self.settled_count(), "drawn": self.drawn,
                    "skipped": self.skipped, "skipped_share": self.skipped_share(), "recorded": self.recorded,
                    "window": self.rates.window, "min_appearances": self.rates.min_appearances,
                    "version": self.version}

    # -- persistence --------------------------------------------------------------------------------------
    def save(self) -> None:
        """Write the table whole (a temporary name, then renamed) when it changed since the last write."""
        if self.path is None:
            return
        with self._save_lock:
            with self.lock:
                if not self._dirty:
                    return
                body = {"format": FORMAT, "window": self.rates.window,
                        "min_appearances": self.rates.min_appearances, "drawn": self.drawn,
                        "skipped": self.skipped, "recorded": self.recorded, "shares": dict(self.rates.items())}
                self._dirty, self._saved_at = False, time.monotonic()
            partial = self.path.with_name(self.path.name + ".partial")
            try:
                partial.parent.mkdir(parents=True, exist_ok=True)
                partial.write_text(json.dumps(body))
                os.replace(partial, self.path)
            except OSError as exc:   # the reports are kept in memory: the next write tries again
                self._dirty = True
                log.error("curriculum: cannot write %s (%s); the table stays in memory until a write succeeds",
                          self.path, exc)

    def close(self) -> None:
        """A clean shutdown: the reports since the last write are written."""
        self.save()

    def _load(self) -> None:
        try:
            body = json.loads(self.path.read_text())
            if not isinstance(body, dict) or body.get("format") != FORMAT:
                raise ValueError(f"not a curriculum table of format {FORMAT}")
            rates = table_from(body)
            drawn, skipped, recorded = (_count(body, key) for key in ("drawn", "skipped", "recorded"))
        except (OSError, ValueError, TypeError) as exc:   # JSONDecodeError is a ValueError
            aside = self.path.with_name(self.path.name + ".corrupt")
            os.replace(self.path, aside)
            log.error("curriculum table %s is unreadable (%s); moved to %s, starting an empty table", self.path,
                      exc, aside)
            return
        self.rates, self.drawn, self.skipped, self.recorded = rates, drawn, skipped, recorded
        log.info("curriculum: %d prompts reloaded from %s (%d settled)", len(rates), self.path,
                 rates.settled_count())


def table_from(body: dict) -> PassRates:
    """The :class:`PassRates` a saved table holds (ValueError naming what is wrong)."""
    window, min_appearances = body.get("window"), body.get("min_appearances")
    if not isinstance(window, int) or not isinstance(min_appearances, int):
        raise ValueError("window and min_appearances must be integers")
    check_rule(window, min_appearances)
    shares = body.get("shares")
    if not isinstance(shares, dict):
        raise ValueError("shares must be an object of prompt key -> list of shares")
    rates = PassRates(window=window, min_appearances=min_appearances)
    for key, history in shares.items():
        if not isinstance(history, list) or not all(isinstance(s, (int, float)) for s in history):
            raise ValueError(f"shares of {key!r} must be a list of numbers")
        for share in history:
            check_share(key, float(share))
            rates.record(key, float(share))
    return rates


def _count(body: dict, key: str) -> int:
    value = body.get(key, 0)
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be a non-negative integer")
    return value
