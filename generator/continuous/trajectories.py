"""Multi-turn trajectories on the continuous schedule: each of a group's G trajectories is a chain of model turns,
each turn one engine sequence, with the environment's calls between them.

A group opens by building and resetting its G environments; when a turn's sequence finishes, the turn is appended to
its trajectory and the environment's ``step`` runs; when it answers with an observation, the next turn is submitted
as a new sequence whose prompt is the trajectory's exact tokens so far (the prompt, the model's turns as sampled,
the observations' tokens: never re-tokenised). The bookkeeping is generator/multiturn.py's, shared with the
call-at-a-time schedule (``open_rows``, ``take_turn``, ``apply_step``, ``close_rows``), so max_total_tokens, the
ends of a trajectory, the environment's containment and what the refusal and failure rules see are the same.

Environment calls run on a thread pool, off the engine loop: the other sequences keep decoding while a tool runs.
Only the calls run there (``call_all``, bounded by ``timeout_s``, one job per call); what they answered is applied on the engine
loop's thread (:meth:`TrajectoriesInFlight.poll`), so trajectories and the environment stats have one writer. A
group is complete, and handed to the uploader, when its G trajectories have ended.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from generator.continuous.groups import OpenGroup
from generator.datasets import Example
from generator.engines.base import FinishedSequence, SampledTurn, SequenceRequest
from generator.failures import Failure
from generator.loop import derived_seed
from generator.multiturn import MultiTurnRollouts, Trajectory, call_all
from shared.protocol.records import SamplingParams


@dataclass
class OpenTrajectories:
    example: Example
    prompt_ids: list[int]             # the prompt; with the group's shared reset text once its environments answered
    sampling: SamplingParams
    opened_version: int               # the policy version when the group was opened
    rows: list[Trajectory] = field(default_factory=list)   # empty until its environments are built and reset
    done: int = 0                     # trajectories ended


@dataclass
class _Asked:
    """A model turn whose environment step() is running: which trajectory, how the turn ended, the call."""

    group: int
    row: int
    ended: str
    call: Callable[[], Any]


class TrajectoriesInFlight:
    """The multi-turn counterpart of :class:`~generator.continuous.groups.GroupsInFlight` for the schedule: ``submit``
    opens a group, ``finish`` takes a finished turn, ``poll`` returns the next turns to submit and the complete
    groups. Request ids are ``"<group>/<trajectory>/<turn>"``."""

    def __init__(self, multiturn: MultiTurnRollouts, group_size: int, seed: int, generator_id: str, stats,
                 max_workers: int) -> None:
        """``stats``: the loop's LoopStats (environment tokens count as completion tokens, as in batch mode)."""
        self.multiturn, self.group_size, self.seed, self.generator_id = multiturn, group_size, seed, generator_id
        self.stats, self.max_workers = stats, max_workers
        self.open: dict[int, OpenTrajectories] = {}
        self._next = 0
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: list[tuple[Future, Callable[[Any], None]]] = []   # environment calls running, their handlers
        self._asked: list[_Asked] = []          # step() calls of turns ended since the last poll, sent by it
        self._running: set[str] = set()         # request ids given to the engine and not finished
        self._requests: list[SequenceRequest] = []   # next turns, for the engine
        self._complete: list[OpenGroup] = []

    @property
    def live(self) -> int:
        """Trajectories not ended: in the engine, waiting for their environment, or for their first turn."""
        return sum(self.group_size - group.done for group in self.open.values())

    @property
    def waiting(self) -> bool:
        """Whether environment calls are running or about to (the engine may be empty meanwhile)."""
        return bool(self._jobs or self._asked)

    def submit(self, example: Example, prompt_ids: list[int], sampling: SamplingParams, version: int
               ) -> list[SequenceRequest]:
        """Open a group: its environments are built and reset off this thread; its first turns come from poll."""
        index = self._next
        self._next += 1
        self.open[index] = OpenTrajectories(example, list(prompt_ids), sampling, version)
        sample = {"question": example.question, **example.data}
        self._run(lambda: self.multiturn.create_and_reset([sample] * self.group_size),
                  lambda opened: self._opened(index, opened))
        return []

    def finish(self, finished: FinishedSequence) -> None:
        """A model turn ended: appended to its trajectory, then the environment is asked (at the next poll) or
        the trajectory is over (a turn cut at a token cap). Complete groups come from poll."""
        if finished.request_id not in self._running:
            raise RuntimeError(f"the engine returned sequence {finished.request_id!r}, which is not in flight")
        self._running.discard(finished.request_id)
        index, row_index, _ = (int(part) for part in finished.request_id.split("/"))
        row = self.open[index].rows[row_index]
        completion = finished.completion
        turn = SampledTurn(completion.token_ids, completion.logprobs, finished.ended)
        if self.multiturn.take_turn(row, turn, completion.versions):
            self._asked.append(_Asked(index, row_index, turn.ended, self.multiturn.step_call(row, turn)))
        else:
            self._ended(index, row)

    def poll(self) -> tuple[list[SequenceRequest], list[OpenGroup]]:
        """Send the step() calls asked since the last poll (a job each: a slow one holds no other trajectory),
        apply the answers that came back; the turns to submit and the groups now complete."""
        asked, self._asked = self._asked, []
        for a in asked:
            self._run(lambda a=a: call_all([a.call], self.multiturn.cfg.timeout_s)[0],
                      lambda answer, a=a: self._answered(a, answer))
        running = []
        for future, handle in self._jobs:
            if future.done():
                handle(future.result())
            else:
                running.append((future, handle))
        self._jobs = running
        (requests, self._requests), (complete, self._complete) = (self._requests, []), (self._complete, [])
        return requests, complete

    def wait(self, timeout_s: float) -> None:
        """Until an environment call finishes (or ``timeout_s``): the engine has nothing to do meanwhile."""
        if self._jobs:
            wait([future for future, _ in self._jobs], timeout=timeout_s, return_when=FIRST_COMPLETED)

    def abandon(self) -> list[str]:
        """Forget every open group (their environment calls are not waited for); the request ids of their turns
        still in the engine (to abort)."""
        ids = sorted(self._running)   # the turns not yet submitted too: aborting an unknown id is a no-op
        self.open.clear()
        self._running.clear()
        self._requests, self._asked, self._jobs, self._complete = [], [], [], []
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        return ids

    # -- on the engine loop's thread ------------------------------------------------------------------------
    def _run(self, calls: Callable[[], Any], handle: Callable[[Any], None]) -> None:
        """``calls`` on the pool (timed into the environment stats), ``handle`` with their result at a poll."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="grpo-env")

        def timed():
            started = time.perf_counter()
            return calls(), time.perf_counter() - started

        def handle_timed(result: tuple[Any, float]) -> None:
            self.multiturn.stats.env_time_s += result[1]
            handle(result[0])

        self._jobs.append((self._pool.submit(timed), handle_timed))

    def _opened(self, index: int, opened) -> None:
        group = self.open.get(index)
        if group is None:   # abandoned meanwhile
            return
        rows, prompts, _ = self.multiturn.open_rows(opened, [group.prompt_ids], self.group_size)
        group.prompt_ids, group.rows = prompts[0], rows
        for row_index in range(len(rows)):
            self._next_turn(index, row_index)

    def _answered(self, asked: _Asked, answer: tuple[Any, Failure | None]) -> None:
        if asked.group in self.open:   # else abandoned meanwhile
            self.multiturn.apply_step(self.open[asked.group].rows[asked.row], asked.ended, answer)
            self._next_turn(asked.group, asked.row)

    def _next_turn(self, index: int, row_index: int) -> None:
        """The trajectory's next model turn, as a sequence whose prompt is everything so far; or its end."""
        group = self.open[index]
        row = group.rows[row_index]
        if row.finish is not None:
            self._ended(index, row)
            return
        request_id = f"{index}/{row_index}/{row.turns}"
        self._running.add(request_id)
        self._requests.append(SequenceRequest(
            request_id, group.prompt_ids + row.tokens, self.multiturn.turn_sampling(group.sampling, [row]),
            derived_seed(self.seed, self.generator_id, index, row_index, row.turns), tuple(self.multiturn.stops)))

    def _ended(self, index: int, row: Trajectory) -> None:
        group = self.open[index]
        group.done += 1
        self.stats.completion_tokens += len(row.mask) - sum(row.mask)   # the model's tokens are counted per turn
        if group.done < self.group_size:
            return
        del self.open[index]
        self._complete.append(OpenGroup(group.example, group.prompt_ids, self.multiturn.close_rows(group.rows),
                                        group.opened_version, done=self.group_size))
