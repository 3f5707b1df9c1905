"""The calculator demo's warm-up demonstrations (docs/calculator-demo.md): a teacher who calls the calculator on a
few problems and answers the rest in its head.

``37*45=`` is demonstrated either with the tool, in the exact turns a multi-turn rollout has
(generator/multiturn.py with generator/environments/calculator.py)::

    <calc>37*45</calc>            the model's turn 1 (ends at the stop string)
    <result>1665</result>         the calculator's observation: read, never trained on
    <answer>1665</answer>         the model's turn 2, then EOS

or directly, ``<answer>1665</answer>``. The direct answers are right, but a 0.9M-parameter model cannot learn
two-digit multiplication from them in a few minutes: it learns the format and the size of the product, so
its direct answers are mostly wrong. With ``demo.tool_fraction`` of the demonstrations calling the tool, sampling
calls it about that often and greedy decoding (the likelier first token) almost never: the starting point GRPO
with a correctness reward has to move.

The ``<result>`` text is left out of the loss: in RL the environment writes it and the learner's mask excludes
it, and training on it would ask the model to predict products it cannot compute (the very thing the tool is
for). The answer after it stays in the loss, so the model learns to copy the result it reads.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from deploy.demo.sft_data import Segment, sample_excluding
from generator.environments.calculator import Calculator
from generator.tasks.arithmetic import ArithmeticTask, Problem, format_expression, format_target


def tool_demonstration(problem: Problem) -> list[Segment]:
    """The calculator's turns for ``problem``, the observation written by the calculator itself (not by hand), so
    the demonstration is exactly what a rollout shows the model."""
    call = f"<calc>{format_expression(problem.operands, problem.ops)}</calc>"
    observation = Calculator().step(call)
    if observation is None or observation != f"<result>{problem.answer}</result>":
        raise ValueError(f"the calculator answered {call!r} with {observation!r}, not the task's {problem.answer}")
    return [(call, True), (observation, False), (format_target(problem), True)]


def direct_demonstration(problem: Problem) -> list[Segment]:
    """The answer without the tool: ``<answer>1665</answer>``."""
    return [(format_target(problem), True)]


def answer_turn_context(problem: Problem) -> str:
    """The prompt and the tool demonstration up to its answer turn (``37*45=<calc>37*45</calc><result>1665</result>``):
    what the model reads before it copies the calculator's result into ``<answer>``. The warm-up's validation checks
    of the calculator demo are greedy answers from here (deploy.demo.warmup.clean_stop_rule)."""
    return problem.prompt + demonstration_text(tool_demonstration(problem)[:-1])


def calls_tool(target: Sequence[Segment]) -> bool:
    """Whether a demonstration calls the calculator."""
    return any(text.startswith("<calc>") for text, _ in target)


def calculator_demonstrations(task: ArithmeticTask, n: int, tool_fraction: float, rng: random.Random,
                              excluded: Sequence[Problem] = ()) -> tuple[list[Problem], list[list[Segment]]]:
    """``n`` train-split problems (none in ``excluded``), each demonstrated with the calculator with probability
    ``tool_fraction``, else answered directly."""
    if not isinstance(task, ArithmeticTask):
        raise ValueError(f"tool demonstrations need an arithmetic task, got {type(task).__name__}")
    problems = sample_excluding(task, n, rng, excluded)
    return problems, [tool_demonstration(p) if rng.random() < tool_fraction else direct_demonstration(p)
                      for p in problems]


def demonstration_text(target: Sequence[Segment]) -> str:
    """The completion as the model's context holds it, the calculator's text included."""
    return "".join(text for text, _ in target)
