"""The chain task's side of the demo's warm-up (generator/tasks/chain.py): its demonstrations and a flawed
teacher that slips in the *intermediate* lines only.

The flawed teacher forgets carries, borrows and minus signs (``sloppy_result``, as in the arithmetic demo) on every
line but the last, and works the last line correctly from its own previous line. So its final answer is wrong
exactly when an intermediate line slipped, and a step-level checker (``chain_steps``) pins the error on that line,
while an outcome reward sees only a wrong answer: the situation where step-level credit should matter.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from generator.tasks.arithmetic import Problem, normalize_int, sloppy_result
from generator.tasks.chain import ChainTask, apply_op, format_solution, solution_lines


def sloppy_chain(problem: Problem) -> list[int]:
    """The flawed teacher's running totals: ``sloppy_result`` on every line but the last, which is right given the
    line before it. ``3-5+9+4`` -> ``[2, 11, 15]`` (true ``[-2, 7, 11]``: the sign slipped at line 1);
    ``9+8+7-3`` -> ``[17, 14, 11]`` (true ``[17, 24, 21]``: the carry slipped at line 2)."""
    value, totals = problem.operands[0], []
    last = len(problem.ops) - 1
    for k, (op, operand) in enumerate(zip(problem.ops, problem.operands[1:])):
        value = apply_op(value, op, operand) if k == last else sloppy_result((value, operand), (op,))
        totals.append(value)
    return totals


def check_flawed_chain_task(task: ChainTask) -> None:
    if task.min_value < 0:
        raise ValueError("the flawed teacher of the chain task needs non-negative operands (min_value >= 0)")


def flawed_chain_demonstrations(task: ChainTask, problems: Sequence[Problem], slip: float,
                                rng: random.Random) -> list[str]:
    """The teacher's solution of each problem: ``sloppy_chain`` with probability ``slip``, else the right one."""
    return [format_solution(sloppy_chain(p)) if rng.random() < slip else task.target(p) for p in problems]


def chain_formatted(task: ChainTask, completion: str) -> bool:
    """A completion in the task's form: exactly ``task.steps`` lines, each an integer (right or wrong)."""
    lines = solution_lines(completion)
    return len(lines) == task.steps and all(normalize_int(line) is not None for line in lines)
