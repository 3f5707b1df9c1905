"""Multi-turn rollouts: the model's turns alternate with an environment's observations, all as tokens.

A trajectory is the prompt's tokens, then model turn 1, observation 1, model turn 2, ... Each observation is
tokenized on its own and appended (never a re-rendering of the history through a template: the tokens the model is
trained on are exactly the tokens it saw). The mask marks which completion tokens the model wrote (1) and which the
environment did (0); observations carry behaviour logprob 0 (never sampled, never trained on).

Batched: turn 1 samples the G trajectories of every prompt together (``n = G``, one prompt encoding each); every
later turn samples all still-active trajectories of the batch in one engine call. The environment calls of a turn
run in parallel threads, each bounded by ``timeout_s``.

Ends: EOS (``stop``); ``max_turns`` model turns (``length`` when the last turn asked for more, i.e. ended at a stop
string); a turn cut at ``max_turn_tokens`` or the trajectory reaching ``max_total_tokens`` (``length``); the
environment answering None or ``done`` (``stop``); a failure of the environment (``stop``, rewarded ``on_error``,
counted, and kept as a :class:`~generator.failures.Failure` with its file:line for the rule that stops a run whose
environment fails too often: generator/failures.py). The environment is called after every model turn that ended at
EOS or a stop string, also after the last allowed turn (its reward counts); observations after the trajectory is
over are not appended.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from generator.engines.base import SampledCompletion, SampledTurn
from generator.environments.base import StepResult, environment_factory, stop_strings
from generator.failures import Failure, thread_frame
from shared.config.schema.generator import EnvironmentConfig
from shared.protocol.records import SamplingParams

log = logging.getLogger("grpo.generator.multiturn")

# An observation longer than this many characters per allowed token is refused before it is tokenized (a 10 MB
# string would otherwise cost a tokenizer pass).
CHARS_PER_TOKEN_LIMIT = 32


class EnvironmentFailure(RuntimeError):
    """The environment raised, hung or returned something unusable; the message says which."""


@dataclass
class EnvStats:
    """What the environments did, over all trajectories so far (the loop adds them to its metrics)."""

    trajectories: int = 0
    turns: int = 0            # model turns
    env_calls: int = 0        # step() calls that returned an observation (tool calls answered)
    trajectories_with_calls: int = 0  # trajectories with at least one observation appended (the tool-call rate)
    env_errors: int = 0       # trajectories failed by their environment
    tool_calls: int = 0       # chat tool calls the model wrote (environments with a ``tool_calls`` count)
    tool_errors: int = 0      # of those, answered with an error (malformed, unknown tool, bad arguments, raised)
    env_time_s: float = 0.0   # wall-clock time inside reset()/step(), summed over the turn's parallel calls
    env_tokens: int = 0       # completion tokens written by environments
    model_tokens: int = 0     # completion tokens written by the model

    @property
    def masked_fraction(self) -> float:
        total = self.env_tokens + self.model_tokens
        return self.env_tokens / total if total else 0.0

    @property
    def tool_call_rate(self) -> float:
        return self.trajectories_with_calls / self.trajectories if self.trajectories else 0.0


@dataclass
class Trajectory:
    env: Any
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    env_reward: float | None = None
    finish: str | None = None    # None while the trajectory goes on
    error: Failure | None = None  # what failed it (its environment)
    unusable: str | None = None  # why it can never be trained on (its reset text left no room for a model token)
    # the policy version of each token (the continuous schedule; None for environment tokens until completion());
    # empty while no model token came with versions
    versions: list[int | None] = field(default_factory=list)

    def append(self, ids: Sequence[int], logprobs: Sequence[float] | None, model: bool,
               versions: Sequence[int] | None = None) -> None:
        if versions is not None or self.versions:
            self.versions += [None] * (len(self.tokens) - len(self.versions))
            self.versions += list(versions) if versions is not None else [None] * len(ids)
        self.tokens += list(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.mask += [1 if model else 0] * len(ids)

    def token_versions(self) -> list[int] | None:
        """Each token's version: a model token's own; an environment token the version of the model token before
        it (the first model token's for those before any), so a row never goes back
        (shared/protocol/token_versions.py). None when no token came with one (the call-at-a-time schedule)."""
        known = [v for v in self.versions if v is not None]
        if not known:
            return None
        out, last = [], known[0]
        for version in self.versions:
            last = last if version is None else version
            out.append(last)
        return out

    def completion(self) -> SampledCompletion:
        return SampledCompletion(self.tokens, self.logprobs, self.finish or "length", mask=self.mask,
                                 env_reward=self.env_reward, env_failure=self.error,
                                 unusable=self.unusable, versions=self.token_versions())


def call_all(calls: list[Callable[[], Any]], timeout_s: float) -> list[tuple[Any, Failure | None]]:
    """Run ``calls`` in parallel daemon threads; for each, ``(value, None)`` or ``(None, what failed)`` (raised,
    or still running ``timeout_s`` after the start: where it was then; its thread is abandoned, Python cannot stop
    it)."""
    boxes: list[dict] = [{} for _ in calls]

    def run(call, box):
        try:
            box["value"] = call()
        except Exception as exc:  # noqa: BLE001 - any error of user code fails its trajectory only
            box["error"] = Failure.of(exc, "raised ")

    threads = [threading.Thread(target=run, args=(c, b), daemon=True, name="grpo-env") for c, b in zip(calls, boxes)]
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    results: list[tuple[Any, Failure | None]] = []
    for thread, box in zip(threads, boxes):
        if thread.is_alive():
            results.append((None, Failure.hung("generator.environment.timeout_s", timeout_s, thread_frame(thread.ident))))
        elif "error" in box:
            results.append((None, box["error"]))
        elif "value" not in box:
            results.append((None, Failure("ended without returning")))
        else:
            results.append((box["value"], None))
    return results


@dataclass
class OpenedEnvironments:
    """What building and resetting a batch's environments gave (:meth:`MultiTurnRollouts.create_and_reset`)."""

    created: list[tuple[Any, Failure | None]]        # per trajectory: its environment, or what failed building it
    resets: dict[int, tuple[Any, Failure | None]]    # per trajectory built: what reset() returned, or what failed
    seconds: float                                   # wall time of the calls


def parse_step(value: Any) -> StepResult:
    """``step()``'s answer as a StepResult; EnvironmentFailure for anything but str, StepResult or None."""
    if value is None:
        return StepResult(done=True)
    if isinstance(value, str):
        return StepResult(observation=value)
    if not isinstance(value, StepResult):
        raise EnvironmentFailure(f"step() returned {type(value).__name__}, not str, StepResult or None")
    if value.observation is not None and not isinstance(value.observation, str):
        raise EnvironmentFailure(f"step() returned an observation of type {type(value.observation).__name__}")
    reward = value.reward
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                               or not math.isfinite(reward)):
        raise EnvironmentFailure(f"step() returned reward {reward!r}, not a finite number")
    if not isinstance(value.done, bool):
        raise EnvironmentFailure(f"step() returned done={value.done!r}, not a bool")
    return value


