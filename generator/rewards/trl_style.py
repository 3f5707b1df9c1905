"""TRL's reward signature, for ``reward: python``: a function written for TRL's ``GRPOTrainer`` runs unchanged.

TRL calls a reward function once per batch as ``fn(prompts=[...], completions=[...], completion_ids=[...],
**columns) -> list[float | None]``, every dataset column passed as a keyword list aligned with the completions.
Here it is called once per group (the G completions of one prompt): ``prompts`` is the prompt repeated G times,
``completions`` the G texts, ``completion_ids`` their token ids, and every field of the example (the dataset row)
a list of G copies of its value. ``None`` in the result means "not applicable to this completion" (TRL: NaN, then
``nansum`` over the rewards): that completion gets no value from this reward, and it is no failure.

Conversational datasets (an example whose ``prompt_messages`` is a list of chat messages): ``prompts`` is that
message list, repeated, and each completion is ``[{"role": "assistant", "content": text}]``, as TRL passes them.
``conversational: true`` in the reward's args forces that form on plain-string prompts (``prompts`` then
``[{"role": "user", "content": prompt}]``): TRL's shipped rewards (``trl.rewards``) read ``completion[0]["content"]``.

TRL also passes ``trainer_state`` (its TrainerState: ``global_step``, ``max_steps``, for shaping that follows training
progress) and ``log_metric(name, value)``; here ``trainer_state`` is a :class:`TrainerState` whose ``global_step`` is
the policy version that the generator serves (the learner step whose weights sampled the group) and ``max_steps`` is
``learner.max_steps``, and ``log_metric`` values are averaged per name in the generator's progress and closing lines.
TRL's ``log_extra`` (extra columns of its completions table) has no table to go to here and is not passed. An
``async def`` reward is awaited (one event loop per call, as TRL gathers them).

Which style a python reward is (:func:`reward_style`): ``style: trl`` or ``style: simple`` in its args wins;
``per_group: true`` is the simple style's group form (as before); otherwise a function that names none of the
simple style's parameters (``prompt``, ``completion``, ``example``) and at least one of TRL's (``prompts``,
``completions``, ``completion_ids``) is TRL-style, anything else simple.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from generator.rewards.base import with_token_ids
from shared.errors import UsageError

STYLES = ("auto", "simple", "trl")
# what TRL passes beside the columns; not dataset columns (the ``context`` a RewardSet gives each TRL-style term)
CONTEXT_NAMES = frozenset({"trainer_state", "log_metric"})
TRL_CONTRACT = "fn(prompts: list, completions: list, completion_ids: list, **columns) -> list[float | None]"
SIMPLE_NAMES = frozenset({"prompt", "completion", "example"})
TRL_NAMES = frozenset({"prompts", "completions", "completion_ids"})
# keys of the example that are not dataset columns passed to the function (TRL leaves out prompt and completion too)
NOT_COLUMNS = frozenset({"prompt", "completion", "prompt_messages"}) | TRL_NAMES | CONTEXT_NAMES


class TrainerState:
    """What a TRL-style reward reads as ``trainer_state``: the training progress as the generator knows it."""

    def __init__(self, global_step: int = 0, max_steps: int | None = None) -> None:
        self.global_step = global_step   # the policy version served: the learner step whose weights sample
        self.max_steps = max_steps       # learner.max_steps (None: not known, e.g. `grpo eval`)


class LoggedMetrics:
    """``log_metric(name, value)`` of TRL-style rewards: a running sum and count per name (thread-safe)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, name: str, value: float) -> None:
        value = float(value)
        with self._lock:
            self.sums[str(name)] = self.sums.get(str(name), 0.0) + value
            self.counts[str(name)] = self.counts.get(str(name), 0) + 1

    def means(self) -> dict[str, float]:
        with self._lock:
            return {k: self.sums[k] / self.counts[k] for k in self.sums}


class RewardContext:
    """Beside the columns, what every TRL-style term of one RewardSet is given: ``trainer_state`` and
    ``log_metric``."""

    def __init__(self, max_steps: int | None = None) -> None:
        self.trainer_state = TrainerState(max_steps=max_steps)
        self.log_metric = LoggedMetrics()

    def keywords(self) -> dict[str, Any]:
        return {"trainer_state": self.trainer_state, "log_metric": self.log_metric}


