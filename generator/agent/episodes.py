"""Episodes: what an agent's calls recorded, token in, token out, until its reward closes it.

An episode holds its first call's prompt ids, then every token that followed: the model's sampled tokens (mask 1,
their behaviour logprobs) and the text the agent added between calls (tool results, user turns: mask 0, logprob 0),
the end of each model turn (for step rewards) and the last call's conversation (chat) to check the next call
continues it. The :class:`EpisodeBook` holds the episodes of the batch being generated: one call at a time per
episode, a deadline each (an episode past it expires: failed and counted), and a condition the runner waits on
until every episode of the batch is closed, or the generator is stopping (the unfinished groups are then dropped).
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from generator.engines.base import SampledCompletion
from generator.failures import Failure
from generator.multiturn import EnvStats


class EpisodeGone(LookupError):
    """No open episode of that id (unknown, closed, failed or expired): the message says which."""


@dataclass
class AgentStats(EnvStats):
    """The multi-turn counters (turns, calls, tokens, failures in ``env_errors``) and the agent's own."""

    template_mismatches: int = 0   # calls whose template rendered the recorded history differently than sampled
    diverged: int = 0              # episodes failed by a call that did not continue their conversation
    expired: int = 0               # episodes without a reward before their deadline
    agent_errors: int = 0          # episodes whose agent function raised
    episodes_dropped: int = 0      # episodes of groups left unfinished by a stop (SIGTERM, ctrl-c): not uploaded
    episodes_dropped_at_restart: int = 0   # episodes a killed generator was driving, found at start (journal.py)


@dataclass
class Episode:
    id: str
    example: dict[str, Any]
    deadline: float
    prompt: list[int] | None = None          # the first call's prompt ids
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)   # index in ``tokens`` of each model turn's last token
    conversation: list[tuple] | None = None  # chat: the last call's messages and the reply, normalized
    shown: str | None = None                 # text calls: the last prompt and the answer's text, as the client read them
    last_ended: str = ""                     # how the last model turn ended: "eos", "stop_string" or "length"
    calls: int = 0
    reward: float | None = None
    step_rewards: list[float] | None = None
    finish: str | None = None                # "stop" or "length" once ended by a call (else "stop" at the reward)
    failure: Failure | None = None
    closed: bool = False
    busy: bool = False                       # a call of this episode is being answered
    claimed: bool = False                    # an external process took it (POST /episodes)
    # the policy version of each token (continuous schedule: weights change between and inside calls); None: the
    # batch schedule's episodes, sampled with one version
    versions: list[int] | None = None

    @property
    def context(self) -> list[int]:
        return (self.prompt or []) + self.tokens

    def append(self, ids: list[int], logprobs: list[float] | None, model: bool,
               versions: list[int] | None = None) -> None:
        """Tokens of the episode: the model's (with their logprobs and, on the continuous schedule, the version
        that sampled each) or another's (logprob 0; the version of the model token before them)."""
        if versions is not None and self.versions is None:
            self.versions = [versions[0] if versions else 0] * len(self.tokens)   # before it: the first version
        if self.versions is not None:
            self.versions += versions if versions is not None else [self.versions[-1] if self.versions else 0] * len(ids)
        self.tokens += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.mask += [1 if model else 0] * len(ids)
        if model and ids:
            self.turn_ends.append(len(self.tokens) - 1)

    def completion(self, prompt_length: int) -> SampledCompletion:
        """The episode as a completion after the group's shared ``prompt_length`` prompt tokens: the rest of its
        own prompt comes first, as non-model tokens."""
        own = (self.prompt or [])[prompt_length:]
        steps = None
        if self.step_rewards is not None and self.failure is None:
            offset = len(own)
            steps = [(self.turn_ends[i] + offset, r) for i, r in enumerate(self.step_rewards)]
        versions = None
        if self.versions is not None:   # the first prompt's own part: the first model token's version
            versions = [self.versions[0] if self.versions else 0] * len(own) + self.versions
        return SampledCompletion(own + self.tokens, [0.0] * len(own) + self.logprobs, self.finish or "stop",
                                 mask=[0] * len(own) + self.mask, env_reward=self.reward, env_failure=self.failure,
                                 token_steps=steps, versions=versions)


def finished(episode: Episode) -> bool:
    """Closed, with no call of it still being answered."""
    return episode.closed and not episode.busy


