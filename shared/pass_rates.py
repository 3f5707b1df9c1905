"""The curriculum's pass-rate table: each prompt's last ``window`` solved shares, and which prompts are *settled*.

A group's solved share is the share of its completions judged solved (generator/curriculum.py decides what solved
means). A prompt whose recorded shares (at least ``min_appearances`` of them) are all 1.0 (solved always) or all
0.0 (solved never) is settled: GRPO learns nothing from it, every completion of its group gets the same advantage.
One home for that rule, used by a generator's own table (generator/curriculum.py) and by the table the hub holds
for every generator (ref_server/hub/curriculum.py)."""

from __future__ import annotations

from collections import deque


def check_rule(window: int, min_appearances: int) -> None:
    if window < 1:
        raise ValueError(f"curriculum window must be >= 1, got {window}")
    if not 1 <= min_appearances <= window:
        raise ValueError(f"curriculum min_appearances must be in [1, window={window}], got {min_appearances}")


def check_share(key: str, share: float) -> None:
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"curriculum: solved share of {key!r} must be in [0, 1], got {share}")


class PassRates:
    """Each prompt key's last ``window`` solved shares, and the set of settled keys, kept up to date by
    :meth:`record` (a draw asks it without a scan of the table)."""

    def __init__(self, *, window: int = 4, min_appearances: int = 2) -> None:
        check_rule(window, min_appearances)
        self.window, self.min_appearances = window, min_appearances
        self._shares: dict[str, deque[float]] = {}
        self._settled: set[str] = set()

    def record(self, key: str, share: float) -> bool:
        """One appearance of ``key`` whose group solved ``share`` (0..1) of its completions; whether that changed
        the settled set."""
        check_share(key, share)
        shares = self._shares.setdefault(key, deque(maxlen=self.window))
        shares.append(float(share))
        return self._update(key, shares)

    def _update(self, key: str, shares: deque[float]) -> bool:
        settled = len(shares) >= self.min_appearances and (all(s == 1.0 for s in shares)
                                                            or all(s == 0.0 for s in shares))
        if settled == (key in self._settled):
            return False
        (self._settled.add if settled else self._settled.discard)(key)
        return True

    def set_rule(self, window: int, min_appearances: int) -> None:
        """Another window or minimum: each key keeps its last ``window`` shares, and the settled set is worked out
        again (a scan of the table: a rule changes once per run at most)."""
        check_rule(window, min_appearances)
        self.window, self.min_appearances = window, min_appearances
        self._settled.clear()
        for key, shares in self._shares.items():
            self._shares[key] = shares = deque(shares, maxlen=window)
            self._update(key, shares)

    def shares(self, key: str) -> list[float]:
        return list(self._shares.get(key, ()))

    def items(self) -> list[tuple[str, list[float]]]:
        return [(key, list(shares)) for key, shares in self._shares.items()]

    def __len__(self) -> int:
        return len(self._shares)

    def is_settled(self, key: str) -> bool:
        """Solved always or never in each of its last appearances (at least ``min_appearances`` of them)."""
        return key in self._settled

    def settled(self) -> set[str]:
        return set(self._settled)

    def settled_count(self) -> int:
        return len(self._settled)

    def settles_all(self, keys: set[str]) -> bool:
        """Every one of ``keys`` is settled (a size check first: the usual answer, no, costs no scan)."""
        return len(self._settled) >= len(keys) and keys <= self._settled
