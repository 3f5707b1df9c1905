"""What :func:`grpo_stack.train` takes besides the config: reward functions as Python callables, and datasets as
``datasets.Dataset`` objects, lists of dicts or paths. Each becomes what a YAML config would name.

A callable reward is registered in :data:`REGISTERED`, a table of this module, and named in the config as the
python reward's function ``grpo_stack.inputs:REGISTERED.<key>`` (shared/user_code.py loads dotted attributes). The
generators forked from the calling process (deploy/forked.py) hold the table as it was when they were forked; a
generator started as a fresh process, or on another node, has an empty table and stops at start-up with
:class:`UnreachableReward`'s message, never a bare AttributeError.

A dataset is written into the run's folder (``run_dir/data/``): a list of dicts as JSONL (dataset kind jsonl), a
``datasets.Dataset`` with ``save_to_disk`` (kind hf); a path is named as it is.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from shared.errors import UsageError

SPEC_PREFIX = "grpo_stack.inputs:REGISTERED."
_keys = itertools.count()


class UnreachableReward(UsageError):
    """A reward function registered by grpo_stack.train() in another process: this one cannot call it."""


class _Registered:
    """The callables :func:`reward_specs` registered, as attributes; an unknown name is an error that says why."""

    def __getattr__(self, key: str) -> Callable:
        raise UnreachableReward(
            f"reward function {SPEC_PREFIX}{key} was passed to grpo_stack.train() as a Python callable in another "
            "process; a generator started as its own process (another node, a GPU or vLLM generator, "
            "run.fork_services false) cannot reach it: name the function in the config instead, e.g. "
            "{name: python, args: {function: 'my_rewards.py:score'}} (docs/python-api.md)")


REGISTERED = _Registered()


def _identifier(name: str) -> str:
    return re.sub(r"\W", "_", name).strip("_") or "reward"


def reward_specs(reward_funcs: Any) -> list[dict[str, Any]]:
    """``generator.rewards`` entries for ``reward_funcs``: one callable or a list of callables and reward entries
    (dicts, as in a config); each callable registered in :data:`REGISTERED` and labelled with its ``__name__``
    (the metrics' name; ``name_2`` for a second one of that name)."""
    items = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    specs: list[dict[str, Any]] = []
    labels: set[str] = set()
    for i, item in enumerate(items):
        if isinstance(item, dict):
            specs.append(dict(item))
            labels.add(item.get("label") or item.get("name", ""))
            continue
        if not callable(item):
            raise UsageError(f"reward_funcs[{i}]: expected a callable or a reward entry (a dict such as "
                             f"{{'name': 'format'}}), got {type(item).__name__}")
        base = label = _identifier(getattr(item, "__name__", "reward"))
        for n in itertools.count(2):
            if label not in labels:
                break
            label = f"{base}_{n}"
        labels.add(label)
        key = f"{label}_{next(_keys)}"
        object.__setattr__(REGISTERED, key, item)
        specs.append({"name": "python", "label": label, "args": {"function": SPEC_PREFIX + key}})
    return specs


def has_callables(specs: Sequence[dict[str, Any]]) -> bool:
    return any(str(spec.get("args", {}).get("function", "")).startswith(SPEC_PREFIX) for spec in specs)


def write_dataset(data: Any, folder: Path, name: str, kind: str | None = None) -> tuple[str, str]:
    """``(dataset kind, path)`` naming ``data`` (the argument ``name``): a path as it is (``.jsonl``: kind jsonl,
    else hf), a list of dicts or a ``datasets.Dataset`` written to ``folder/name.jsonl`` (kind jsonl) or the
    ``save_to_disk`` folder ``folder/name`` (kind hf). ``kind`` forces one (an evaluation set is written in its
    training set's kind, which is what ``eval.path`` reads)."""
    if isinstance(data, (str, Path)):
        path = Path(data)
        if not path.exists():
            raise UsageError(f"{name}: no such file or folder {path}")
        found = "jsonl" if path.suffix == ".jsonl" else "hf"
        if kind is not None and found != kind:
            raise UsageError(f"{name}: {path} is read as dataset kind {found}, but the training dataset is kind "
                             f"{kind}; give both as files of one kind (or as lists of dicts / Datasets)")
        return found, str(path)
    _check_rows(data, name)
    kind = kind or ("jsonl" if isinstance(data, list) else "hf")
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "jsonl":
        path = folder / f"{name}.jsonl"
        rows = data if isinstance(data, list) else data.to_list()
        path.write_text("".join(_json_line(row, name, i) for i, row in enumerate(rows)))
        return kind, str(path)
    import datasets

    table = datasets.Dataset.from_list(data) if isinstance(data, list) else data
    table.save_to_disk(str(folder / name))
    return kind, str(folder / name)


def _check_rows(data: Any, name: str) -> None:
    """A UsageError naming ``name`` unless ``data`` is a non-empty list of dicts or a ``datasets.Dataset``."""
    if isinstance(data, list):
        bad = next((i for i, row in enumerate(data) if not isinstance(row, dict)), None)
        if bad is not None:
            raise UsageError(f"{name}[{bad}]: expected a dict (one example's fields), got {type(data[bad]).__name__}")
        if not data:
            raise UsageError(f"{name}: the list is empty")
        return
    kind = f"{type(data).__module__}.{type(data).__name__}"
    if kind == "datasets.dataset_dict.DatasetDict":
        raise UsageError(f"{name}: a DatasetDict holds several splits ({', '.join(data)}); pass one, e.g. "
                         f"dataset[{next(iter(data))!r}]")
    if kind != "datasets.arrow_dataset.Dataset":
        raise UsageError(f"{name}: expected a datasets.Dataset, a list of dicts or a path, got {kind}")


def _json_line(row: dict[str, Any], name: str, index: int) -> str:
    try:
        return json.dumps(row) + "\n"
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{name}[{index}]: cannot be written as JSON ({exc})") from None
