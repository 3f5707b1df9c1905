"""Reward functions, chosen and weighted from config, that never crash the generator.

The package, by concept:

* :mod:`generator.rewards.base`: the ``REWARDS`` registry, the group-reward signature, ``per_completion``;
* :mod:`generator.rewards.steps`: :class:`StepScores`, what a reward returns to score a completion step by step;
* :mod:`generator.rewards.reward_set`: :class:`RewardSet`, the configured rewards combined (weighted outcome total,
  per-reward components, step rewards), errors contained and counted;
* the modules in ``REWARD_MODULES``, each registering rewards with ``@REWARDS.register("name")``.

Registering a new module of rewards is one line in ``REWARD_MODULES``.
"""

from __future__ import annotations

import importlib

from generator.rewards.base import (
    REWARDS,
    GroupReward,
    RewardConfigError,
    RewardFailedError,
    Score,
    as_score,
    per_completion,
)
from generator.rewards.builtin import digit_agreement, gold_answer
from generator.rewards.reward_set import GroupScores, RewardSet, RewardTerm, merge_term_steps
from generator.rewards.steps import StepScores

# Modules whose import registers rewards (generator.rewards.<name>); imported when the package is.
REWARD_MODULES: tuple[str, ...] = (
    "builtin",    # format, math, arithmetic, final_number, code, http, python
    "chain",      # chain, chain_steps: the multi-step task (outcome and one reward per line)
    "prm",        # a process reward model behind vLLM's /pooling API
)


def _register_builtin() -> None:
    for name in REWARD_MODULES:
        importlib.import_module(f"{__name__}.{name}")


_register_builtin()

__all__ = ["REWARDS", "REWARD_MODULES", "GroupReward", "GroupScores", "RewardConfigError", "RewardFailedError", "RewardSet", "RewardTerm",
           "Score", "StepScores", "as_score", "digit_agreement", "gold_answer", "merge_term_steps", "per_completion"]
