"""The rollouts of ``generator.agent``: for each prompt, G episodes driven by the user's agent (or claimed by an
external process), and the groups they make.

``fn(client, example) -> float`` (or ``async def``) runs once per episode on its own thread with an
``openai.OpenAI`` client (``openai.AsyncOpenAI`` for an async fn) whose ``base_url`` is the episode's. Its return
value is the episode's reward unless it posted one (``POST /episodes/{id}/reward``). An agent that raises, returns
something other than a finite number, or has no reward by ``timeout_s`` fails its episode only: the episode keeps
the tokens it recorded, is rewarded ``on_error`` and counted (``env_errors``; generator/failures.py's rule stops a
run whose agent fails too often). A group's prompt is the tokens its episodes' first calls share; the rest of each
episode's first prompt starts its completion as non-model tokens.

A stop (SIGTERM, ctrl-c) while a batch is driven ends the wait: its finished groups go on to be uploaded, a group
with an unfinished episode is dropped whole (an empty group: nothing of it is uploaded) and its episodes counted
(``episodes_dropped``). A kill loses the whole batch; the next generator started on the same
``generator.weights_dir`` counts it (``episodes_dropped_at_restart``, generator/agent/journal.py).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import threading
from pathlib import Path
from typing import Any

from generator.agent.calls import CallHandler
from generator.agent.episodes import AgentStats, Episode, EpisodeBook, finished
from generator.agent.journal import EpisodeJournal, claim_orphans
from generator.agent.sampler import TurnSampler
from generator.agent.server import AgentServer
from generator.engines.base import SampledCompletion
from generator.failures import Failure
from shared.config.schema.agent import AgentConfig
from shared.errors import UsageError
from shared.protocol.records import SamplingParams
from shared.user_code import load_object

log = logging.getLogger("grpo.generator.agent")

FN_KEY = "generator.agent.fn"


def load_agent(spec: str):
    """The agent function ``spec`` names, checked to take ``(client, example)``; a UsageError naming the key."""
    fn = load_object(spec, FN_KEY)
    if not callable(fn):
        raise UsageError(f"{FN_KEY}: {fn!r} is not callable; expected fn(client, example) -> float")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError as exc:
        raise UsageError(f"{FN_KEY}: {getattr(fn, '__qualname__', fn)} cannot be called as fn(client, example) "
                         f"({exc})") from None
    except ValueError:
        pass   # no signature to check: its first call checks
    return fn


def shared_prefix(rows: list[list[int]]) -> list[int]:
    if not rows:
        return []
    first = rows[0]
    length = len(first)
    for row in rows[1:]:
        length = min(length, len(row))
        length = next((i for i in range(length) if row[i] != first[i]), length)
    return first[:length]


class AgentRollouts:
    """Serves the endpoint for the generator's life and turns each batch of prompts into groups of episodes."""

    def __init__(self, engine, tokenizer, cfg: AgentConfig, sampling: SamplingParams, seed: int = 0,
                 journal_dir: str | Path | None = None) -> None:
        """``journal_dir``: where the episodes being driven are journaled (None: nowhere, a kill is not counted)."""
        self.cfg = cfg
        self.stopping = lambda: False   # the rollout loop's stop (RolloutLoop.use_agent): ends a batch's wait
        if cfg.verifiers is not None:   # a verifiers environment's rollouts as the agent
            from generator.agent.verifiers_env import verifiers_agent

            self.fn = verifiers_agent(cfg.verifiers)
        else:
            self.fn = load_agent(cfg.fn) if cfg.fn else None
        if self.fn is not None:
            import openai  # here, not in the first episode's thread: importing it takes a second

            self.openai = openai
            # one client whose connection pool every episode's copy shares: building a client per episode cost
            # 127 ms of CPU each (64 per batch on the calculator demo), copying one costs under a millisecond
            self.client = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key=cfg.token or "no-token",
                                        max_retries=0, timeout=cfg.timeout_s)
        self.stats = AgentStats()
        self.journal = self._journal(journal_dir)
        self.book = EpisodeBook(self.stats)
        self.sampler = TurnSampler(engine, sampling, seed, self.book.open_count)
        self.handler = CallHandler(self.book, self.sampler, tokenizer, cfg, sampling.max_tokens)
        self.server = AgentServer(self.handler, cfg)
        try:
            self.server.start()
        except BaseException:
            self.sampler.close()
            self._close_journal()
            raise
        log.info("agent endpoint at %s/episodes/{id}/v1 (%s)", self.server.url,
                 cfg.name if self.fn else "external agents claim episodes with POST /episodes")

    def _journal(self, folder: str | Path | None) -> EpisodeJournal | None:
        """This process's journal, after counting the episodes that killed generators left in ``folder``."""
        if folder is None:
            return None
        try:
            lost = claim_orphans(folder)
            journal = EpisodeJournal(folder)
        except OSError as exc:   # a folder without locks (some network filesystems) or not writable
            log.warning("the agent's episode journal cannot be kept in %s (%s): a kill of this generator will not "
                        "be counted by the next one", folder, exc)
            return None
        if lost:
            self.stats.episodes_dropped_at_restart = sum(lost.values())
            log.warning("%d episodes of %d generator process(es) that ended while driving them (killed) are dropped: "
                        "nothing of their batches was uploaded (journals %s in %s)",
                        self.stats.episodes_dropped_at_restart, len(lost), ", ".join(lost), folder)
        return journal

    def _close_journal(self) -> None:
        if self.journal is not None:
            self.journal.close()

    def close(self) -> None:
        self.server.stop()
        self.sampler.close()
        if self.fn is not None:
            self.client.close()
        self._close_journal()

    def base_url(self, episode: Episode) -> str:
        return f"{self.server.url}/episodes/{episode.id}/v1"

    def generate(self, samples: list[dict[str, Any]], prompts: list[list[int]], sampling: SamplingParams, n: int,
                 seed: int | None = None) -> tuple[list[list[int]], list[list[SampledCompletion]]]:
        """``n`` episodes of each sample; the group prompts and the episodes as completions. ``prompts`` (the
        dataset's rendering) are not used: the agent's calls make the prompts. The endpoint samples these episodes'
        calls with ``sampling``'s temperature, top-p and top-k (in training the generator's; ``grpo eval``: greedy,
        then eval.temperature), never a call's own."""
        self.sampler.sampling = sampling   # between batches: no episode is open, no call is being sampled
        groups = [self.open_episodes(sample, n) for sample in samples]
        episodes = [e for group in groups for e in group]
        if self.journal is not None:
            self.journal.opened([e.id for e in episodes])
        self.start(episodes)
        if not self.book.wait_closed(episodes, self.stopping):
            groups = self._drop_unfinished(groups)
        self.book.forget(episodes)
        if self.journal is not None:
            self.journal.handed_on()
        result = [self._group(group) if group else ([], []) for group in groups]
        self._count(episodes)
        return [prompt for prompt, _ in result], [completions for _, completions in result]

    # -- the parts of a batch, which the continuous schedule drives one group at a time (continuous/episodes.py)
    def open_episodes(self, sample: dict[str, Any], n: int) -> list[Episode]:
        return [self.book.open(sample, self.cfg.timeout_s) for _ in range(n)]

    def start(self, episodes: list[Episode]) -> None:
        """The agent function on each episode, a thread each (an external agent claims them instead)."""
        if self.fn is not None:
            for episode in episodes:
                threading.Thread(target=self._drive, args=(episode,), daemon=True, name="grpo-agent").start()

    def close_group(self, group: list[Episode]) -> tuple[list[int], list[SampledCompletion]]:
        """Ended episodes of one prompt, forgotten by the book and counted: the group's prompt and completions."""
        self.book.forget(group)
        self._count(group)
        return self._group(group)

    def drop(self, episodes: list[Episode]) -> None:
        """A stop before these episodes' group ended: closed, counted (``episodes_dropped``), forgotten."""
        self.book.drop(episodes)
        self.book.forget(episodes)

    def use_sampler(self, sampler) -> None:
        """Sample the endpoint's calls with ``sampler`` (``sample(context, max_tokens, stops)``), not the batch
        schedule's TurnSampler, which stops."""
        self.sampler.close()
        self.sampler = self.handler.sampler = sampler

    def journal_driving(self, episode_ids: list[str]) -> None:
        """The journal lists exactly these episodes (the continuous schedule's, as groups open and end)."""
        if self.journal is not None:
            self.journal.handed_on()
            self.journal.opened(episode_ids)

    def _drop_unfinished(self, groups: list[list[Episode]]) -> list[list[Episode]]:
        """The generator is stopping: each group with an unfinished episode dropped whole (counted), as an empty
        group the loop skips; the finished groups kept."""
        kept = [all(finished(e) for e in group) for group in groups]
        unfinished = [group for group, keep in zip(groups, kept) if not keep]
        for group in unfinished:
            self.book.drop(group)
        if unfinished:
            log.warning("stopping: %d of %d groups of this batch have unfinished episodes: dropped, their %d "
                        "episodes counted (episodes_dropped); the %d finished groups go on", len(unfinished),
                        len(groups), sum(map(len, unfinished)), len(groups) - len(unfinished))
        return [group if keep else [] for group, keep in zip(groups, kept)]

    def _drive(self, episode: Episode) -> None:
        """Run the agent on one episode; its value is the reward unless it posted one."""
        try:
            value = self._call(episode)
        except Exception as exc:  # noqa: BLE001 - any error of the user's agent fails its episode only
            self.book.fail(episode, Failure.of(exc, "raised "), "agent_errors")
            return
        if episode.closed:
            return   # it posted its reward (or failed meanwhile)
        if value is None and self.cfg.reward == "rewards":
            value = 0.0   # generator.rewards score the episode: what the agent returns is not used
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.book.fail(episode, f"returned {value!r}, not a finite number (its reward)", "agent_errors")
            return
        try:
            self.book.reward(episode.id, float(value), None)
        except LookupError:
            pass   # expired meanwhile: counted there
        except RuntimeError as exc:   # a call the agent left running: the episode cannot be closed under it
            self.book.fail(episode, f"returned while a call of its episode was being answered ({exc})",
                           "agent_errors")

    def _call(self, episode: Episode) -> Any:
        openai = self.openai
        key = self.cfg.token or "no-token"
        if inspect.iscoroutinefunction(self.fn):
            async def run():
                async with openai.AsyncOpenAI(base_url=self.base_url(episode), api_key=key, max_retries=0,
                                              timeout=self.cfg.timeout_s) as client:
                    return await self.fn(client, episode.example)
            return asyncio.run(run())
        # a copy pointed at the episode, sharing the connection pool (never closed here: that would close the pool)
        return self.fn(self.client.with_options(base_url=self.base_url(episode)), episode.example)

    def _group(self, group: list[Episode]) -> tuple[list[int], list[SampledCompletion]]:
        prompt = shared_prefix([e.prompt for e in group if e.prompt is not None])
        completions = [e.completion(len(prompt)) for e in group]
        if not prompt:
            for completion in completions:
                completion.unusable = "no episode of the group called the model (nothing was sampled to train on)"
        return prompt, completions

    def _count(self, episodes: list[Episode]) -> None:
        stats = self.stats
        with self.book.lock:
            stats.trajectories += len(episodes)
            for episode in episodes:
                stats.model_tokens += sum(episode.mask)
                stats.env_tokens += len(episode.mask) - sum(episode.mask)
                stats.trajectories_with_calls += 0 in episode.mask
