"""Prompt sources (the built-in arithmetic and chain tasks, JSONL files, Hugging Face datasets,
reasoning-gym's tasks) and prompt rendering.

Every source yields :class:`Example` rows: the question (or TRL's conversational prompt, a list of messages), the
reference data rewards need (``answer``, ``tests``, ... every column of the dataset) and a stable id.
:class:`PromptStream` draws them in an order private to each generator (seeded by the run seed and the generator
id), so several generators do not all sample the same prompts, and :func:`render_example` renders each one (with
the tokenizer's chat template when it has one).

The package, by concept:

* :mod:`generator.datasets.base`: :class:`Example`, a row as an example (column mapping, TRL's formats), the
  ``DATASETS`` registry of sources (``generator.dataset.kind``), :class:`PromptStream`;
* :mod:`generator.datasets.tasks`: the built-in tasks;
* :mod:`generator.datasets.files`: ``jsonl`` and ``hf`` (any local file or folder ``datasets`` reads, offline);
* :mod:`generator.datasets.reasoning_gym_tasks`: ``reasoning_gym`` (reasoning-gym's procedural tasks, an extra);
* :mod:`generator.datasets.render`: the prompt text.
"""

from __future__ import annotations

from generator.datasets.base import (
    DATASETS,
    MESSAGE_ROLES,
    DatasetError,
    DatasetKind,
    Example,
    PromptStream,
    dataset_kind,
    example_from_row,
    kind_traits,
    load_examples,
    path_kinds,
    prompt_messages,
    system_prompt_for,
)
from generator.datasets.files import (
    DATA_FILE_BUILDERS,
    FILE_SPLIT,
    has_one_split,
    hf_examples,
    hf_table,
    jsonl_examples,
    looks_local,
)
from generator.datasets.render import (
    R1_SYSTEM_PROMPT,
    REASONING_GYM_SYSTEM_PROMPT,
    render_example,
    render_messages,
    render_prompt,
)
from generator.datasets.tasks import arithmetic_examples, arithmetic_words_examples, chain_examples

__all__ = ["DATASETS", "DATA_FILE_BUILDERS", "FILE_SPLIT", "MESSAGE_ROLES", "R1_SYSTEM_PROMPT",
           "REASONING_GYM_SYSTEM_PROMPT", "DatasetError",
           "Example", "PromptStream", "arithmetic_examples", "arithmetic_words_examples", "chain_examples",
           "DatasetKind", "dataset_kind", "kind_traits", "path_kinds",
           "example_from_row", "has_one_split", "hf_examples", "hf_table", "jsonl_examples", "load_examples",
           "looks_local", "prompt_messages", "render_example", "render_messages", "render_prompt", "system_prompt_for"]
