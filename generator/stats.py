"""What a generator's rollout loop counts (:class:`generator.loop.RolloutLoop` keeps it, :mod:`generator.progress`
reports it, ``grpo generator`` returns it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoopStats:
    groups_uploaded: int = 0
    groups_dropped_constant: int = 0
    groups_refused_stale: int = 0
    groups_refused_invalid: int = 0  # refused by the hub alone in a batch upload (a value it cannot batch)
    groups_unacceptable: int = 0    # dropped before upload: the hub could never accept them (generator/refusals.py)
    prompts: int = 0
    prompts_skipped: int = 0        # drawn and passed over by the curriculum (generator/curriculum.py)
    completion_tokens: int = 0
    reward_errors: int = 0
    step_reward_errors: int = 0     # completions whose steps were dropped (a failed step reward, a mismatch)
    steps_uploaded: int = 0         # step rewards in accepted groups
    groups_with_steps: int = 0      # accepted groups that carried steps (process supervision)
    step_reward_sum: float = 0.0    # of the step rewards in accepted groups (each the weighted sum of the terms')
    # rewards that gave steps and never an outcome (a PRM): not uploaded as components (their 0.0 is no score)
    step_only_rewards: list[str] = field(default_factory=list)
    weight_updates: int = 0
    weight_versions_vanished: int = 0  # versions the hub named that were gone from the relay when asked for
    budget_waits: int = 0           # engine calls put off because the learner could not use more groups yet
    budget_wait_s: float = 0.0
    reward_sum: float = 0.0
    reward_count: int = 0
    component_sums: dict[str, float] = field(default_factory=dict)
    component_counts: dict[str, int] = field(default_factory=dict)   # completions each reward applied to
    last_queue_depth: int | None = None
    environment: Any = None         # multi-turn: the rollouts' generator.multiturn.EnvStats (None: single-turn)
    service_pause: Any = None       # the loop's generator.failures.ServicePause (pauses for a reward service down)
    schedule: Any = None            # continuous schedule: its generator.continuous.schedule.ScheduleStats
    logged_metrics: Any = None      # TRL-style rewards' log_metric (generator.rewards.trl_style.LoggedMetrics)

    @property
    def mean_reward(self) -> float:
        return self.reward_sum / self.reward_count if self.reward_count else 0.0

    @property
    def mean_step_reward(self) -> float | None:
        """The mean step reward uploaded (None: no step was)."""
        return self.step_reward_sum / self.steps_uploaded if self.steps_uploaded else None
