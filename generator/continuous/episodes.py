"""An agent's episodes on the continuous schedule (``generator.agent`` with ``generator.schedule.mode:
continuous``): each call of an episode is one engine sequence, each group goes to the uploader the moment its G
episodes have ended, and new groups open as soon as they fit.

The endpoint's calls arrive on its threads (generator/agent/calls.py) and wait there: :class:`QueuedTurns` takes
the place of the batch schedule's TurnSampler, turning each call into a :class:`SequenceRequest` that the engine
loop submits at its next pass (:meth:`EpisodesInFlight.poll`) and answering the call when its sequence finishes
(:meth:`EpisodesInFlight.finish`). So a call never waits for other episodes' calls, a slow agent (thinking, a tool)
holds only its episode, and every sampled token carries the policy version that sampled it, across weight switches
inside a call (the continuous engine's ``versions``); a token the model did not sample (a tool result, the rest of a
first prompt) takes the version of the model token before it (the first model token's, before any).

The episodes' bookkeeping is the batch schedule's (generator/agent/runner.py, episodes.py): the same endpoint,
limits, failures, expiry, stop and journal, so the two schedules record and train on episodes the same way.
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future
from dataclasses import dataclass, replace

from generator.agent.calls import CallError
from generator.agent.episodes import Episode, finished
from generator.agent.runner import AgentRollouts
from generator.continuous.groups import OpenGroup
from generator.datasets import Example
from generator.engines.base import FinishedSequence, SampledTurn, SequenceRequest
from generator.loop import derived_seed
from shared.protocol.records import SamplingParams

CALL = "call"   # request ids "call/<n>": one per model call of any episode


def stopping() -> CallError:
    """A call the schedule will not answer: it is stopping (the call's episode is dropped with its group)."""
    return CallError(503, "the generator is stopping: this call is not answered and its episode is dropped",
                     code="generator_stopping")


class QueuedTurns:
    """The endpoint's sampler on the continuous schedule: ``sample`` (an endpoint thread) queues a sequence and
    waits for it; the engine loop takes the queue (``take``) and answers each call when it finishes (``answer``)."""

    def __init__(self, sampling: SamplingParams, seed: int, generator_id: str) -> None:
        self.sampling, self.seed, self.generator_id = sampling, seed, generator_id
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._queued: list[SequenceRequest] = []
        self._calls: dict[str, Future] = {}   # request id -> the waiting call's answer
        self.closed = False

    def sample(self, context: list[int], max_tokens: int, stops: list[str]) -> SampledTurn:
        """One turn after ``context``, with the schedule's sampling (blocks until its sequence finishes)."""
        answer: Future = Future()
        with self._lock:
            if self.closed:
                raise stopping()
            n = next(self._ids)
            request_id = f"{CALL}/{n}"
            self._queued.append(SequenceRequest(request_id, list(context), replace(self.sampling, max_tokens=max_tokens),
                                                derived_seed(self.seed, self.generator_id, CALL, n), tuple(stops)))
            self._calls[request_id] = answer
            self._lock.notify_all()
        return answer.result()

    def take(self) -> list[SequenceRequest]:
        with self._lock:
            queued, self._queued = self._queued, []
            return queued

    def answer(self, sequence: FinishedSequence) -> None:
        with self._lock:
            answer = self._calls.pop(sequence.request_id, None)
        if answer is None:
            raise RuntimeError(f"the engine returned sequence {sequence.request_id!r}, which is not in flight")
        completion = sequence.completion
        answer.set_result(SampledTurn(completion.token_ids, completion.logprobs, sequence.ended, completion.versions))

    def wait_for_call(self, timeout_s: float) -> None:
        with self._lock:
            if not self._queued:
                self._lock.wait(timeout_s)

    def close(self) -> list[str]:
        """No more calls: the waiting ones fail (their episodes are dropped); the ids still in the engine."""
        with self._lock:
            self.closed = True
            calls, self._calls, self._queued = self._calls, {}, []
            self._lock.notify_all()
        for answer in calls.values():
            answer.set_exception(stopping())
        return sorted(calls)


@dataclass
class OpenEpisodes:
    example: Example
    episodes: list[Episode]
    opened_version: int


class EpisodesInFlight:
    """The agent counterpart of :class:`~generator.continuous.groups.GroupsInFlight` for the schedule: ``submit``
    opens a group's G episodes (their agents start on threads of their own), ``finish`` answers a call, ``poll``
    returns the calls to submit and the groups whose episodes have all ended."""

    def __init__(self, agent: AgentRollouts, group_size: int, seed: int, generator_id: str, sampling: SamplingParams,
                 stats) -> None:
        """``stats``: the loop's LoopStats (the episodes' other tokens count as completion tokens, as in batch)."""
        self.agent, self.group_size, self.stats = agent, group_size, stats
        self.turns = QueuedTurns(sampling, seed, generator_id)
        agent.use_sampler(self.turns)
        self.open: dict[int, OpenEpisodes] = {}
        self._next = 0

    @property
    def live(self) -> int:
        """Episodes not ended (in the engine, thinking, or waiting for a tool): each keeps its place."""
        return sum(sum(not finished(e) for e in group.episodes) for group in self.open.values())

    @property
    def waiting(self) -> bool:
        """Whether episodes are open: their agents may call at any time though the engine is empty."""
        return bool(self.open)

    def submit(self, example: Example, prompt_ids: list[int], sampling: SamplingParams, version: int
               ) -> list[SequenceRequest]:
        """Open a group: its G episodes start; their calls come from poll."""
        index = self._next
        self._next += 1
        episodes = self.agent.open_episodes({"question": example.question, **example.data}, self.group_size)
        self.open[index] = OpenEpisodes(example, episodes, version)
        self.agent.journal_driving(self._driving())
        self.agent.start(episodes)
        return []

    def finish(self, sequence: FinishedSequence) -> None:
        """A call's sequence finished: its endpoint thread gets the turn (groups complete at poll)."""
        self.turns.answer(sequence)

    def poll(self) -> tuple[list[SequenceRequest], list[OpenGroup]]:
        """The calls queued since the last poll; the groups whose episodes have all ended (past their deadline:
        expired first), each as the batch schedule makes it."""
        complete = []
        for index, group in list(self.open.items()):
            if self.agent.book.settle(group.episodes):
                del self.open[index]
                prompt, completions = self.agent.close_group(group.episodes)
                self.stats.completion_tokens += sum(len(c.mask or []) - sum(c.mask or []) for c in completions)
                complete.append(OpenGroup(group.example, prompt, completions, group.opened_version,
                                          done=self.group_size))
        if complete:
            self.agent.journal_driving(self._driving())
        return self.turns.take(), complete

    def wait(self, timeout_s: float) -> None:
        """Until an agent calls (or ``timeout_s``): the engine has nothing to do meanwhile."""
        self.turns.wait_for_call(timeout_s)

    def abandon(self) -> list[str]:
        """Stop: every open group dropped whole, its episodes counted (``episodes_dropped``); the calls waiting
        fail; the ids of those in the engine (to abort)."""
        running = self.turns.close()
        for group in self.open.values():
            self.agent.drop(group.episodes)
        self.open.clear()
        self.agent.journal_driving([])
        return running

    def _driving(self) -> list[str]:
        return [e.id for group in self.open.values() for e in group.episodes]
