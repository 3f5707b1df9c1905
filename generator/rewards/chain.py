"""Rewards of the multi-step chain task (generator/tasks/chain.py): the outcome and one reward per step.

* ``chain`` (outcome supervision): ``correct`` when the completion's last line is the answer, else ``wrong``.
* ``chain_steps`` (process supervision): one reward per line of the completion, as a
  :class:`~generator.rewards.steps.StepScores` with ``separator="\\n"`` (a step is a non-empty line; the
  generator maps each line's last character to its token). A line gets ``correct`` when it is right *given the
  line before it* (the model's own previous line, even a wrong one), else ``wrong``; so a slip at line k costs
  line k only, and the lines that carry the slipped value on correctly keep their credit. The rules for
  garbage, extra and missing lines are :func:`generator.tasks.chain.line_checks`'s:

  - a line that is not an integer is wrong, and so is the next line (nothing to continue from);
  - lines past the chain's length are wrong;
  - a completion that stops early gets ``wrong`` on its last line (it claims an answer the chain has not reached);
  - an empty completion has no steps (``rewards=()``); its outcome is ``wrong``.

  The StepScores also carries the completion's ``outcome`` (the ``chain`` value), for a generator configured to
  combine it with the steps.

Both read ``answer``, ``operands`` and ``ops`` from the example (the ``chain`` dataset puts them there; field names
are arguments). Neither raises on a completion; a malformed example (the task's data, not the model's) raises and
is scored ``on_error`` by the reward set.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from generator.rewards.base import REWARDS, GroupReward, per_completion
from generator.rewards.steps import StepScores
from generator.tasks.chain import SEPARATOR, final_line_correct, line_checks


def _chain_data(example: dict[str, Any], operands_field: str, ops_field: str) -> tuple[list[int], list[str]]:
    operands, ops = example.get(operands_field), example.get(ops_field)
    if not isinstance(operands, (list, tuple)) or not isinstance(ops, (list, tuple)):
        raise ValueError(f"the example needs list fields {operands_field!r} and {ops_field!r} "
                         f"(fields: {sorted(example)})")
    return [int(v) for v in operands], [str(op) for op in ops]


@REWARDS.register("chain")
def chain_reward(correct: float = 1.0, wrong: float = 0.0, answer_field: str = "answer") -> GroupReward:
    """Outcome: ``correct`` if the last line of the completion is the answer, else ``wrong``."""

    def score(prompt: str, completion: str, example: dict[str, Any]) -> float:
        return correct if final_line_correct(completion, str(example[answer_field])) else wrong

    return per_completion(score)


@REWARDS.register("chain_steps")
def chain_steps_reward(correct: float = 1.0, wrong: float = 0.0, answer_field: str = "answer",
                       operands_field: str = "operands", ops_field: str = "ops"):
    """Process: one ``correct``/``wrong`` per line, each line checked against the line before it (module docstring).

    Returns, per completion, ``StepScores(rewards=..., separator="\\n", outcome=...)``.
    """

    def group(prompt: str, completions: Sequence[str], example: dict[str, Any]) -> list[StepScores]:
        operands, ops = _chain_data(example, operands_field, ops_field)
        answer = str(example[answer_field])
        return [StepScores(rewards=tuple(correct if ok else wrong for ok in line_checks(text, operands, ops)),
                           separator=SEPARATOR,
                           outcome=correct if final_line_correct(text, answer) else wrong)
                for text in completions]

    group.__name__ = "chain_steps"
    return group