class EpisodeBook:
    """The open episodes, by id, under one lock (the endpoint's threads and the runner share it)."""

    def __init__(self, stats: AgentStats) -> None:
        self.stats = stats
        self._episodes: dict[str, Episode] = {}
        self.lock = threading.Condition()

    def open(self, example: dict[str, Any], timeout_s: float) -> Episode:
        episode = Episode(uuid.uuid4().hex, example, time.monotonic() + timeout_s)
        with self.lock:
            self._episodes[episode.id] = episode
        return episode

    def open_count(self) -> int:
        """Episodes that may still call (open, not closed)."""
        with self.lock:
            return sum(not e.closed for e in self._episodes.values())

    def claim(self, wait_s: float) -> Episode | None:
        """An unclaimed open episode (an external agent takes it), waiting up to ``wait_s`` for one."""
        with self.lock:
            self.lock.wait_for(lambda: self._unclaimed() is not None, timeout=wait_s)
            episode = self._unclaimed()
            if episode is not None:
                episode.claimed = True
            return episode

    def _unclaimed(self) -> Episode | None:
        return next((e for e in self._episodes.values() if not e.claimed and not e.closed), None)

    def begin_call(self, episode_id: str) -> Episode:
        """The episode, marked busy for one call; EpisodeGone when it is not open, RuntimeError when busy."""
        with self.lock:
            episode = self._open(episode_id)
            if episode.busy:
                raise RuntimeError(f"episode {episode_id} is answering another call: an episode's calls come one "
                                   "after the other")
            episode.busy = True
            return episode

    def end_call(self, episode: Episode) -> None:
        with self.lock:
            episode.busy = False
            self.lock.notify_all()

    def _open(self, episode_id: str) -> Episode:
        episode = self._episodes.get(episode_id)
        if episode is None:
            raise EpisodeGone(f"no episode {episode_id!r} (unknown, or its batch is over)")
        if episode.closed:
            why = f"failed: {episode.failure}" if episode.failure is not None else "closed by its reward"
            raise EpisodeGone(f"episode {episode_id} is {why}")
        if time.monotonic() > episode.deadline:
            self._expire(episode)
            raise EpisodeGone(f"episode {episode_id} expired (generator.agent.timeout_s)")
        return episode

    def reward(self, episode_id: str, reward: float | None, steps: list[float] | None) -> Episode:
        """Close an episode with its reward (or step rewards, whose sum is its reward)."""
        with self.lock:
            episode = self._open(episode_id)
            if episode.busy:
                raise RuntimeError(f"episode {episode_id} is answering a call: its reward comes after it")
            if steps is not None:
                if len(steps) > len(episode.turn_ends):
                    raise ValueError(f"steps: {len(steps)} step rewards for {len(episode.turn_ends)} model turns")
                episode.step_rewards, reward = list(steps), float(sum(steps))
            episode.reward, episode.closed = reward, True
            self.lock.notify_all()
            return episode

    def fail(self, episode: Episode, why: Failure | str, counter: str | None = None) -> None:
        with self.lock:
            if episode.closed:
                return
            episode.failure = why if isinstance(why, Failure) else Failure(why)
            episode.closed = True
            self.stats.env_errors += 1
            if counter is not None:
                setattr(self.stats, counter, getattr(self.stats, counter) + 1)
            self.lock.notify_all()

    def _expire(self, episode: Episode) -> None:
        self.fail(episode, "no reward before generator.agent.timeout_s", "expired")

    def wait_closed(self, episodes: list[Episode], stopping=lambda: False, poll_s: float = 0.5) -> bool:
        """Until every one of ``episodes`` is closed (True), or ``stopping()`` (False: some may be open); those
        past their deadline expire (failed and counted)."""
        with self.lock:   # reentrant: settle takes it again
            while not self.settle(episodes):   # a call in flight finishes its record first
                if stopping():
                    return False
                self.lock.wait(poll_s)
            return True

    def settle(self, episodes: list[Episode]) -> bool:
        """Without waiting: whether every one of ``episodes`` has ended (those past their deadline expire first,
        failed and counted), as :meth:`wait_closed` decides it."""
        with self.lock:
            now = time.monotonic()
            for episode in episodes:
                if not episode.closed and not episode.busy and now > episode.deadline:
                    self._expire(episode)
            return all(finished(e) for e in episodes)

    def drop(self, episodes: list[Episode]) -> None:
        """The generator stops before these episodes' group is finished: closed (a later call or reward gets 404
        saying so), not failed (no failure of the agent's), counted in ``episodes_dropped``."""
        with self.lock:
            for episode in episodes:
                if not episode.closed:
                    episode.failure = Failure("dropped: the generator stopped before its group finished")
                    episode.closed = True
            self.stats.episodes_dropped += len(episodes)
            self.lock.notify_all()

    def forget(self, episodes: list[Episode]) -> None:
        with self.lock:
            for episode in episodes:
                self._episodes.pop(episode.id, None)
