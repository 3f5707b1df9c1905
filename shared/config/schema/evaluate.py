"""The eval section: held-out accuracy with the same rewards as training (`grpo eval`)."""

from __future__ import annotations

from pydantic import Field

from shared.config.schema.base import StrictModel


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
