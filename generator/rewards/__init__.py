"""Reward functions, chosen and weighted from config, that never crash the generator.

The package, by concept:

* :mod:`generator.rewards.base`: the ``REWARDS`` registry, the group-reward signature, ``per_completion``;
* :mod:`generator.rewards.steps`: :class:`StepScores`, what a reward returns to score a completion step by step;
* :mod:`generator.rewards.reward_set`: :class:`RewardSet`, the configured rewards combined (weighted outcome total,
  per-reward components, step rewards), errors contained and counted;
* the modules named in ``REWARDS``' ``modules``, each registering rewards with ``@REWARDS.register("name")``
  (imported on the registry's first read, :mod:`shared.registry`).

Registering a new module of rewards is one line in ``REWARDS``' ``modules`` (generator/rewards/base.py).
"""

from __future__ import annotations

from generator.rewards.base import (
    REWARDS,
    GroupReward,
    RewardConfigError,
    Score,
    ServiceDown,
    as_score,
    per_completion,
)
from generator.rewards.builtin import digit_agreement, gold_answer
from generator.rewards.reward_set import GroupScores, RewardSet, RewardTerm, merge_term_steps
from generator.rewards.steps import StepScores

__all__ = ["REWARDS", "GroupReward", "GroupScores", "RewardConfigError", "RewardSet", "RewardTerm", "Score",
           "ServiceDown", "StepScores", "as_score", "digit_agreement", "gold_answer", "merge_term_steps", "per_completion"]
