"""The continuous schedule's loop: keep the engine full within the hub's budget, step it, hand finished groups to
the uploader, and take new weights between two decoding steps.

One thread drives the engine (``ContinuousRollouts.run``); the uploader scores and uploads on another; with a
multi-turn environment, its calls run on a pool (generator/continuous/trajectories.py) and their answers become the
next turns' sequences at the loop's next pass. Between two
``engine.step()`` calls no forward pass runs, so that is where weights are swapped: the base engine loads them (the
weight-sync receiver, as in the call-at-a-time loop) and ``engine.weights_changed(version)`` makes the unfinished
sequences continue with them, every new token carrying the new version.

Pacing is the hub's (ref_server/hub/pacing.py): the groups the learner can use within the staleness bound, less
the groups this generator already has in flight or waiting for upload, divided by the share of prompts whose group
is kept. While the engine runs, the budget is asked without waiting, at most every ``check_interval_s``; with the
engine empty, the loop waits on the hub as the call-at-a-time loop does.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from generator.agent.runner import AgentRollouts
from generator.continuous.episodes import EpisodesInFlight
from generator.continuous.groups import GroupsInFlight
from generator.continuous.switches import SwitchBudget
from generator.continuous.trajectories import TrajectoriesInFlight
from generator.continuous.uploader import GroupUploader
from generator.engines.base import ContinuousEngine
from generator.failures import FailureRateExceeded
from generator.refusals import GroupsRefused
from shared.config.schema.generator import ScheduleConfig
from shared.protocol.client import HubUnavailable

log = logging.getLogger("grpo.generator")
DEFAULT_SWITCH_SHARE = ScheduleConfig.model_fields["max_switch_share"].default


@dataclass
class ScheduleStats:
    """What the continuous schedule measures (on the loop's LoopStats as ``schedule``)."""

    steps: int = 0                  # engine steps
    step_s: float = 0.0             # seconds inside engine.step()
    idle_s: float = 0.0             # seconds with nothing in the engine (no budget, a service down, start/end)
    weight_swap_s: float = 0.0      # seconds swapping weights between steps
    switch_s: float = 0.0           # the switches' measured cost: the swaps and the recompute in the steps after each
    slot_steps: int = 0             # sum over steps of the sequences unfinished in the engine (its occupancy)


class ContinuousRollouts:
    def __init__(self, loop, engine: ContinuousEngine, *, max_in_flight: int, upload_interval_s: float = 0.5,
                 check_interval_s: float = 0.2, recompute: bool = True,
                 max_switch_share: float = DEFAULT_SWITCH_SHARE) -> None:
        """``loop``: the RolloutLoop whose prompts, rewards, client, weight receiver, rules and stats this uses;
        ``max_switch_share``: the most of the wall time weight switches may take (generator/continuous/switches.py;
        1: every new version at the next check; the default is the config's)."""
        self.loop, self.engine = loop, engine
        self.max_in_flight = max(max_in_flight, loop.group_size)   # room for one whole group at least
        self.upload_interval_s, self.check_interval_s = upload_interval_s, check_interval_s
        self.recompute = recompute   # at a switch, unfinished prefixes are recomputed by the new weights
        if loop.multiturn is None:
            self.groups = GroupsInFlight(loop.group_size, loop.seed, loop.generator_id)
        elif isinstance(loop.multiturn, AgentRollouts):   # an agent's episodes: each of its calls a sequence
            self.groups = EpisodesInFlight(loop.multiturn, loop.group_size, loop.seed, loop.generator_id,
                                           loop.sampling, loop.stats)
        else:   # a chain of turns per trajectory, the environment's calls between them (off this thread)
            self.groups = TrajectoriesInFlight(loop.multiturn, loop.group_size, loop.seed, loop.generator_id,
                                               loop.stats, max_workers=self.max_in_flight)
        self.stats = loop.stats.schedule = ScheduleStats()
        self.switches = SwitchBudget(max_switch_share)
        self._budget = 0            # prompts the hub's last answer allows, less those submitted since
        self._next_check = 0.0

    # -- weights --------------------------------------------------------------------------------------------
    def sync_weights(self) -> None:
        """A newer version, loaded between steps; the engine's unfinished sequences continue with it."""
        started = time.perf_counter()
        if self.loop.sync_weights():
            self.engine.weights_changed(self.loop.policy_version, self.recompute)
            swap_s = time.perf_counter() - started
            self.stats.weight_swap_s += swap_s
            self.switches.switched(swap_s)

    # -- pacing ---------------------------------------------------------------------------------------------
    def free_groups(self) -> int:
        """Groups that fit: a trajectory waiting for its environment keeps its place (its next turn will need it)."""
        return (self.max_in_flight - self.groups.live) // self.loop.group_size

    def refresh_budget(self, wait_s: float) -> None:
        """Prompts the hub lets this generator start now: the groups it wants, less those open or waiting for
        upload here, as prompts (divided by the kept share); with no pacing, whatever fits in the engine."""
        started = time.perf_counter()
        wanted = self.loop.hub_wanted(wait_s)
        if wanted is None:
            self._budget = self.free_groups()
            return
        self._budget = max(0, self.loop.prompts_for(wanted - len(self.groups.open) - self.uploader.pending))
        if self._budget == 0 and wait_s > 0:
            self.loop.stats.budget_waits += 1
            self.loop.stats.budget_wait_s += time.perf_counter() - started

    def top_up(self, max_groups: int | None) -> None:
        loop = self.loop
        if loop.service_pause.down is not None:  # a reward service is down: generation pauses
            return
        free = self.free_groups()
        if max_groups is not None:
            free = min(free, max_groups - loop.stats.groups_uploaded - len(self.groups.open) - self.uploader.pending)
        if free <= 0:
            return
        if self._budget < free and (not loop.wait_for_budget or time.monotonic() >= self._next_check):
            self._next_check = time.monotonic() + self.check_interval_s
            self.refresh_budget(wait_s=0.0)
        count = min(free, self._budget)
        if count <= 0:
            return
        self._budget -= count
        requests = []
        for example in loop.prompts.take(count):
            prompt_ids = loop.encode_prompt(example)
            requests += self.groups.submit(example, prompt_ids, loop.sampling, loop.policy_version)
        self.engine.submit(requests)

    # -- the loop -------------------------------------------------------------------------------------------
    def run(self, stop: threading.Event, max_groups: int | None = None):
        loop = self.loop
        loop.stop = stop
        self.uploader = GroupUploader(loop, self.upload_interval_s, max_groups)
        try:
            try:
                self._run(stop, max_groups)
            finally:
                self.engine.abort(self.groups.abandon())   # sequences of groups never completed: nothing to upload
                self.uploader.close()
                self.stats.switch_s = self.switches.switch_s   # the budget measures it; the stats report it
            self.uploader.raise_if_failed()   # what failed on the upload thread, raised here
        except HubUnavailable as exc:
            if not stop.is_set():
                raise
            log.warning("stopped while the hub was unreachable (%s)", exc)
        except (GroupsRefused, FailureRateExceeded):
            loop.progress.close(loop.stats, loop.policy_version)
            raise
        loop.progress.close(loop.stats, loop.policy_version)
        return loop.stats

    def _done(self, stop: threading.Event, max_groups: int | None) -> bool:
        return stop.is_set() or (max_groups is not None and self.loop.stats.groups_uploaded >= max_groups)

    def _run(self, stop: threading.Event, max_groups: int | None) -> None:
        self.loop.sync_weights()   # a generator that joins late starts from the current version
        self.engine.weights_changed(self.loop.policy_version, self.recompute)
        next_sync = 0.0
        while not self._done(stop, max_groups):
            self.uploader.raise_if_failed()
            now = time.monotonic()
            if now >= next_sync and self.switches.allowed(now):
                next_sync = now + self.check_interval_s
                self.sync_weights()
            self.top_up(max_groups)
            self._collect()
            if self.engine.num_unfinished() == 0:
                if self.groups.waiting:   # turns waiting for their environment
                    self.groups.wait(self.check_interval_s)
                    continue
                self._idle(stop, max_groups)
                continue
            self._step()

    def _step(self) -> None:
        started = time.perf_counter()
        unfinished = self.engine.num_unfinished()
        finished = self.engine.step()
        step_s = time.perf_counter() - started
        self.stats.step_s += step_s
        self.switches.stepped(step_s, time.monotonic())
        self.stats.steps += 1
        self.stats.slot_steps += unfinished
        for sequence in finished:
            self.loop.stats.completion_tokens += len(sequence.completion.token_ids)
            group = self.groups.finish(sequence)
            if group is not None:
                self.uploader.put(group)

    def _collect(self) -> None:
        """Multi-turn: the turns the environments' answers make, into the engine; the groups they complete, to the
        uploader."""
        requests, complete = self.groups.poll()
        if requests:
            self.engine.submit(requests)
        for group in complete:
            self.uploader.put(group)

    def _idle(self, stop: threading.Event, max_groups: int | None) -> None:
        """Nothing in the engine: the budget is 0, a reward service is down, or the last groups are uploading."""
        started = time.perf_counter()
        if self.loop.service_pause.down is not None or self.uploader.pending or (
                max_groups is not None and self.loop.stats.groups_uploaded + self.uploader.pending >= max_groups):
            stop.wait(min(self.check_interval_s, 0.05))
        else:
            self.refresh_budget(wait_s=self.loop.budget_poll_s)   # waits on the hub while it wants none
            if self._budget == 0:
                self.sync_weights()   # a new learner version ends the wait: its weights raise the budget
        self.stats.idle_s += time.perf_counter() - started
