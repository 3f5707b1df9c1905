"""What every prompt source gives: :class:`Example` rows (built from a dataset's rows by :func:`example_from_row`),
the ``DATASETS`` registry of sources, and :class:`PromptStream`, the order a generator draws them in."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.config.schema.generator import DatasetConfig
from shared.errors import UsageError
from shared.registry import Registry

# generator.dataset.kind -> fn(cfg: DatasetConfig, seed: int) -> list[Example]: the built-in tasks, files, Hugging Face,
# reasoning-gym, a verifiers environment's rows; each entry declares its traits (dataset_kind: the default system prompt, held-out examples)
DATASETS: Registry = Registry("dataset kind", modules=("generator.datasets.tasks", "generator.datasets.files",
                                                    "generator.datasets.reasoning_gym_tasks",
                                                    "generator.datasets.verifiers"))

# TRL's conversational format: the roles a prompt message may have
MESSAGE_ROLES = ("system", "user", "assistant", "tool")
# TRL's standard format names the question column ``prompt``: read when the default question column is absent
TRL_PROMPT_COLUMN = "prompt"
DEFAULT_QUESTION_FIELD = "question"


class DatasetError(UsageError, ValueError):
    """A dataset that cannot be used; the message names the file or dataset and the field."""


@dataclass(frozen=True)
class Example:
    question: str   # the prompt text (conversational: the last user message's content)
    data: dict[str, Any] = field(default_factory=dict)  # everything rewards may need, e.g. {"answer": "82"}
    example_id: str = ""
    # TRL's conversational format: the prompt's messages as given (rendered with the chat template); None for a
    # string prompt. The same list is in ``data["prompt_messages"]``, where rewards read it.
    prompt_messages: list[dict] | None = None


@dataclass(frozen=True)
class DatasetKind:
    """What code outside a kind's loader knows of the kind (the prompts' system prompt, how ``grpo eval`` finds and
    names its held-out examples), declared where the kind is registered (:func:`dataset_kind`), so that a new kind
    is one entry, not also a line in each table of kinds."""

    # the system prompt the kind's prompts get when generator.dataset.system_prompt is not set (None: none)
    system_prompt: str | None = None
    # a kind that reads generator.dataset.path: eval.path checked -> the evaluation dataset config's changes;
    # None: the kind's examples come from its settings, eval.path does not apply
    eval_path: Callable[[DatasetConfig, str], dict] | None = None
    # False: the source has no held-out part (a training file): grpo eval needs eval.path
    heldout_split: bool = True
    # what grpo eval says it evaluates: (the evaluation dataset, count, the training dataset) -> text
    describe: Callable[[DatasetConfig, int, DatasetConfig], str] | None = None


def dataset_kind(**traits: Any) -> Callable[[Callable], Callable]:
    """``@dataset_kind(system_prompt=..., ...)`` under ``@DATASETS.register(kind)``: the kind's
    :class:`DatasetKind`, read back by :func:`kind_traits`."""
    declared = DatasetKind(**traits)

    def declare(fn: Callable) -> Callable:
        fn.traits = declared
        return fn
    return declare


def kind_traits(kind: str) -> DatasetKind:
    """The :class:`DatasetKind` a registered kind declared (a kind registered without one: the defaults)."""
    return getattr(DATASETS.get(kind), "traits", DatasetKind())


def path_kinds() -> list[str]:
    """The kinds that read generator.dataset.path (so eval.path applies to them), for messages."""
    return [name for name in DATASETS.names() if kind_traits(name).eval_path is not None]


def system_prompt_for(cfg: DatasetConfig) -> str | None:
    """generator.dataset.system_prompt ('' for none), else the default its kind declares."""
    if cfg.system_prompt is not None:
        return cfg.system_prompt or None
    return kind_traits(cfg.kind).system_prompt


def load_examples(cfg: DatasetConfig, seed: int) -> list[Example]:
    """The examples a dataset config names (the built-in tasks draw ``arithmetic_pool`` of them with ``seed``)."""
    examples = DATASETS.get(cfg.kind)(cfg, seed)
    if cfg.template is not None:
        conversational = next((e for e in examples if e.prompt_messages is not None), None)
        if conversational is not None:
            raise DatasetError(f"{conversational.example_id}: a conversational prompt (a list of messages) is "
                               "rendered with the chat template; generator.dataset.template applies to string "
                               "prompts only: set it to null")
    return examples


def prompt_messages(value: list, where: str) -> list[dict]:
    """``value`` checked as TRL's conversational prompt: a non-empty list of ``{"role", "content"}`` messages with a
    role in :data:`MESSAGE_ROLES`, string content and at least one user message. Keys with a null value (columns
    Arrow adds to every message of a list when some message has them) are dropped; other keys are kept."""
    if not value:
        raise DatasetError(f"{where}: the prompt is an empty list of messages")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise DatasetError(f"{where}: prompt message {i} is a {type(message).__name__}, not a "
                               "{'role': ..., 'content': ...} object")
        role, content = message.get("role"), message.get("content")
        if role not in MESSAGE_ROLES:
            raise DatasetError(f"{where}: prompt message {i} has role {role!r}; a role is one of {list(MESSAGE_ROLES)}")
        if not isinstance(content, str):
            raise DatasetError(f"{where}: prompt message {i} ({role}) has content of type {type(content).__name__}, "
                               "not a string")
        messages.append({k: v for k, v in message.items() if v is not None})
    if not any(m["role"] == "user" for m in messages):
        raise DatasetError(f"{where}: the prompt's messages have no user message (roles: "
                           f"{[m['role'] for m in messages]})")
    return messages


def renamed_columns(row: dict, columns: Mapping[str, str], where: str) -> dict:
    """``row`` with each ``dataset column -> our name`` of ``columns`` renamed (generator.dataset.columns)."""
    if not columns:
        return row
    for source, target in columns.items():
        if source not in row:
            raise DatasetError(f"{where}: no {source!r} column to rename to {target!r} (generator.dataset.columns; "
                               f"columns: {sorted(row)})")
        if target in row and target not in columns:
            raise DatasetError(f"{where}: generator.dataset.columns renames {source!r} to {target!r}, which the "
                               "row already has")
    renamed = {k: v for k, v in row.items() if k not in columns}
    renamed.update({target: row[source] for source, target in columns.items()})
    return renamed


def example_from_row(row: Any, question_field: str, answer_field: str | None, example_id: str, where: str,
                     columns: Mapping[str, str] | None = None) -> Example:
    """One dataset row as an :class:`Example`; every column stays in its data (rewards receive them all).

    The question is ``question_field``'s value; with the default ``question`` and a row without it, TRL's ``prompt``
    column. A string is the question; a list is TRL's conversational format (:func:`prompt_messages`)."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
    row = renamed_columns(row, columns or {}, where)
    if question_field not in row and question_field == DEFAULT_QUESTION_FIELD and TRL_PROMPT_COLUMN in row:
        question_field = TRL_PROMPT_COLUMN
    if question_field not in row:
        raise DatasetError(f"{where}: no {question_field!r} field (fields: {sorted(row)})")
    if answer_field is not None and answer_field not in row:
        raise DatasetError(f"{where}: no {answer_field!r} field (fields: {sorted(row)}; a dataset without reference "
                           "answers: generator.dataset.answer_field null; another column: answer_field or columns)")
    data = dict(row)
    if answer_field is not None and answer_field != "answer":
        data["answer"] = row[answer_field]
    value = row[question_field]
    if isinstance(value, (list, tuple)):
        messages = prompt_messages(list(value), where)
        data["prompt_messages"] = messages
        question = next(m["content"] for m in reversed(messages) if m["role"] == "user")
        return Example(question, data, example_id, messages)
    return Example(str(value), data, example_id)


class PromptStream:
    """Endless draws from ``examples``: reshuffled every epoch with a per-generator seed."""

    skipped = 0   # draws passed over: none here (the curriculum's stream counts its own)

    def __init__(self, examples: list[Example], *, seed: int, generator_id: str) -> None:
        if not examples:
            raise DatasetError("no examples to draw prompts from")
        self.examples = examples
        # a string seed is hashed deterministically by random.Random (not Python's salted hash())
        self._rng = random.Random(f"{seed}/{generator_id}")
        self._order: list[int] = []
        self.epoch = 0

    def __iter__(self) -> Iterator[Example]:
        return self

    def __next__(self) -> Example:
        if not self._order:
            self._order = list(range(len(self.examples)))
            self._rng.shuffle(self._order)
            self.epoch += 1
        return self.examples[self._order.pop()]

    def take(self, n: int) -> list[Example]:
        return [next(self) for _ in range(n)]

    def observe(self, example: Example, totals: list[float]) -> None:
        """A scored group of ``example`` (its total rewards): a plain stream draws regardless (the curriculum's
        :class:`generator.curriculum.CurriculumStream` records it)."""
