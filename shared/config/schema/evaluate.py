"""The eval section: held-out accuracy with the same rewards as training (`grpo eval`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from shared.config.schema.base import StrictModel
from shared.config.schema.paths import template_help


class EvalConfig(StrictModel):
    """Held-out evaluation: greedy accuracy and pass@k on the dataset's evaluation split or file."""

    split: str = Field("test", description="Split to evaluate ('test' is the arithmetic task's held-out split; "
                       "a Hugging Face dataset's split name). Without eval.path it must differ from "
                       "generator.dataset.split (refused at load: those rows are trained on). A JSONL file has no "
                       "splits, nor has a single data file read with kind hf: see eval.path.")
    path: str | None = Field(
        None, description="What to evaluate instead of the training dataset: with generator.dataset.kind jsonl an "
        "evaluation JSONL file (required there: a JSONL file has no held-out split; give the training file itself "
        "to evaluate its first lines), with kind hf any file, folder or cached name generator.dataset.path takes "
        "(its eval.split; a single file or saved Dataset is read whole). Null: the training dataset's eval.split.")
    num_examples: int = Field(200, ge=1, description="Examples evaluated (the first N of the split or file; "
                              "arithmetic: N drawn with a fixed seed).")
    k: int = Field(4, ge=1, description="pass@k: k samples per example at eval temperature.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the pass@k samples.")
    accuracy_reward: str | None = Field(
        None, description="Reward (name or label) that decides correctness; default: the first generator reward.")
    threshold: float = Field(1.0, description="A completion is correct when that reward is >= this value.")
    engine: str = Field("auto", description="'auto' (vLLM when it can run here, else transformers), 'vllm' or "
                        "'transformers'.")
    # evaluation while training: `grpo run` starts an evaluator (generator/evaluator.py) when every_steps or
    # every_minutes is set
    every_steps: int | None = Field(
        None, ge=1, description="Evaluate while training: `grpo run` starts an evaluator process (`grpo evaluator`) "
        "that follows the weight versions the learner publishes and evaluates a version whenever it is at least "
        "this many versions past the last one evaluated (a version is the learner's step that published it), "
        "never in the learner's step. Null: no evaluation while training (`grpo eval` after it).")
    every_minutes: float | None = Field(
        None, gt=0, description="Evaluate while training by the clock too (or instead): the newest version is "
        "evaluated when this many minutes passed since the evaluator's last evaluation (or its start) and the "
        "learner published a version since. With eval.every_steps, whichever comes first.")
    jsonl: str | None = Field("<run_dir>/eval.jsonl", description=template_help(
        "Where the evaluator appends one JSON line per evaluation (version, step, eval/<dataset>/<metric>, or "
        "error)", "<run_dir>/eval.jsonl", "refused when the evaluator runs"))
    best_dir: str | None = Field("<run_dir>/best", description=template_help(
        "Where eval.best_metric keeps the best version evaluated (a Hugging Face folder with best.json)",
        "<run_dir>/best", "refused when eval.best_metric is set"))
    final_wait_s: float = Field(
        600.0, ge=0, description="When the learner finishes, how long `grpo run` waits for the evaluator to "
        "evaluate the final version (whatever eval.every_steps) before it stops the services; 0: it does not wait "
        "(the final version is evaluated only if it was due).")
    poll_s: float = Field(2.0, gt=0, description="How often the evaluator asks the hub for its newest version.")
    best_metric: str | None = Field(
        None, description="Keep the best version evaluated by this metric ('accuracy', 'pass@k', "
        "'mean_reward', 'tool_call_rate', 'turns_per_trajectory') as a Hugging Face folder eval.best_dir with "
        "best.json (version, step, metric, value); a restarted evaluator keeps it unless beaten. Null: no best "
        "checkpoint.")
    best_mode: Literal["max", "min"] = Field("max", description="Whether the best eval.best_metric is the "
                                             "highest ('max') or the lowest ('min').")

    @property
    def while_training(self) -> bool:
        """Whether `grpo run` starts an evaluator: eval.every_steps or eval.every_minutes set."""
        return self.every_steps is not None or self.every_minutes is not None

    @field_validator("best_metric")
    @classmethod
    def _known_metric(cls, value: str | None) -> str | None:
        if value is not None and value not in BEST_METRICS:
            raise ValueError(f"eval.best_metric {value!r} is not one of {', '.join(BEST_METRICS)}")
        return value


# what eval.best_metric may name: the evaluator's metrics (eval/<dataset>/<metric>), pass@k whatever eval.k
BEST_METRICS = ("accuracy", "pass@k", "mean_reward", "tool_call_rate", "turns_per_trajectory")
