"""Length shaping as rewards (issue 40, item 2): DAPO's soft overlong punishment and a length penalty relative to the
group (Kimi k1.5). Both count a completion's tokens, so each is called once per group with the token ids
(:func:`generator.rewards.base.with_token_ids`). Overlong *filtering* (truncated completions leave the loss) is the
learner's ``learner.mask_truncated``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from generator.rewards.base import REWARDS, GroupReward, with_token_ids
from shared.errors import UsageError


def _lengths(completion_ids: Sequence[Sequence[int]] | None, n: int) -> list[int]:
    if completion_ids is None or len(completion_ids) != n:
        raise ValueError("this length reward counts tokens and was given no token ids")
    return [len(ids) for ids in completion_ids]


def soft_overlong_value(length: int, max_tokens: int, buffer: int) -> float:
    """DAPO (Yu et al. 2025, eq. 13), with L_max = ``max_tokens`` and L_cache = ``buffer``::

        R(y) = 0                                    if |y| <= L_max - L_cache
             = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
             = -1                                   if |y| > L_max

    e.g. L_max 20, L_cache 4: lengths 16, 18, 20, 21 give 0, -0.5, -1, -1.
    """
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    if length <= max_tokens:
        return (start - length) / buffer
    return -1.0


@REWARDS.register("soft_overlong")
def soft_overlong(max_tokens: int, buffer: int) -> GroupReward:
    """DAPO's soft overlong punishment: a linear penalty over the last ``buffer`` tokens before ``max_tokens``
    (set it to ``generator.sampling.max_tokens``: a completion cut there gets -1), 0 before."""
    if not (isinstance(max_tokens, int) and isinstance(buffer, int) and 0 < buffer <= max_tokens):
        raise UsageError(f"soft_overlong needs integers 0 < buffer <= max_tokens, got max_tokens={max_tokens!r}, "
                         f"buffer={buffer!r}")

    def score(prompt: str, completions: Sequence[str], example: dict[str, Any],
              completion_ids: Sequence[Sequence[int]] | None = None) -> list[float]:
        return [soft_overlong_value(n, max_tokens, buffer) for n in _lengths(completion_ids, len(completions))]

    return with_token_ids(score)


def group_length_values(lengths: Sequence[int], *, penalty_only: bool = False) -> list[float]:
    """Kimi k1.5's length reward (Kimi Team 2025, section 2.3.3), relative to the group::

        lambda_i = 0.5 - (len_i - min_len) / (max_len - min_len)      (0 for every completion when all are equal)

    ``penalty_only``: min(0, lambda_i) (what Kimi gives incorrect answers: longer ones lose, shorter ones gain
    nothing). e.g. lengths 10, 20, 30 give 0.5, 0, -0.5 (``penalty_only``: 0, 0, -0.5).
    """
    low, high = min(lengths, default=0), max(lengths, default=0)
    if high == low:
        return [0.0] * len(lengths)
    values = [0.5 - (n - low) / (high - low) for n in lengths]
    return [min(0.0, v) for v in values] if penalty_only else values


@REWARDS.register("group_length")
def group_length(apply: str = "all") -> GroupReward:
    """A length penalty relative to the group: ``apply: all`` gives every completion lambda_i, ``penalty_only``
    min(0, lambda_i) (:func:`group_length_values`); its weight in ``generator.rewards`` sets its strength."""
    if apply not in ("all", "penalty_only"):
        raise UsageError(f"group_length: apply must be 'all' or 'penalty_only', got {apply!r}")

    def score(prompt: str, completions: Sequence[str], example: dict[str, Any],
              completion_ids: Sequence[Sequence[int]] | None = None) -> list[float]:
        return group_length_values(_lengths(completion_ids, len(completions)), penalty_only=apply == "penalty_only")

    return with_token_ids(score)
