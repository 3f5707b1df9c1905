"""Groups in flight: each prompt's G sequences are submitted together; the group is complete when all G finished."""

from __future__ import annotations

from dataclasses import dataclass

from generator.datasets import Example
from generator.engines.base import FinishedSequence, SampledCompletion, SequenceRequest
from generator.loop import derived_seed
from shared.protocol.records import SamplingParams


@dataclass
class OpenGroup:
    example: Example
    prompt_ids: list[int]
    samples: list[SampledCompletion | None]
    opened_version: int                  # the policy version when its sequences were submitted
    done: int = 0

    @property
    def complete(self) -> bool:
        return self.done == len(self.samples)


class GroupsInFlight:
    """Request ids are ``"<group index>/<sample index>"``: the finished sequence says which slot it fills."""

    def __init__(self, group_size: int, seed: int, generator_id: str) -> None:
        self.group_size, self.seed, self.generator_id = group_size, seed, generator_id
        self.open: dict[int, OpenGroup] = {}
        self._next = 0

    def submit(self, example: Example, prompt_ids: list[int], sampling: SamplingParams, version: int
               ) -> list[SequenceRequest]:
        """Open a group for ``example``: its G requests, each with its own seed."""
        index = self._next
        self._next += 1
        self.open[index] = OpenGroup(example, prompt_ids, [None] * self.group_size, version)
        return [SequenceRequest(f"{index}/{j}", list(prompt_ids), sampling,
                                derived_seed(self.seed, self.generator_id, index, j))
                for j in range(self.group_size)]

    def finish(self, finished: FinishedSequence) -> OpenGroup | None:
        """Record a finished sequence; the group, removed from the open ones, when it was its last. A sequence of a
        group no longer open (aborted) or one already recorded is an engine fault: it raises."""
        index, _, sample = finished.request_id.partition("/")
        group = self.open.get(int(index))
        if group is None or group.samples[int(sample)] is not None:
            raise RuntimeError(f"the engine returned sequence {finished.request_id!r}, which is not in flight")
        group.samples[int(sample)] = finished.completion
        group.done += 1
        if not group.complete:
            return None
        return self.open.pop(int(index))

    @property
    def live(self) -> int:
        """Sequences not finished (all in the engine: a group's G are submitted together)."""
        return sum(len(group.samples) - group.done for group in self.open.values())

    waiting = False   # nothing runs outside the engine (the multi-turn TrajectoriesInFlight has environment calls)

    def poll(self) -> tuple[list[SequenceRequest], list[OpenGroup]]:
        """Nothing: every sequence is submitted by ``submit``, every complete group returned by ``finish``."""
        return [], []

    def abandon(self) -> list[str]:
        """Forget every open group; the request ids of their unfinished sequences (to abort in the engine)."""
        ids = [f"{index}/{j}" for index, group in self.open.items()
               for j, sample in enumerate(group.samples) if sample is None]
        self.open.clear()
        return ids