class MultiTurnRollouts:
    """Multi-turn trajectories with the environment ``cfg`` names, on an engine with ``generate_turns``."""

    def __init__(self, engine, tokenizer, cfg: EnvironmentConfig) -> None:
        if not hasattr(engine, "generate_turns"):
            raise NotImplementedError(f"the {engine.name} engine does not support multi-turn rollouts yet "
                                      "(generator.environment needs generator.engine: transformers)")
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        self.env_class = environment_factory(cfg)
        # an environment that needs the tokenizer (tool calling: its chat template) builds its own factory
        with_tokenizer = getattr(self.env_class, "with_tokenizer", None)
        self.make_env = with_tokenizer(tokenizer, cfg.args) if callable(with_tokenizer) else \
            (lambda: self.env_class(**cfg.args))
        self.stops = stop_strings(cfg, self.env_class)
        self.stats = EnvStats()

    def encode(self, text: str) -> list[int]:
        """An observation's tokens: the text tokenized on its own, no special tokens added."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _calls(self, calls: list[Callable[[], Any]]) -> list[tuple[Any, Failure | None]]:
        started = time.perf_counter()
        results = call_all(calls, self.cfg.timeout_s)
        self.stats.env_time_s += time.perf_counter() - started
        return results

    def _fail(self, trajectory: Trajectory, why: Failure | str) -> None:
        """``why``: what failed (a Failure, or the reason when no code of the environment raised)."""
        trajectory.error, trajectory.finish = why if isinstance(why, Failure) else Failure(why), "stop"
        self.stats.env_errors += 1
        log.warning("environment failed a trajectory: %s", trajectory.error)

    def _check_room(self, row: Trajectory) -> None:
        """A trajectory whose reset() text alone reaches ``max_total_tokens`` ends before any model turn: it holds
        no model token, so the hub refuses its group (generator/refusals.py drops it, once)."""
        limit = self.cfg.max_total_tokens
        if row.finish is None and len(row.tokens) >= limit:
            row.finish = "length"
            row.unusable = (f"the environment's reset() text is {len(row.tokens)} tokens, which leaves no room for a "
                            f"model token within generator.environment.max_total_tokens = {limit}")

    def observation_tokens(self, text: str) -> list[int]:
        limit = self.cfg.max_env_tokens
        if len(text) > limit * CHARS_PER_TOKEN_LIMIT:
            raise EnvironmentFailure(f"observation of {len(text)} characters (max_env_tokens = {limit})")
        ids = self.encode(text)
        if len(ids) > limit:
            raise EnvironmentFailure(f"observation of {len(ids)} tokens > max_env_tokens = {limit}")
        return ids

    # -- the rollout ----------------------------------------------------------------------------------------
    def generate(self, samples: list[dict[str, Any]], prompts: list[list[int]], sampling: SamplingParams, n: int,
                 seed: int | None = None) -> tuple[list[list[int]], list[list[SampledCompletion]]]:
        """``n`` trajectories of each prompt: the prompts (each extended by its environments' reset text when they
        all gave the same one) and, per prompt, ``n`` completions with their masks."""
        opened = self.create_and_reset([samples[i // n] for i in range(len(prompts) * n)])
        self.stats.env_time_s += opened.seconds
        rows, prompts, shared_prompt = self.open_rows(opened, prompts, n)
        self._run_turns(rows, prompts, sampling, n, seed, first_turn_shared=shared_prompt)
        completions = self.close_rows(rows)
        return prompts, [completions[p * n:(p + 1) * n] for p in range(len(prompts))]

    def create_and_reset(self, samples: list[dict[str, Any]]) -> OpenedEnvironments:
        """One environment per sample, built and reset: the environment calls only, so any thread may run it (the
        continuous schedule runs it off its engine loop); :meth:`open_rows` makes the trajectories of the answers."""
        started = time.perf_counter()
        created = call_all([self.make_env for _ in samples], self.cfg.timeout_s)
        live = [i for i, (_, error) in enumerate(created) if error is None]
        answers = call_all([lambda env=created[i][0], s=samples[i]: env.reset(s) for i in live], self.cfg.timeout_s)
        return OpenedEnvironments(created, dict(zip(live, answers)), time.perf_counter() - started)

    def open_rows(self, opened: OpenedEnvironments, prompts: list[list[int]], n: int
                  ) -> tuple[list[Trajectory], list[list[int]], bool]:
        """The trajectories of ``n`` environments per prompt (``opened``), the prompts extended by their group's
        reset text when all ``n`` gave the same one, and whether every prompt was (its first turn can be shared)."""
        rows = [Trajectory(env=None) for _ in range(len(prompts) * n)]
        for row, (env, error) in zip(rows, opened.created):
            row.env = env
            if error is not None:
                self._fail(row, error.prefixed("creating the environment "))
        resets = opened.resets
        prompts = [list(p) for p in prompts]
        shared_prompt = True
        for p in range(len(prompts)):
            texts = set()
            for i in range(p * n, (p + 1) * n):
                value, error = resets.get(i, (None, None))
                if error is not None:
                    self._fail(rows[i], error.prefixed("reset() "))
                elif value is not None and not isinstance(value, str):
                    self._fail(rows[i], f"reset() returned {type(value).__name__}, not str or None")
                else:
                    texts.add(value or "")
            if len(texts) == 1:   # the usual case: one text for the whole group joins the prompt
                prompts[p] += self.encode(texts.pop()) if any(texts) else []
                continue
            shared_prompt = False  # different texts: each trajectory starts with its own as environment tokens
            for i in range(p * n, (p + 1) * n):
                value = resets[i][0] if i in resets else None
                if rows[i].finish is None and value:
                    try:
                        rows[i].append(self.observation_tokens(value), None, model=False)
                    except EnvironmentFailure as exc:
                        self._fail(rows[i], f"reset() {exc}")
                    self._check_room(rows[i])
        return rows, prompts, shared_prompt

    def close_rows(self, rows: list[Trajectory]) -> list[SampledCompletion]:
        """Finished trajectories as completions, counted in the stats."""
        self.stats.trajectories += len(rows)
        for row in rows:
            self.stats.model_tokens += sum(row.mask)
            self.stats.env_tokens += len(row.mask) - sum(row.mask)
            self.stats.trajectories_with_calls += 0 in row.mask
            for name in ("tool_calls", "tool_errors"):
                count = getattr(row.env, name, 0)
                if isinstance(count, int) and not isinstance(count, bool):
                    setattr(self.stats, name, getattr(self.stats, name) + count)
        return [row.completion() for row in rows]

    def turn_sampling(self, sampling: SamplingParams, rows: list[Trajectory]) -> SamplingParams:
        """A model turn's sampling: at most ``max_turn_tokens`` (else ``sampling.max_tokens``) and at most the room
        the longest-to-go of ``rows`` has left under ``max_total_tokens``."""
        room = max(self.cfg.max_total_tokens - len(row.tokens) for row in rows)
        return replace(sampling, max_tokens=max(1, min(self.cfg.max_turn_tokens or sampling.max_tokens, room)))

    def _run_turns(self, rows: list[Trajectory], prompts: list[list[int]], sampling: SamplingParams, n: int,
                   seed: int | None, first_turn_shared: bool) -> None:
        for turn in range(self.cfg.max_turns):
            active = [i for i, r in enumerate(rows) if r.finish is None]
            if not active:
                return
            turn_sampling = self.turn_sampling(sampling, [rows[i] for i in active])
            turn_seed = None if seed is None else seed + turn
            if turn == 0 and first_turn_shared and all(r.finish is None for r in rows):
                sampled = self.engine.generate_turns(prompts, turn_sampling, n, self.stops, seed=turn_seed)
                turns = {p * n + j: t for p, group in enumerate(sampled) for j, t in enumerate(group)}
            else:
                contexts = [prompts[i // n] + rows[i].tokens for i in active]
                sampled = self.engine.generate_turns(contexts, turn_sampling, 1, self.stops, seed=turn_seed)
                turns = {i: group[0] for i, group in zip(active, sampled)}
            self._after_turn(rows, active, turns)

    def _after_turn(self, rows: list[Trajectory], active: list[int], turns: dict[int, SampledTurn]) -> None:
        asking = [i for i in active if self.take_turn(rows[i], turns[i])]
        answers = self._calls([self.step_call(rows[i], turns[i]) for i in asking])
        for i, answer in zip(asking, answers):
            self.apply_step(rows[i], turns[i].ended, answer)

    def take_turn(self, row: Trajectory, sampled: SampledTurn, versions: list[int] | None = None) -> bool:
        """Append a model turn (cut to the room left under ``max_total_tokens``); whether the environment is asked
        about it (it ended at EOS or a stop string; a turn cut at a token cap ends the trajectory: ``length``).
        ``versions``: the policy version of each of its tokens (the continuous schedule)."""
        room = self.cfg.max_total_tokens - len(row.tokens)
        ids, logprobs, ended = sampled.token_ids, sampled.logprobs, sampled.ended
        if len(ids) > room:
            ids, logprobs, ended = ids[:room], logprobs[:room], "length"
            versions = None if versions is None else versions[:room]
        row.append(ids, logprobs, model=True, versions=versions)
        row.turns += 1
        self.stats.turns += 1
        if ended == "length":   # cut at max_turn_tokens or at max_total_tokens
            row.finish = "length"
            return False
        return True

    def step_call(self, row: Trajectory, sampled: SampledTurn) -> Callable[[], Any]:
        """The environment's ``step`` on the text of the model's latest turn, as a call for :func:`call_all`."""
        text = self._decode(sampled.token_ids)
        return lambda: row.env.step(text)

    def apply_step(self, row: Trajectory, ended: str, answer: tuple[Any, Failure | None]) -> None:
        """What the environment answered a turn that ``ended`` at "eos" or "stop_string": its reward counted, the
        trajectory over, or its observation appended."""
        cfg = self.cfg
        value, error = answer
        if error is not None:
            self._fail(row, error.prefixed("step() "))
            return
        try:
            result = parse_step(value)
        except EnvironmentFailure as exc:
            self._fail(row, str(exc))
            return
        if result.reward is not None:
            row.env_reward = (row.env_reward or 0.0) + float(result.reward)
        if ended == "eos" or result.done or result.observation is None:
            row.finish = "stop"
            return
        if row.turns >= cfg.max_turns:
            row.finish = "length"   # it asked for more than max_turns allows
            return
        try:
            ids = self.observation_tokens(result.observation)
        except EnvironmentFailure as exc:
            self._fail(row, str(exc))
            return
        self.stats.env_calls += 1
        if len(row.tokens) + len(ids) >= cfg.max_total_tokens:
            row.finish = "length"   # no room left for the observation and a model turn
            return
        row.append(ids, None, model=False)
