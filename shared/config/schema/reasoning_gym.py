"""``generator.dataset.args`` of ``dataset.kind: reasoning_gym`` (generator/datasets/reasoning_gym_tasks.py).

reasoning-gym generates item ``i`` of a task from ``random.Random(seed + i)`` (every one of its procedural tasks,
and a composite's sub-tasks from ``seed + k + 1 + i``): the items of seed ``s`` are items ``1..`` of seed
``s - 1``. Two seeds therefore give disjoint examples only when the seed ranges ``[seed, seed + size)`` and
``[eval_seed, eval_seed + eval_size)`` do not overlap, which is what is checked here, at config load (not merely
``eval_seed != seed``). Task names are checked where reasoning-gym is installed (``grpo check-config``, the
generator, ``grpo eval``): a config loads on a learner host without it.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, model_validator

from shared.config.schema.base import StrictModel

# what the seed and size of each split are (generator.dataset.split / eval.split)
SPLITS = ("train", "test")
# set from size/seed/eval_seed/eval_size, never through the task's own config
SET_BY_ARGS = ("seed", "size")


class ReasoningGymArgs(StrictModel):
    """The reasoning-gym task (or weighted mix of tasks) and its train and test seeds."""

    task: str | list[str] | dict[str, float] = Field(
        description="A reasoning-gym procedural task by name (e.g. 'leg_counting'), a list of names (an equal mix) "
        "or {name: weight} (a weighted mix, reasoning-gym's composite dataset).")
    size: int = Field(1000, ge=1, description="Training examples (split 'train').")
    seed: int = Field(0, ge=0, description="Seed of the training examples: item i comes from seed + i.")
    eval_seed: int | None = Field(None, ge=0, description="Seed of the held-out examples (split 'test'); null: "
                                  "seed + size. The ranges [seed, seed + size) and [eval_seed, eval_seed + "
                                  "eval_size) must not overlap (overlapping seeds give the same items).")
    eval_size: int = Field(200, ge=1, description="Held-out examples (split 'test'; grpo eval takes the first "
                           "eval.num_examples of them).")
    config: dict[str, Any] = Field(default_factory=dict, description="The task's own settings, passed through to "
                                   "reasoning_gym.create_dataset (e.g. {min_animals: 2}); for a mix, {task name: "
                                   "its settings}.")

    @model_validator(mode="after")
    def _consistent(self) -> ReasoningGymArgs:
        weights = self.weights()
        if not weights:
            raise ValueError("task names no task")
        for name, weight in weights.items():
            if not name or name == "composite":
                raise ValueError(f"task {name!r}: name a procedural task (a mix is a list or {{name: weight}})")
            if not weight > 0:
                raise ValueError(f"task {name!r} has weight {weight}; a weight is > 0")
        if isinstance(self.task, list) and len(set(self.task)) != len(self.task):
            raise ValueError(f"task lists a name twice: {self.task}")
        configs = self.config if len(weights) > 1 else {next(iter(weights)): self.config}
        for name, settings in configs.items():
            if name not in weights or not isinstance(settings, dict):
                raise ValueError(f"config of a mix maps each task name to its settings; {name!r} is not one of "
                                 f"its tasks {list(weights)} or its settings are no mapping")
            fixed = sorted(set(settings) & set(SET_BY_ARGS))
            if fixed:
                raise ValueError(f"config of {name!r} sets {fixed}: the seed and size come from args.seed, "
                                 "args.size, args.eval_seed and args.eval_size")
        eval_seed = self.eval_seed_or_default()
        if eval_seed < self.seed + self.size and self.seed < eval_seed + self.eval_size:
            raise ValueError(f"eval_seed {eval_seed}: the held-out seeds [{eval_seed}, {eval_seed + self.eval_size}) "
                             f"overlap the training seeds [{self.seed}, {self.seed + self.size}), so the held-out "
                             "examples would be training examples; set eval_seed >= seed + size (or eval_seed + "
                             "eval_size <= seed)")
        return self

    def weights(self) -> dict[str, float]:
        """Task name -> weight in the mix (one task: weight 1)."""
        if isinstance(self.task, str):
            return {self.task: 1.0}
        if isinstance(self.task, list):
            return {name: 1.0 for name in self.task}
        return dict(self.task)

    def task_config(self, name: str) -> dict[str, Any]:
        """The settings passed through to task ``name``."""
        return dict(self.config if len(self.weights()) == 1 else self.config.get(name, {}))

    def eval_seed_or_default(self) -> int:
        return self.seed + self.size if self.eval_seed is None else self.eval_seed

    def seed_and_size(self, split: str) -> tuple[int, int]:
        """The seed and the number of examples of ``split`` ('train' or 'test')."""
        return (self.seed, self.size) if split == "train" else (self.eval_seed_or_default(), self.eval_size)


def reasoning_gym_args(args: dict[str, Any]) -> ReasoningGymArgs:
    """``generator.dataset.args`` checked; a ``ValueError`` naming each wrong key (``args.KEY: problem``)."""
    try:
        return ReasoningGymArgs.model_validate(args)
    except ValidationError as exc:
        problems = "; ".join(f"args.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" if e["loc"] else
                             f"args: {e['msg'].removeprefix('Value error, ')}" for e in exc.errors())
        raise ValueError(f"dataset kind 'reasoning_gym': {problems}") from None
