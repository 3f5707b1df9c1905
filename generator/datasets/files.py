"""Datasets from files: ``jsonl`` (read here, errors by line) and ``hf`` (through Hugging Face ``datasets``).

``hf`` reads, offline always (local paths and the local ``datasets`` cache; nothing reaches the network):

* a data file by its extension (:data:`DATA_FILE_BUILDERS`: JSON lines, JSON, CSV, Parquet, Arrow), whose one
  split is ``train``;
* a folder ``save_to_disk`` wrote (a Dataset, whose one split is ``train``, or a DatasetDict);
* a folder of data files (``datasets`` names the splits after the files: ``train.jsonl``, ``test.jsonl``);
* a dataset name (``gsm8k`` with subset ``main``) that ``load_dataset`` has cached on this machine.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path

from generator.datasets.base import DATASETS, DatasetError, Example, dataset_kind, example_from_row
from generator.datasets.render import R1_SYSTEM_PROMPT
from shared.config.schema.generator import DatasetConfig

# a data file's extension -> the ``datasets`` builder that reads it
DATA_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
FILE_SPLIT = "train"   # what ``datasets`` calls the one split of a file (and of a saved Dataset)


def jsonl_examples(path: str | Path, question_field: str = "question", answer_field: str | None = "answer",
                   columns: Mapping[str, str] | None = None) -> list[Example]:
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
        examples.append(example_from_row(row, question_field, answer_field, f"{path.name}:{number}",
                                         f"{path}:{number}", columns))
    if not examples:
        raise DatasetError(f"dataset file {path} holds no examples")
    return examples


@contextlib.contextmanager
def _offline(datasets) -> Iterator[None]:
    """``datasets`` kept off the network (its HF_DATASETS_OFFLINE, read once at its import) while loading."""
    before = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = before


def _one_split(name: str, split: str, what: str) -> None:
    if split != FILE_SPLIT:
        raise DatasetError(f"dataset {name} is {what}, whose one split is {FILE_SPLIT!r}, not {split!r}: give "
                           "another file or folder for other rows (eval.path for evaluation)")


def looks_local(name: str) -> bool:
    """Whether ``name`` is meant as a local path (a data file's extension, or a path from / . ~), not a dataset name:
    missing, it is reported as a missing file."""
    return Path(name).suffix.lower() in DATA_FILE_BUILDERS or name.startswith(("/", ".", "~"))


def has_one_split(name: str) -> bool:
    """Whether ``name`` is a data file or a ``save_to_disk`` Dataset (not a DatasetDict): one split, ``train``."""
    path = Path(name).expanduser()
    return path.is_file() or ((path / "dataset_info.json").exists() and not (path / "dataset_dict.json").exists())


def hf_table(name: str, split: str = "train", subset: str | None = None):
    """The ``datasets.Dataset`` of ``split`` that ``name`` (a file, a folder or a cached dataset name) holds."""
    try:
        import datasets
    except ImportError:
        raise DatasetError("Hugging Face datasets need the 'datasets' package: pip install datasets") from None
    path = Path(name).expanduser()
    if not path.exists() and looks_local(name):
        raise DatasetError(f"no dataset file or folder {name} (from {Path.cwd()})")
    try:
        with _offline(datasets):
            if path.is_file():
                builder = DATA_FILE_BUILDERS.get(path.suffix.lower())
                if builder is None:
                    raise DatasetError(f"dataset file {name}: {path.suffix or 'no extension'} is not one of the "
                                       f"formats read here ({', '.join(DATA_FILE_BUILDERS)})")
                _one_split(name, split, "one file")
                return datasets.load_dataset(builder, data_files=str(path), split=FILE_SPLIT)
            if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
                loaded = datasets.load_from_disk(str(path))
                if isinstance(loaded, datasets.DatasetDict):
                    if split not in loaded:
                        raise DatasetError(f"cannot load dataset {name!r} (split {split!r}): its splits are "
                                           f"{sorted(loaded)}")
                    return loaded[split]
                _one_split(name, split, "one saved Dataset (not a DatasetDict)")  # as has_one_split says
                return loaded
            if path.is_dir():
                return datasets.load_dataset(str(path), split=split)
            return datasets.load_dataset(name, subset, split=split)
    except ConnectionError:
        raise DatasetError(
            f"dataset {name!r} is not a local file or folder (from {Path.cwd()}) nor in the local Hugging Face "
            f"datasets cache ({datasets.config.HF_DATASETS_CACHE}): datasets are read offline; download it once "
            "(datasets.load_dataset(...).save_to_disk(FOLDER)) and give the folder") from None
    except (FileNotFoundError, ValueError, KeyError, datasets.exceptions.DatasetGenerationError) as exc:
        if isinstance(exc, DatasetError):
            raise
        raise DatasetError(f"cannot load dataset {name!r} (split {split!r}): {exc}") from None


def hf_examples(name: str, *, split: str = "train", subset: str | None = None, question_field: str = "question",
                answer_field: str | None = "answer", columns: Mapping[str, str] | None = None) -> list[Example]:
    """The rows of :func:`hf_table` as examples. GSM8K's layout (question / answer with ``#### 42``) is the
    default; TRL's standard and conversational formats (a ``prompt`` column) are read too."""
    examples = [example_from_row(dict(row), question_field, answer_field, f"{name}:{split}:{i}", f"{name}[{i}]",
                                 columns) for i, row in enumerate(hf_table(name, split, subset))]
    if not examples:
        raise DatasetError(f"dataset {name!r} (split {split!r}) holds no examples")
    return examples


def _jsonl_eval_path(dataset: DatasetConfig, path: str) -> dict:
    if not Path(path).is_file():
        raise DatasetError(f"eval.path {path} is not a file (a JSONL file of evaluation examples)")
    return {"path": path}


def _hf_eval_path(dataset: DatasetConfig, path: str) -> dict:
    # an evaluation file or Dataset is read whole, whatever eval.split
    return {"path": path, **({"split": FILE_SPLIT} if has_one_split(path) else {})}


def _describe_jsonl(dataset: DatasetConfig, count: int, training: DatasetConfig) -> str:
    same = " (the training file)" if Path(dataset.path).resolve() == Path(training.path).resolve() else ""
    return f"the first {count} examples of {dataset.path}{same}"


def _describe_hf(dataset: DatasetConfig, count: int, training: DatasetConfig) -> str:
    subset = f" ({dataset.subset})" if dataset.subset else ""
    return f"{count} examples of {dataset.path}{subset}, split {dataset.split!r}"


# a JSONL file has no held-out part: evaluating its first lines as test examples would report training accuracy
@DATASETS.register("jsonl")
@dataset_kind(system_prompt=R1_SYSTEM_PROMPT, eval_path=_jsonl_eval_path, heldout_split=False,
              describe=_describe_jsonl)
def _jsonl(cfg: DatasetConfig, seed: int) -> list[Example]:
    """A JSONL file, one example per line."""
    return jsonl_examples(cfg.path, cfg.question_field, cfg.answer_field, cfg.columns)


@DATASETS.register("hf")
@dataset_kind(system_prompt=R1_SYSTEM_PROMPT, eval_path=_hf_eval_path, describe=_describe_hf)
def _hf(cfg: DatasetConfig, seed: int) -> list[Example]:
    """Hugging Face datasets: a JSONL/JSON/CSV/Parquet/Arrow file or folder, a save_to_disk folder, a cached name."""
    return hf_examples(cfg.path, split=cfg.split, subset=cfg.subset, question_field=cfg.question_field,
                       answer_field=cfg.answer_field, columns=cfg.columns)
