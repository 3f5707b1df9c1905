"""One thread owns the engine: the endpoint's calls, from many episodes at once, are sampled together.

Each call queues its context (token ids), its most tokens and its stop strings, and waits for its turn. The thread
gathers calls into a batch until every open episode has a call in it, no call came for :data:`GATHER_S`, or
:data:`MAX_GATHER_S` passed (so the G episodes of a batch of prompts, whose agents start and answer tools at
slightly different times, share engine calls), samples the calls with the same stop strings in one
``generate_turns`` call at the most tokens any of them asked for, and cuts each turn at its own limit: sampling is
causal, so a turn's first k tokens are a sample of k tokens.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace

from generator.engines.base import SampledTurn
from shared.protocol.records import SamplingParams

log = logging.getLogger("grpo.generator.agent")

GATHER_S = 0.02      # a batch is sampled when no further call came for this long ...
MAX_GATHER_S = 0.25  # ... or this long after its first call


@dataclass
class TurnRequest:
    context: list[int]
    max_tokens: int
    stops: tuple[str, ...]
    answer: Future


def cut(turn: SampledTurn, max_tokens: int) -> SampledTurn:
    """``turn`` limited to ``max_tokens`` tokens (ended 'length' when that cut it)."""
    if len(turn.token_ids) <= max_tokens:
        return turn
    return SampledTurn(turn.token_ids[:max_tokens], turn.logprobs[:max_tokens], "length")


class TurnSampler:
    """Samples turns with ``engine.generate_turns`` on its own thread, with the generator's sampling parameters
    (temperature, top-p, top-k: the learner's must be the same, so a call's own are not used)."""

    def __init__(self, engine, sampling: SamplingParams, seed: int = 0,
                 open_episodes: Callable[[], int] = lambda: 0) -> None:
        """``open_episodes``: how many episodes may still call (a batch holding that many calls waits no more)."""
        self.engine, self.sampling, self.seed = engine, sampling, seed
        self.open_episodes = open_episodes
        self.batches: list[int] = []   # calls per engine call, for the tests and the log
        self._queue: queue.Queue[TurnRequest | None] = queue.Queue()
        self._calls = 0
        self._thread = threading.Thread(target=self._serve, name="grpo-agent-sampler", daemon=True)
        self._thread.start()

    def sample(self, context: list[int], max_tokens: int, stops: list[str]) -> SampledTurn:
        """One turn after ``context`` (blocks until sampled; the engine's error is raised here)."""
        request = TurnRequest(list(context), max_tokens, tuple(stops), Future())
        self._queue.put(request)
        return request.answer.result()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _serve(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = self._gather(first)
            self.batches.append(len(batch))
            by_stops: dict[tuple[str, ...], list[TurnRequest]] = {}
            for request in batch:
                by_stops.setdefault(request.stops, []).append(request)
            for stops, requests in by_stops.items():
                self._sample(list(stops), requests)

    def _gather(self, first: TurnRequest) -> list[TurnRequest]:
        batch, deadline = [first], time.monotonic() + MAX_GATHER_S
        while len(batch) < self.open_episodes():
            try:
                item = self._queue.get(timeout=max(0.0, min(GATHER_S, deadline - time.monotonic())))
            except queue.Empty:
                break
            if item is None:
                self._queue.put(None)   # finish this batch, then stop
                break
            batch.append(item)
        return batch

    def _sample(self, stops: list[str], requests: list[TurnRequest]) -> None:
        longest = max(r.max_tokens for r in requests)
        params = replace(self.sampling, max_tokens=longest)
        self._calls += 1
        try:
            turns = self.engine.generate_turns([r.context for r in requests], params, 1, stops,
                                               seed=self.seed + self._calls)
        except Exception as exc:  # noqa: BLE001 - the engine's error goes to every call of the batch
            log.exception("sampling %d agent calls failed", len(requests))
            for request in requests:
                request.answer.set_exception(exc)
            return
        for request, group in zip(requests, turns):
            request.answer.set_result(cut(group[0], request.max_tokens))
