"""``reward: reasoning_gym``: a reasoning-gym task's own ``score_answer`` on the answer a completion gives.

The answer is what the system prompt of ``dataset.kind: reasoning_gym`` asks for: the text inside the last
``<answer>...</answer>`` (reasoning-gym's ``extract_answer``); a completion without one scores 0, as
reasoning-gym scores a missing answer. With ``tag: null`` the whole completion is the answer (reasoning-gym's
"direct" style, for a model that does not write tags). The task is the example's ``metadata.source_dataset`` (every reasoning-gym
item names its task there), scored by that task's dataset built with the example's settings
(generator/datasets/reasoning_gym_tasks.py), so partial credit is the task's own (``score_answer`` may give less
than 1 for a near miss).
"""

from __future__ import annotations

from typing import Any

from generator.datasets.reasoning_gym_tasks import CONFIG_FIELD, require_reasoning_gym, task_dataset
from generator.rewards.base import REWARDS, GroupReward, per_completion


def reasoning_gym_entry(question: str, example: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The task name and reasoning-gym's item (question, answer, metadata) of ``example``."""
    metadata = example.get("metadata")
    if not isinstance(metadata, dict) or "source_dataset" not in metadata or "answer" not in example:
        raise ValueError(f"the example is no reasoning-gym item (an answer, and metadata naming its source_dataset; "
                       f"fields: {sorted(example)}): the reasoning_gym reward scores generator.dataset.kind "
                       "reasoning_gym")
    return metadata["source_dataset"], {"question": question, "answer": example["answer"], "metadata": metadata}


@REWARDS.register("reasoning_gym")
def reasoning_gym_reward(tag: str | None = "answer") -> GroupReward:
    """The task's own ``score_answer`` on the last ``<answer>...</answer>`` of the completion (none: 0); ``tag``
    null: on the whole completion, stripped (a prompt that asks for the answer alone)."""
    extract_answer = require_reasoning_gym("reward 'reasoning_gym'").utils.extract_answer

    def score(prompt: str, completion: str, example: dict[str, Any]) -> float:
        task, entry = reasoning_gym_entry(prompt, example)
        answer = completion.strip() if tag is None else extract_answer(completion, tag_name=tag)
        if not answer:
            return 0.0
        return float(task_dataset(task, example.get(CONFIG_FIELD) or {}).score_answer(answer, entry))

    score.__name__ = "reasoning_gym"
    return per_completion(score)
