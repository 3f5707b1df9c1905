"""What a reward is: the registry, the group-reward signature and the per-completion lift.

A reward is built by a registered factory from its config arguments and scores a group at a time (so a reward
model over HTTP can score it in one request): ``fn(prompt, completions, example) -> list[float | StepScores]``,
one value per completion: a float is an outcome score; a :class:`~generator.rewards.steps.StepScores` scores the
completion step by step (process supervision, issue 23) and may carry an outcome score too.

New rewards are one decorated factory in a module listed in ``REWARDS``' ``modules`` (imported on its first read)::

    from generator.rewards.base import REWARDS, per_completion
    from generator.rewards.steps import StepScores

    @REWARDS.register("my_reward")
    def my_reward(bonus: float = 1.0):
        def score(prompt, completion, example) -> float | StepScores: ...
        return per_completion(score)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from generator.failures import Failure, ServiceDown
from generator.rewards.steps import StepScores
from shared.errors import UsageError
from shared.registry import Registry

log = logging.getLogger("grpo.generator.rewards")

Score = float | StepScores
GroupReward = Callable[[str, Sequence[str], dict[str, Any]], list[Score]]
# The modules whose import registers the built-in rewards: imported on the registry's first read.
REWARDS: Registry = Registry("reward", modules=(
    "generator.rewards.builtin",    # format, math, arithmetic, final_number, code, http, python
    "generator.rewards.chain",      # chain, chain_steps: the multi-step task (outcome and one reward per line)
    "generator.rewards.prm",        # a process reward model behind vLLM's /pooling API
    "generator.rewards.length",     # soft_overlong (DAPO), group_length (Kimi k1.5): length shaping
    "generator.rewards.reasoning_gym_reward",   # reasoning_gym: a reasoning-gym task's own score_answer
))


def with_token_ids(fn: Callable) -> Callable:
    """Mark a group reward that is called ``fn(prompt, completions, example, completion_ids)`` (the completions'
    token ids, for rewards that count tokens) and may answer None for a completion it does not apply to (TRL's
    convention: no value, no failure). TRL-style python rewards and the length rewards are."""
    fn.takes_token_ids = True
    return fn


def takes_token_ids(fn: Callable) -> bool:
    return getattr(fn, "takes_token_ids", False)


class RewardConfigError(UsageError, ValueError):
    """A reward that cannot be built from its config (unknown function, bad arguments, duplicate name)."""


def as_score(value: Any) -> Score:
    """A reward's value for one completion: a StepScores as it is, anything else as a float (``TypeError`` /
    ``ValueError`` when it is neither)."""
    return value if isinstance(value, StepScores) else float(value)


def per_completion(fn: Callable[[str, str, dict[str, Any]], Score]) -> GroupReward:
    """Lift ``fn(prompt, completion, example) -> float | StepScores`` to a group reward; an exception on one
    completion becomes NaN there (scored with the reward's ``on_error``), the others keep their values. The group
    reward's ``failures`` attribute holds, for its last call, each completion's :class:`~generator.failures.Failure`
    (None where it scored), for the rule on failing rewards (generator/failures.py). A :class:`ServiceDown` is not
    contained: the group waits for the service (generator/loop.py)."""

    def group(prompt: str, completions: Sequence[str], example: dict[str, Any]) -> list[Score]:
        group.failures = [None] * len(completions)
        values: list[Score] = []
        for i, completion in enumerate(completions):
            try:
                values.append(as_score(fn(prompt, completion, example)))
            except ServiceDown:
                raise
            except Exception as exc:  # noqa: BLE001 - contained per completion; NaN marks it for on_error
                log.warning("reward %s failed on one completion (%s: %s)", group.__name__, type(exc).__name__, exc)
                group.failures[i] = Failure.of(exc)
                values.append(math.nan)
        return values

    group.__name__ = getattr(fn, "__name__", "reward")
    group.failures = []
    return group
