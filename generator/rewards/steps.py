"""What a reward returns when it scores a completion step by step (process supervision, issue 23).

A reward function returns, for each completion of a group, either a float (an outcome score) or a
:class:`StepScores`: one reward per reasoning step, each step located in the completion's text. The generator
maps each step's end to the completion token that holds its last character (the tokenizer's offsets, the same
for every engine) and uploads ``(step end token, reward)`` pairs with the group (shared/protocol/steps.py).

Steps are located one of two ways, exactly one per StepScores:

* ``ends``: the character offset (exclusive, into the completion text) where each step ends, strictly
  increasing, each in ``1..len(text)``;
* ``separator``: the steps are the pieces of the text between occurrences of this string (a PRM's ``"\\n\\n"``,
  a task's ``"\\n"``); step j ends at the last character of the j-th piece, and ``rewards`` has one value per
  non-empty piece.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StepScores:
    """One completion's step rewards (and optionally its outcome score), located by ``ends`` or ``separator``."""

    rewards: tuple[float, ...]
    ends: tuple[int, ...] | None = None   # exclusive character offset where each step ends
    separator: str | None = None          # or: steps are the text's non-empty pieces between separators
    outcome: float | None = None          # the whole completion's score, if the reward also gives one

    def __post_init__(self) -> None:
        object.__setattr__(self, "rewards", tuple(float(r) for r in self.rewards))
        if (self.ends is None) == (self.separator is None):
            raise ValueError("StepScores needs exactly one of ends (character offsets) or separator")
        if self.separator == "":
            raise ValueError("StepScores.separator must not be empty")
        if self.ends is not None:
            ends = tuple(int(e) for e in self.ends)
            object.__setattr__(self, "ends", ends)
            if len(ends) != len(self.rewards):
                raise ValueError(f"StepScores has {len(self.rewards)} rewards but {len(ends)} ends")
            if any(b <= a for a, b in zip(ends, ends[1:])) or (ends and ends[0] < 1):
                raise ValueError(f"StepScores.ends must be strictly increasing offsets >= 1, got {list(ends)}")
        if not all(math.isfinite(r) for r in self.rewards):
            raise ValueError(f"StepScores.rewards must be finite, got {list(self.rewards)}")
        if self.outcome is not None and not math.isfinite(float(self.outcome)):
            raise ValueError(f"StepScores.outcome must be finite, got {self.outcome}")

    def char_ends(self, text: str) -> list[int]:
        """The exclusive end offset of each step in ``text`` (checked against it)."""
        if self.ends is not None:
            if self.ends and self.ends[-1] > len(text):
                raise ValueError(f"a step ends at character {self.ends[-1]} of a {len(text)}-character completion")
            return list(self.ends)
        ends, start = [], 0
        while start <= len(text):
            found = text.find(self.separator, start)
            stop = len(text) if found < 0 else found
            if stop > start:
                ends.append(stop)
            if found < 0:
                break
            start = found + len(self.separator)
        if len(ends) != len(self.rewards):
            raise ValueError(f"the separator {self.separator!r} splits the completion into {len(ends)} steps but "
                             f"the reward gave {len(self.rewards)} step rewards")
        return ends
