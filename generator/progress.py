"""Console progress of a generator: a tqdm bar on a terminal, a log line every few seconds otherwise."""

from __future__ import annotations

import logging
import sys
import time

from generator.stats import LoopStats
from shared.progress import startup_phase

log = logging.getLogger("grpo.generator")


def environment_summary(env) -> dict[str, float | int]:
    """Multi-turn (a generator.multiturn.EnvStats, None for single-turn): turns per trajectory, tool calls answered,
    share of trajectories with one or more, trajectories failed by their environment, seconds in the environment,
    share of completion tokens it wrote; with chat tools (generator/environments/tools.py) the calls the model wrote
    and how many were answered with an error."""
    if env is None:
        return {}
    summary = {"turns/traj": round(env.turns / max(env.trajectories, 1), 2), "env_calls": env.env_calls,
               "tool_rate": round(env.tool_call_rate, 3), "env_errors": env.env_errors,
               "env_s": round(env.env_time_s, 1), "env_token_frac": round(env.masked_fraction, 3)}
    if env.tool_calls:
        summary |= {"tool_calls": env.tool_calls, "tool_errors": env.tool_errors}
    if hasattr(env, "template_mismatches"):   # an agent's episodes (generator/agent/episodes.py: AgentStats)
        summary |= {name: getattr(env, name) for name in ("template_mismatches", "diverged", "expired",
                                                          "agent_errors", "episodes_dropped",
                                                          "episodes_dropped_at_restart")}
    return summary


def logged_summary(logged) -> dict[str, float]:
    """The means of what TRL-style rewards logged with ``log_metric`` (a LoggedMetrics, or None)."""
    return {} if logged is None else {name: round(mean, 4) for name, mean in sorted(logged.means().items())}


class Progress:
    def __init__(self, *, enabled: bool = True, log_every_s: float = 10.0, total: int | None = None) -> None:
        self.enabled = enabled
        self.log_every_s = log_every_s
        self.started = time.monotonic()
        self._last_log = self.started
        self._bar = None
        self._said_first = False
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="group", desc="rollouts", dynamic_ncols=True)

    def summary(self, stats: LoopStats, version: int) -> dict[str, float | int | None]:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        return {
            "prompts/s": round(stats.prompts / elapsed, 2),
            "tokens/s": round(stats.completion_tokens / elapsed, 1),
            "reward": round(stats.mean_reward, 3),
            **({} if stats.mean_step_reward is None else {"step_reward": round(stats.mean_step_reward, 3)}),
            "version": version,
            "queue": stats.last_queue_depth,
            **environment_summary(stats.environment),
            **logged_summary(stats.logged_metrics),
        }

    def update(self, stats: LoopStats, version: int) -> None:
        if not self.enabled:
            return
        if stats.groups_uploaded and not self._said_first:   # the learner's first batch waits for these
            self._said_first = True
            startup_phase(log, f"uploaded its first {stats.groups_uploaded} groups")
        fields = self.summary(stats, version)
        if self._bar is not None:
            self._bar.n = stats.groups_uploaded
            self._bar.set_postfix(fields, refresh=True)
        elif time.monotonic() - self._last_log >= self.log_every_s:
            self._last_log = time.monotonic()
            log.info("groups %d | %s", stats.groups_uploaded, " | ".join(f"{k} {v}" for k, v in fields.items()))

    def close(self, stats: LoopStats, version: int) -> None:
        if self._bar is not None:
            self._bar.close()
        if self.enabled:
            # over the completions each reward applied to (a TRL-style reward's None left out; one that gave steps
            # alone, a PRM, is not uploaded as a component: its mean is the step rewards' line below)
            means = {k: round(v / max(stats.component_counts.get(k, 0), 1), 3) for k, v in stats.component_sums.items()}
            log.info("done: %d groups uploaded, %d dropped (constant reward), %d refused as stale, %d refused as "
                     "invalid, %d dropped as unacceptable, %d reward errors, %d engine calls put off for %.1fs (the learner could not use more "
                     "groups yet), per-reward means %s, %s", stats.groups_uploaded, stats.groups_dropped_constant,
                     stats.groups_refused_stale, stats.groups_refused_invalid, stats.groups_unacceptable,
                     stats.reward_errors,
                     stats.budget_waits, stats.budget_wait_s, means,
                     self.summary(stats, version))
            pause = stats.service_pause
            if pause is not None and pause.pauses:
                log.info("reward services: generation paused %d time(s) while one was down, %.0fs in all",
                         pause.pauses, pause.paused_s)
            schedule = stats.schedule
            if schedule is not None and schedule.steps:
                log.info("continuous schedule: %d engine steps, %.1f sequences in the engine per step, %.1fs "
                         "stepping, %.1fs with the engine empty, %.1fs swapping weights (%.1fs switching with the "
                         "recompute after each)", schedule.steps, schedule.slot_steps / schedule.steps,
                         schedule.step_s, schedule.idle_s, schedule.weight_swap_s, schedule.switch_s)
            if stats.prompts_skipped:
                drawn = stats.prompts_skipped + stats.prompts
                log.info("curriculum: %d of %d drawn prompts passed over (%.1f%%): solved always or never lately",
                         stats.prompts_skipped, drawn, 100 * stats.prompts_skipped / drawn)
            if stats.weight_versions_vanished:
                log.info("weight sync: %d versions the hub named were gone from the relay when asked for (the "
                         "current one was loaded instead)", stats.weight_versions_vanished)
            if stats.groups_with_steps or stats.step_reward_errors:
                log.info("step rewards: %d groups carried %d steps (%.2f per group), mean step reward %s; %d "
                         "completions lost their steps to a failed or mismatched step reward", stats.groups_with_steps,
                         stats.steps_uploaded, stats.steps_uploaded / max(stats.groups_with_steps, 1),
                         "-" if stats.mean_step_reward is None else f"{stats.mean_step_reward:.3f}",
                         stats.step_reward_errors)
