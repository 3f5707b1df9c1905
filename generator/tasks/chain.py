"""The built-in multi-step task: ``"17+25-8+40="`` solved one running total per line, ``"42\\n34\\n74"``.

It exists for process supervision (issue 23): each line is a step a checker can verify on its own, given the line
before it, so a reward can score every step (``chain_steps`` in generator/rewards/chain.py) as well as the final
answer (``chain``). The expression is worked strictly left to right (only ``+`` and ``-``, so there is no precedence
to argue about); with ``n`` operands the solution has ``n - 1`` lines and the last one is the answer.

The guarantees of the arithmetic task (generator/tasks/arithmetic.py) hold here too:

* the train/test split is a pure function of the expression (a salted SHA-256, never Python's ``hash()``), the same
  for the symbolic prompt of the tiny model and the worded prompt of a chat model;
* the checkers never raise on model output, however malformed.

A line's value is read with :func:`generator.tasks.arithmetic.normalize_int` (surrounding spaces, a leading ``+``
and leading zeros are harmless spellings; decimals, inner spaces and non-ASCII digits are not integers).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from generator.tasks.arithmetic import Problem, _split_score, format_expression, normalize_int, sample_split

SEPARATOR = "\n"
# A chat model sees the expression through this (``template``); the tiny char-level model sees "17+25-8+40=".
WORDS_TEMPLATE = ("Work out {expression} from left to right. Write the running total after each operation on "
                  "its own line, one number per line and nothing else; the last line is the result.")
# Values longer than this are not carried on as a previous line's value (int() of a huge string is slow or refused).
_MAX_DIGITS = 18


def partial_results(operands: Sequence[int], ops: Sequence[str]) -> list[int]:
    """The running totals, left to right: ``(17, 25, 8, 40), ("+", "-", "+")`` -> ``[42, 34, 74]``."""
    if len(ops) != len(operands) - 1 or not ops:
        raise ValueError(f"{len(operands)} operands need {len(operands) - 1} ops (at least one), got {len(ops)}")
    totals, value = [], int(operands[0])
    for op, operand in zip(ops, operands[1:]):
        value = apply_op(value, op, int(operand))
        totals.append(value)
    return totals


def apply_op(value: int, op: str, operand: int) -> int:
    if op == "+":
        return value + operand
    if op == "-":
        return value - operand
    raise ValueError(f"unsupported op {op!r}; the chain task supports + and -")


def make_chain_problem(operands: Sequence[int], ops: Sequence[str], template: str | None = None) -> Problem:
    """The problem with its prompt: ``"17+25-8+40="``, or ``template`` with ``{expression}`` = ``"17 + 25 - 8 + 40"``."""
    operands, ops = tuple(int(v) for v in operands), tuple(ops)
    totals = partial_results(operands, ops)
    if template is None:
        prompt = format_expression(operands, ops) + "="
    else:
        parts = [str(operands[0])]
        for op, value in zip(ops, operands[1:]):
            parts += [op, str(value)]
        prompt = template.format(expression=" ".join(parts))
    return Problem(prompt=prompt, answer=str(totals[-1]), operands=operands, ops=ops)


def format_solution(totals: Sequence[int]) -> str:
    """``[42, 34, 74]`` -> ``"42\\n34\\n74"`` (no trailing newline; whoever tokenizes appends EOS)."""
    return SEPARATOR.join(str(v) for v in totals)


def solution_lines(text: str) -> list[str]:
    """The completion's steps: its non-empty pieces between newlines (exactly the steps a ``StepScores`` with
    ``separator="\\n"`` locates, generator/rewards/steps.py). A whitespace-only piece is a step (a garbage one)."""
    if not isinstance(text, str):
        return []
    return [piece for piece in text.split(SEPARATOR) if piece]


def _as_int(line: str) -> int | None:
    value = normalize_int(line)
    if value is None or len(value.lstrip("-")) > _MAX_DIGITS:
        return None
    return int(value)


def line_checks(text: str, operands: Sequence[int], ops: Sequence[str]) -> list[bool]:
    """One verdict per line of ``text`` (see :func:`solution_lines`): is this step right *given the line before it*?

    * line ``k < len(ops)`` is right when its value equals the previous line's value (the model's own, even if that
      was wrong; ``operands[0]`` before the first line) combined with ``operands[k + 1]`` by ``ops[k]``: an early
      slip is marked once, and a later line that carries it on correctly is right;
    * a line that is not an integer is wrong, and so is the line after it (there is no value to continue from);
    * lines past ``len(ops)`` are wrong (the chain has ended);
    * with fewer lines than ``len(ops)`` the last line is wrong, whatever its value: it is where the completion
      claims its answer and the chain is not finished (so stopping early is never free).

    Never raises on ``text``; raises ``ValueError`` if ``operands``/``ops`` (the task's data) do not fit.
    """
    if len(ops) != len(operands) - 1 or not ops:
        raise ValueError(f"{len(operands)} operands need {len(operands) - 1} ops (at least one), got {len(ops)}")
    lines = solution_lines(text)
    checks: list[bool] = []
    previous: int | None = int(operands[0])
    for k, line in enumerate(lines):
        value = _as_int(line)
        if k >= len(ops):
            checks.append(False)
        else:
            expected = None if previous is None else apply_op(previous, ops[k], int(operands[k + 1]))
            checks.append(value is not None and value == expected)
        previous = value
    if 0 < len(lines) < len(ops):
        checks[-1] = False
    return checks


def final_line_correct(text: str, answer: str) -> bool:
    """Whether the completion's last line (see :func:`solution_lines`) is the integer ``answer``. Never raises on
    ``text``; an ``answer`` that is not an integer is the caller's bug and raises ``ValueError``."""
    expected = normalize_int(str(answer))
    if expected is None:
        raise ValueError(f"reference answer {answer!r} is not an integer")
    lines = solution_lines(text)
    return bool(lines) and normalize_int(lines[-1]) == expected


@dataclass
class ChainTask:
    """Chains of ``num_operands`` integers from ``[min_value, max_value]`` joined by ``ops`` (``+``/``-``), worked left
    to right. ``template`` (with ``{expression}``) words the prompt for a chat model; ``None`` gives ``"3+5-2="``."""

    min_value: int = 0
    max_value: int = 9
    ops: tuple[str, ...] = ("+", "-")
    num_operands: int = 4
    heldout_fraction: float = 0.1
    split_salt: str = "grpo-chain"
    template: str | None = None

    def __post_init__(self) -> None:
        self.ops = tuple(self.ops)  # a YAML/JSON config hands us a list
        if self.min_value > self.max_value:
            raise ValueError(f"min_value {self.min_value} > max_value {self.max_value}")
        if self.num_operands < 2:
            raise ValueError(f"num_operands must be >= 2, got {self.num_operands}")
        if not self.ops or any(op not in ("+", "-") for op in self.ops):
            raise ValueError(f"ops must be a non-empty subset of + -, got {self.ops!r}")
        if not 0.0 <= self.heldout_fraction <= 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1], got {self.heldout_fraction}")
        if self.template is not None and "{expression}" not in self.template:
            raise ValueError(f"template must contain {{expression}}, got {self.template!r}")

    @property
    def steps(self) -> int:
        """Lines of a solution (the last one is the answer)."""
        return self.num_operands - 1

    def split_of(self, problem: Problem) -> str:
        """``"test"`` for the held-out fraction, else ``"train"``: a function of the expression and the salt only."""
        key = format_expression(problem.operands, problem.ops)
        return "test" if _split_score(key, self.split_salt) < self.heldout_fraction else "train"

    def problem(self, operands: Sequence[int], ops: Sequence[str]) -> Problem:
        return make_chain_problem(operands, ops, self.template)

    def random_problem(self, rng: random.Random) -> Problem:
        operands = tuple(rng.randint(self.min_value, self.max_value) for _ in range(self.num_operands))
        ops = tuple(rng.choice(self.ops) for _ in range(self.num_operands - 1))
        return self.problem(operands, ops)

    def sample(self, n: int, split: str, rng: random.Random, max_tries_per_item: int = 1000) -> list[Problem]:
        """``n`` problems of ``split`` drawn with replacement (rejection sampling; raises on an empty split)."""
        return sample_split(self, n, split, rng, max_tries_per_item)

    def target(self, problem: Problem) -> str:
        """The completion a perfect policy emits: one running total per line."""
        return format_solution(partial_results(problem.operands, problem.ops))

    def score(self, problem: Problem, completion_text: str) -> float:
        """1.0 when the last line is the answer (the outcome the held-out accuracy measures), else 0.0."""
        return 1.0 if final_line_correct(completion_text, problem.answer) else 0.0
