"""Dataset kinds declare what code outside their loader needs (``@dataset_kind``): the default system prompt, whether
eval.path applies and how it is read, whether the source has a held-out split, how grpo eval names it. A kind
registered with its traits is evaluated without a line anywhere else (no table of kind names)."""

from __future__ import annotations

import pytest

from generator.datasets import (
    DATASETS,
    DatasetKind,
    Example,
    dataset_kind,
    kind_traits,
    path_kinds,
    system_prompt_for,
)
from generator.evaluate import describe, eval_dataset
from shared.config.schema import GRPOConfig
from shared.errors import UsageError


def test_every_registered_kind_declares_its_traits():
    for name in DATASETS.names():
        assert isinstance(getattr(DATASETS.get(name), "traits", None), DatasetKind), name
    assert path_kinds() == ["hf", "jsonl"]
    assert not kind_traits("jsonl").heldout_split and kind_traits("hf").heldout_split
    assert all(kind_traits(k).heldout_split for k in ("arithmetic", "chain", "reasoning_gym", "verifiers"))


def _config(kind: str, **dataset) -> GRPOConfig:
    return GRPOConfig.model_validate({"generator": {"dataset": {"kind": kind, **dataset}}})


@pytest.fixture
def rows_kind(monkeypatch):
    """A kind registered at run time that reads a path, has no held-out part and names itself."""
    seen = []

    def eval_path(dataset, path):
        seen.append(path)
        return {"path": path, "split": "all"}

    @dataset_kind(system_prompt="be brief", eval_path=eval_path, heldout_split=False,
                  describe=lambda d, n, t: f"{n} rows of {d.path} ({d.split})")
    def rows(cfg, seed):
        return [Example("1+1=", {"answer": "2"}, "r0")]

    monkeypatch.setitem(DATASETS._entries_read(), "rows", rows)
    return seen


def test_a_new_kind_is_evaluated_by_its_own_traits(rows_kind):
    config = _config("rows", path="train.rows")
    assert system_prompt_for(config.generator.dataset) == "be brief"
    with pytest.raises(UsageError, match="generator.dataset is the rows source train.rows, which has no held-out"):
        eval_dataset(config)
    config.eval.path = "held-out.rows"
    dataset = eval_dataset(config)
    assert (dataset.path, dataset.split, rows_kind) == ("held-out.rows", "all", ["held-out.rows"])
    assert describe(dataset, 3, config.generator.dataset) == "3 rows of held-out.rows (all)"
    assert "rows" in path_kinds()


def test_eval_path_is_refused_for_a_kind_that_reads_none_naming_the_kinds_that_do():
    config = _config("arithmetic")
    config.eval.path = "x.jsonl"
    with pytest.raises(UsageError, match="eval.path applies to generator.dataset.kind hf or jsonl, not 'arithmetic'"):
        eval_dataset(config)
    config.eval.path = None
    assert describe(eval_dataset(config), 5, config.generator.dataset) == \
        "5 examples of the arithmetic task's 'test' split"