def _parameters(fn: Any) -> dict[str, inspect.Parameter] | None:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None   # a builtin without a signature: simple, as before


def reward_style(fn: Any, style: str, key: str) -> str:
    """``"trl"`` or ``"simple"``: ``style`` when it is one of them, else from ``fn``'s parameter names (the module
    docstring); a UsageError naming ``key`` for an unknown style."""
    if style not in STYLES:
        raise UsageError(f"{key}: unknown style {style!r}; known styles: {', '.join(STYLES)}")
    if style != "auto":
        return style
    params = _parameters(fn)
    if params is None or SIMPLE_NAMES & params.keys():
        return "simple"
    return "trl" if TRL_NAMES & params.keys() else "simple"


def _takes_any_keyword(params: dict[str, inspect.Parameter]) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in params.values())


def _keywords(params: dict[str, inspect.Parameter]) -> set[str]:
    return {name for name, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def check_trl_function(fn: Any, key: str, args: dict[str, Any]) -> None:
    """At build time: ``fn`` is callable and takes the reward's config ``args`` (the dataset's columns are only
    known per example: a missing one is a failure of that group, named)."""
    if not callable(fn):
        raise UsageError(f"{key}: {fn!r} is not callable; expected {TRL_CONTRACT}")
    params = _parameters(fn)
    if params is None or _takes_any_keyword(params):
        return
    unknown = sorted(set(args) - _keywords(params))
    if unknown:
        raise UsageError(f"{key}: {getattr(fn, '__qualname__', fn)}{inspect.signature(fn)} takes no argument "
                         f"{unknown[0]!r} (from the reward's args); expected {TRL_CONTRACT}")


def as_messages(prompt: str, completions: Sequence[str], example: dict[str, Any],
                conversational: bool | None) -> tuple[list[Any], list[Any]]:
    """``(prompts, completions)`` as TRL passes them: strings, or chat messages for a conversational example
    (``conversational`` None: when the example carries ``prompt_messages``; True/False forces it)."""
    messages = example.get("prompt_messages")
    chat = isinstance(messages, list) if conversational is None else conversational
    n = len(completions)
    if not chat:
        return [prompt] * n, list(completions)
    if not isinstance(messages, list):
        messages = [{"role": "user", "content": prompt}]
    return [messages] * n, [[{"role": "assistant", "content": text}] for text in completions]


def trl_group_reward(fn: Callable[..., Any], args: dict[str, Any], conversational: bool | None):
    """A group reward calling ``fn`` once per group, TRL's way (the module docstring). Its ``takes_token_ids``
    attribute tells :class:`~generator.rewards.reward_set.RewardSet` to pass ``completion_ids`` and to take
    ``None`` as "not applicable"."""
    params = _parameters(fn)
    named = None if params is None or _takes_any_keyword(params) else _keywords(params)
    required = set() if params is None else {
        name for name, p in params.items()
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

    def group(prompt: str, completions: Sequence[str], example: dict[str, Any],
              completion_ids: Sequence[Sequence[int]] | None = None) -> list[Any]:
        n = len(completions)
        prompts, texts = as_messages(prompt, completions, example, conversational)
        columns = {k: [v] * n for k, v in example.items() if k not in NOT_COLUMNS}
        given = {**columns, "prompts": prompts, "completions": texts,
                 "completion_ids": None if completion_ids is None else [list(ids) for ids in completion_ids],
                 **group.context.keywords(), **args}
        missing = sorted(required - given.keys())
        if missing:
            raise ValueError(f"{getattr(fn, '__name__', 'the function')} needs the column {missing[0]!r}, which the "
                             f"example does not have (columns: {sorted(columns)})")
        if named is not None:   # no **kwargs: only what it names
            given = {k: v for k, v in given.items() if k in named}
        values = fn(**given)
        if inspect.iscoroutine(values):   # an async def reward (TRL awaits them too)
            values = asyncio.run(values)
        if isinstance(values, (str, bytes, dict)) or not isinstance(values, Iterable):   # TRL iterates it too
            raise TypeError(f"returned {type(values).__name__}, not a list of {n} numbers or None")
        return list(values)

    group.__name__ = getattr(fn, "__name__", "python")
    group.context = RewardContext()   # the RewardSet gives its own (shared by its terms, updated by the loop)
    return with_token_ids(group)
