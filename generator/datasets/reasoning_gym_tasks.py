"""``dataset.kind: reasoning_gym``: reasoning-gym's procedural tasks (an optional extra) as prompt sources.

Split ``train`` is the ``args.size`` items of ``args.seed``, split ``test`` the ``args.eval_size`` items of
``args.eval_seed`` (disjoint: shared/config/schema/reasoning_gym.py). Each example keeps the item's ``answer`` and
``metadata`` (whose ``source_dataset`` names the task) and the task's settings, which is what the ``reasoning_gym``
reward (generator/rewards/reasoning_gym_reward.py) scores with, through the task's own ``score_answer``.
"""

from __future__ import annotations

import difflib
import functools
import json
from typing import Any

from generator.datasets.base import DATASETS, DatasetError, Example, dataset_kind
from generator.datasets.render import REASONING_GYM_SYSTEM_PROMPT
from shared.config.schema.generator import DatasetConfig
from shared.config.schema.reasoning_gym import ReasoningGymArgs, reasoning_gym_args

PACKAGE_PIN = "reasoning-gym==0.1.25"
INSTALL = f"pip install 'grpo-stack[reasoning-gym]' (or pip install {PACKAGE_PIN})"
# the example field holding the task's settings (a task's score_answer may read them); the task is the item's own
# metadata.source_dataset, so rows exported from reasoning-gym (a JSONL file) score too
CONFIG_FIELD = "reasoning_gym_config"


def require_reasoning_gym(who: str = "generator.dataset.kind 'reasoning_gym'"):
    """The ``reasoning_gym`` module, or a :class:`DatasetError` saying what to install."""
    try:
        import reasoning_gym
    except ImportError as exc:
        raise DatasetError(f"{who} needs the reasoning-gym package, which is not installed here ({exc}): "
                           f"{INSTALL}") from None
    return reasoning_gym


def task_names() -> list[str]:
    """The procedural tasks reasoning-gym registers (its ``composite`` is a mix: a list or weights here)."""
    from reasoning_gym.factory import DATASETS as TASKS

    return sorted(name for name in TASKS if name != "composite")


def check_task(name: str) -> None:
    """A :class:`DatasetError` naming the close task names when ``name`` is no reasoning-gym task."""
    known = task_names()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
        hint = f"close names: {', '.join(close)}" if close else f"the {len(known)} tasks: {', '.join(known)}"
        raise DatasetError(f"generator.dataset.args.task: {name!r} is no reasoning-gym task; {hint}")


@functools.lru_cache(maxsize=64)
def _task(name: str, settings_json: str, seed: int, size: int):
    reasoning_gym = require_reasoning_gym()
    check_task(name)
    try:
        return reasoning_gym.create_dataset(name, **json.loads(settings_json), seed=seed, size=size)
    except (TypeError, ValueError, AssertionError, KeyError) as exc:
        raise DatasetError(f"generator.dataset.args.config: reasoning-gym task {name!r} refuses its settings "
                           f"{settings_json}: {type(exc).__name__}: {exc}") from None


def task_dataset(name: str, settings: dict[str, Any], seed: int = 0, size: int = 1):
    """reasoning-gym's dataset of task ``name`` with ``settings`` (cached: the reward asks once per completion)."""
    return _task(name, json.dumps(settings, sort_keys=True), seed, size)


def _items(args: ReasoningGymArgs, seed: int, size: int) -> list[dict[str, Any]]:
    weights = args.weights()
    if len(weights) == 1:
        name = next(iter(weights))
        return list(task_dataset(name, args.task_config(name), seed, size))
    reasoning_gym = require_reasoning_gym()
    for name in weights:
        check_task(name)
        task_dataset(name, args.task_config(name))   # its settings checked, with the task named
    from reasoning_gym.composite import DatasetSpec

    specs = [DatasetSpec(name, weight, args.task_config(name)) for name, weight in weights.items()]
    return list(reasoning_gym.create_dataset("composite", datasets=specs, seed=seed, size=size))


def reasoning_gym_examples(args: ReasoningGymArgs, split: str) -> list[Example]:
    """The examples of ``split``: item ``i`` of the split's seed, its question, answer, metadata and settings."""
    require_reasoning_gym()   # first: a dataset cached before the package went missing would hide it
    seed, size = args.seed_and_size(split)
    examples = []
    for i, item in enumerate(_items(args, seed, size)):
        task = item["metadata"]["source_dataset"]
        data = {"answer": item["answer"], "metadata": item["metadata"], CONFIG_FIELD: args.task_config(task)}
        examples.append(Example(item["question"], data, f"rg:{task}:{seed}+{i}"))
    return examples


def _describe(dataset: DatasetConfig, count: int, training: DatasetConfig) -> str:
    args = reasoning_gym_args(dataset.args)
    seed, _ = args.seed_and_size(dataset.split)
    return f"{count} examples of reasoning-gym {', '.join(args.weights())}, split {dataset.split!r} (seeds from {seed})"


@DATASETS.register("reasoning_gym")
@dataset_kind(system_prompt=REASONING_GYM_SYSTEM_PROMPT, describe=_describe)
def _reasoning_gym(cfg: DatasetConfig, seed: int) -> list[Example]:
    """reasoning-gym's procedural tasks (pip install 'grpo-stack[reasoning-gym]'), split by seed."""
    return reasoning_gym_examples(reasoning_gym_args(cfg.args), cfg.split)
