"""``dataset.kind: verifiers``: the rows of a verifiers environment (generator/agent/verifiers_env.py) as examples,
split 'train' its dataset, 'eval' or 'test' its eval_dataset (verifiers falls back to the dataset when the
environment has none). Each row keeps every column (``prompt``, ``answer``, ``info``, ``example_id``, ...), so its
episode's rollout receives the row as the environment built it."""

from __future__ import annotations

from generator.datasets.base import DATASETS, DatasetError, Example, dataset_kind, example_from_row
from generator.datasets.render import R1_SYSTEM_PROMPT
from shared.config.schema.generator import DatasetConfig

EVAL_SPLITS = ("eval", "test")


@DATASETS.register("verifiers")
@dataset_kind(system_prompt=R1_SYSTEM_PROMPT)   # a row's own system message wins (render_messages)
def verifiers_examples(cfg: DatasetConfig, seed: int) -> list[Example]:
    """A verifiers environment's rows (its dataset, or its eval_dataset for split eval/test)."""
    from generator.agent.verifiers_env import load_environment

    env_id = cfg.verifiers.env_id
    env = load_environment(cfg.verifiers)
    if cfg.split not in ("train", *EVAL_SPLITS):
        raise DatasetError(f"generator.dataset.split: a verifiers environment has the splits 'train' (its dataset) "
                           f"and 'eval' (its eval_dataset; 'test' says the same), not {cfg.split!r}")
    try:
        rows = env.get_eval_dataset() if cfg.split in EVAL_SPLITS else env.get_dataset()
    except ValueError as exc:   # verifiers: "dataset is not set"
        raise DatasetError(f"verifiers environment {env_id}: no {cfg.split} rows ({exc})") from None
    return [example_from_row(dict(row), "prompt", "answer" if "answer" in row else None,
                             f"verifiers:{env_id}:{cfg.split}:{row.get('example_id', i)}",
                             f"verifiers environment {env_id}, {cfg.split} row {i}")
            for i, row in enumerate(rows)]
