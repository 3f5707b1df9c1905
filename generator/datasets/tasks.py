"""The built-in tasks as prompt sources: ``arithmetic``, ``arithmetic_words`` and ``chain`` (generator/tasks/)."""

from __future__ import annotations

import random

from generator.datasets.base import DATASETS, Example, dataset_kind
from generator.tasks.arithmetic import ArithmeticTask
from generator.tasks.arithmetic_words import WordsArithmeticTask
from generator.tasks.chain import ChainTask
from shared.config.schema.generator import DatasetConfig


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


@DATASETS.register("arithmetic")
@dataset_kind(system_prompt=None)   # the answer is the bare number the prompt asks for
def _arithmetic(cfg: DatasetConfig, seed: int) -> list[Example]:
    """The built-in task: ``23+58=`` -> ``81`` (generator/tasks/arithmetic.py)."""
    return arithmetic_examples(ArithmeticTask(**cfg.arithmetic), cfg.split, cfg.arithmetic_pool, seed)


@DATASETS.register("arithmetic_words")
@dataset_kind(system_prompt=None)   # the answer is the bare number the prompt asks for
def _arithmetic_words(cfg: DatasetConfig, seed: int) -> list[Example]:
    """The built-in task in words for chat models (generator/tasks/arithmetic_words.py)."""
    return arithmetic_words_examples(WordsArithmeticTask(**cfg.arithmetic), cfg.split, cfg.arithmetic_pool, seed)


@DATASETS.register("chain")
@dataset_kind(system_prompt=None)   # the answer is the bare number the prompt asks for
def _chain(cfg: DatasetConfig, seed: int) -> list[Example]:
    """The built-in multi-step task, one running total per line (generator/tasks/chain.py)."""
    return chain_examples(ChainTask(**cfg.chain.model_dump()), cfg.split, cfg.arithmetic_pool, seed)
