"""Prompt sources (the built-in arithmetic and chain tasks, JSONL files, Hugging Face datasets) and prompt rendering.

Every source yields :class:`Example` rows: the question, the reference data rewards need (``answer``, ``tests``,
...) and a stable id. :class:`PromptStream` draws them in an order private to each generator (seeded by the run
seed and the generator id), so several generators do not all sample the same prompts, and renders each one with
the tokenizer's chat template when it has one.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from generator.tasks.arithmetic import ArithmeticTask
from generator.tasks.arithmetic_words import WordsArithmeticTask
from generator.tasks.chain import ChainTask
from shared.config.schema.generator import DatasetConfig
from shared.errors import UsageError
from shared.registry import Registry

# generator.dataset.kind -> fn(cfg: DatasetConfig, seed: int) -> list[Example]: the built-in tasks, files, Hugging Face
DATASETS: Registry = Registry("dataset kind")

# DeepSeek-R1-Zero style system prompt (DeepSeek-R1, Guo et al. 2025; as in simple_GRPO), the default for math datasets.
R1_SYSTEM_PROMPT = (
    "You are a helpful assistant. A conversation between User and Assistant. The user asks a question, and the "
    "Assistant solves it. The Assistant first thinks about the reasoning process in the mind and then provides "
    "the user with the answer. The reasoning process and answer are enclosed within <think> </think> and "
    "<answer> </answer> tags, respectively, i.e., <think> reasoning process here </think><answer> answer here "
    "</answer>."
)


class DatasetError(UsageError, ValueError):
    """A dataset that cannot be used; the message names the file or dataset and the field."""


@dataclass(frozen=True)
class Example:
    question: str
    data: dict[str, Any] = field(default_factory=dict)  # everything rewards may need, e.g. {"answer": "82"}
    example_id: str = ""


def arithmetic_examples(task: ArithmeticTask, split: str, count: int, seed: int) -> list[Example]:
    """``count`` problems of ``split`` drawn with a fixed seed (the task's space may be far larger)."""
    problems = task.sample(count, split, random.Random(seed))
    return [Example(p.prompt, {"answer": p.answer}, f"arith:{p.prompt}") for p in problems]


def arithmetic_words_examples(task: WordsArithmeticTask, split: str, count: int, seed: int) -> list[Example]:
    """``count`` problems in words of ``split`` drawn with a fixed seed; the operands travel with the answer so the
    ``final_number`` reward can tell working from the operands."""
    problems = task.sample(count, split, random.Random(seed))
    return [Example(p.prompt, {"answer": p.answer, "operands": list(p.operands)}, f"words:{p.prompt}")
            for p in problems]


def chain_examples(task: ChainTask, split: str, count: int, seed: int) -> list[Example]:
    """``count`` chain problems of ``split`` drawn with a fixed seed; the operands and ops travel with the answer,
    so ``chain_steps`` can check each line against the one before it."""
    problems = task.sample(count, split, random.Random(seed))
    return [Example(p.prompt, {"answer": p.answer, "operands": list(p.operands), "ops": list(p.ops)},
                    f"chain:{p.prompt}") for p in problems]


def jsonl_examples(path: str | Path, question_field: str = "question", answer_field: str | None = "answer"
                   ) -> list[Example]:
    """One JSON object per line; ``question_field`` is required, every field is kept for the rewards."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise DatasetError(f"cannot read dataset file {path}: {exc.strerror}") from None
    examples = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        examples.append(_example(row, question_field, answer_field, f"{path.name}:{number}", f"{path}:{number}"))
    if not examples:
        raise DatasetError(f"dataset file {path} holds no examples")
    return examples


def hf_examples(name: str, *, split: str = "train", subset: str | None = None, question_field: str = "question",
                answer_field: str | None = "answer") -> list[Example]:
    """A Hugging Face dataset: a saved folder (``save_to_disk``), or a name/path for ``load_dataset``.

    GSM8K's layout (question / answer with ``#### 42``) is the default. Works offline with local data.
    """
    try:
        import datasets
    except ImportError:
        raise DatasetError("Hugging Face datasets need the 'datasets' package: pip install datasets") from None
    try:
        if Path(name, "dataset_info.json").exists() or Path(name, "dataset_dict.json").exists():
            loaded = datasets.load_from_disk(name)
            table = loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
        else:
            table = datasets.load_dataset(name, subset, split=split)
    except (FileNotFoundError, ValueError, KeyError, ConnectionError) as exc:
        raise DatasetError(f"cannot load dataset {name!r} (split {split!r}): {exc}") from None
    return [_example(dict(row), question_field, answer_field, f"{name}:{split}:{i}", f"{name}[{i}]")
            for i, row in enumerate(table)]


def _example(row: Any, question_field: str, answer_field: str | None, example_id: str, where: str) -> Example:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if question_field not in row:
        raise DatasetError(f"{where}: no {question_field!r} field (fields: {sorted(row)})")
    if answer_field is not None and answer_field not in row:
        raise DatasetError(f"{where}: no {answer_field!r} field (fields: {sorted(row)})")
    data = dict(row)
    if answer_field is not None and answer_field != "answer":
        data["answer"] = row[answer_field]
    return Example(str(row[question_field]), data, example_id)


def load_examples(cfg: DatasetConfig, seed: int) -> list[Example]:
    """The examples a dataset config names (the built-in tasks draw ``arithmetic_pool`` of them with ``seed``)."""
    return DATASETS.get(cfg.kind)(cfg, seed)


@DATASETS.register("arithmetic")
def _arithmetic(cfg: DatasetConfig, seed: int) -> list[Example]:
    """The built-in task: ``23+58=`` -> ``81`` (generator/tasks/arithmetic.py)."""
    return arithmetic_examples(ArithmeticTask(**cfg.arithmetic), cfg.split, cfg.arithmetic_pool, seed)


@DATASETS.register("arithmetic_words")
def _arithmetic_words(cfg: DatasetConfig, seed: int) -> list[Example]:
    """The built-in task in words for chat models (generator/tasks/arithmetic_words.py)."""
    return arithmetic_words_examples(WordsArithmeticTask(**cfg.arithmetic), cfg.split, cfg.arithmetic_pool, seed)


@DATASETS.register("chain")
def _chain(cfg: DatasetConfig, seed: int) -> list[Example]:
    """The built-in multi-step task, one running total per line (generator/tasks/chain.py)."""
    return chain_examples(ChainTask(**cfg.chain.model_dump()), cfg.split, cfg.arithmetic_pool, seed)


@DATASETS.register("jsonl")
def _jsonl(cfg: DatasetConfig, seed: int) -> list[Example]:
    """A JSONL file, one example per line."""
    return jsonl_examples(cfg.path, cfg.question_field, cfg.answer_field)


@DATASETS.register("hf")
def _hf(cfg: DatasetConfig, seed: int) -> list[Example]:
    """A Hugging Face dataset: a name for load_dataset or a save_to_disk folder."""
    return hf_examples(cfg.path, split=cfg.split, subset=cfg.subset, question_field=cfg.question_field,
                       answer_field=cfg.answer_field)


def render_prompt(tokenizer, question: str, system_prompt: str | None, template: str | None = None,
                  tools: list[dict] | None = None) -> str:
    """The text the model continues.

    * ``template`` given: ``template.format(question=..., system=...)`` (no chat template is applied);
    * else, a tokenizer with a chat template: system + user messages, with the generation prompt (and ``tools``,
      the JSON schemas of a tool-calling environment: generator/environments/tool_chat.py);
    * else: the question itself (after the system prompt and a newline, if there is one).
    """
    if tools:
        if template is not None or not getattr(tokenizer, "chat_template", None):
            raise UsageError("generator.environment: tool calling renders the prompt with the tokenizer's chat "
                             "template; set generator.dataset.template to null and use a chat model")
        from generator.environments.tool_chat import render_tool_prompt

        return render_tool_prompt(tokenizer, question, system_prompt, tools)
    if template is not None:
        return template.format(question=question, system=system_prompt or "")
    if getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
        messages.append({"role": "user", "content": question})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"{system_prompt}\n{question}" if system_prompt else question


class PromptStream:
    """Endless draws from ``examples``: reshuffled every epoch with a per-generator seed."""

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
