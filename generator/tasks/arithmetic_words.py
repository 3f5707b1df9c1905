"""Arithmetic asked in words, for real instruct models: ``"What is 23 plus 58? Reply with only the number."``.

The built-in task (:mod:`generator.tasks.arithmetic`) is written for a character-level model that must emit
``<answer>82</answer>``. A pretrained chat model answers in prose, so this task asks in words (rendered through
the tokenizer's chat template by the prompt stream) and its reward reads *the number the model gives as its
answer*, not the first number in its text:

* an explicitly marked answer wins: the last ``\\boxed{N}``, or the number right after the last "answer is",
  "answer:" or "answer =" (any case);
* otherwise the last number of the completion.

Strict where a reward can be gamed, fair where it cannot:

* nothing numeric may follow the stated answer (``"81, or maybe 82"`` gets no credit);
* a completion whose only number is unmarked may contain no other numbers besides the question's operands
  (``"23 + 58 = 81"`` is fine, ``"79 80 81"`` is not);
* a marked answer may follow at most ``max_other_numbers`` distinct numbers of working that are not operands
  (``"2+3=5, so the answer is 7"`` is scored as 7); listing many candidates is never credited;
* decimals (``"81.0"``) are not integers, as in the built-in task.

The train/test split is the built-in task's: a salted SHA-256 of the expression, never Python's ``hash()``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from generator.tasks.arithmetic import (
    Problem,
    _split_score,
    format_expression,
    make_problem,
    normalize_int,
    sample_split,
)

OP_WORDS = {"+": "plus", "-": "minus", "*": "times"}
DEFAULT_TEMPLATE = "What is {expression}? Reply with only the number."

# An integer or a decimal (so "81.5" is read as one non-integer token, not as 81 and 5); ASCII digits only.
_NUMBER_RE = re.compile(r"(?<![0-9.])[+-]?[0-9]+(?:\.[0-9]+)?(?![0-9])", re.ASCII)
_BOXED_RE = re.compile(r"\\boxed\{\s*([^{}]*?)\s*\}")
_MARKER_RE = re.compile(r"answer\s*(?:is\s*:|is|:|=)?\s*(?:\*\*)?\s*", re.IGNORECASE)


@dataclass(frozen=True)
class StatedAnswer:
    """What a completion answers: the value as written, whether it was marked, and its place in the text."""

    value: str
    marked: bool
    end: int  # character offset right after it


def numbers_in(text: str) -> list[re.Match]:
    return list(_NUMBER_RE.finditer(text))


def stated_answer(text: str) -> StatedAnswer | None:
    """The number a completion gives as its answer (see the module docstring), or None if it gives none."""
    if not isinstance(text, str):
        return None
    candidates: list[StatedAnswer] = []
    boxed = list(_BOXED_RE.finditer(text))
    if boxed:
        last = boxed[-1]
        inner = numbers_in(last.group(1))
        if len(inner) == 1 and inner[0].group(0) == last.group(1).strip():
            candidates.append(StatedAnswer(inner[0].group(0), True, last.end()))
        else:
            return None  # a boxed expression or text is not a number
    for marker in _MARKER_RE.finditer(text):
        number = _NUMBER_RE.match(text, marker.end())
        if number is not None:
            candidates.append(StatedAnswer(number.group(0), True, number.end()))
    if candidates:
        return max(candidates, key=lambda c: c.end)
    found = numbers_in(text)
    return StatedAnswer(found[-1].group(0), False, found[-1].end()) if found else None


def final_number_correct(text: str, answer: str, operands: Sequence[int] = (), max_other_numbers: int = 3) -> bool:
    """True when the stated answer is ``answer`` and the completion passes the rules of the module docstring."""
    expected = normalize_int(answer)
    if expected is None:
        raise ValueError(f"reference answer {answer!r} is not an integer")
    stated = stated_answer(text)
    if stated is None or normalize_int(stated.value) != expected:
        return False
    if _NUMBER_RE.search(text, stated.end) is not None:
        return False  # more numbers after the answer: which one is meant?
    allowed = {normalize_int(str(v)) for v in operands} | {expected}
    others = {normalize_int(m.group(0)) or m.group(0) for m in numbers_in(text)} - allowed
    return len(others) <= (max_other_numbers if stated.marked else 0)


def words_prompt(operands: tuple[int, ...], ops: tuple[str, ...], template: str = DEFAULT_TEMPLATE) -> str:
    """``(23, 58), ("+",)`` -> ``"What is 23 plus 58? Reply with only the number."``."""
    parts = [str(operands[0])]
    for op, value in zip(ops, operands[1:]):
        parts += [OP_WORDS[op], str(value)]
    return template.format(expression=" ".join(parts))


@dataclass
class WordsArithmeticTask:
    """Integer expressions in words over ``[min_value, max_value]``; the answer is the exact integer."""

    min_value: int = 0
    max_value: int = 99
    ops: tuple[str, ...] = ("+",)
    num_operands: int = 2
    heldout_fraction: float = 0.1
    split_salt: str = "grpo-arith-words"
    template: str = DEFAULT_TEMPLATE

    def __post_init__(self) -> None:
        self.ops = tuple(self.ops)
        if self.min_value > self.max_value:
            raise ValueError(f"min_value {self.min_value} > max_value {self.max_value}")
        if self.num_operands < 2:
            raise ValueError("num_operands must be >= 2")
        if not self.ops or any(op not in OP_WORDS for op in self.ops):
            raise ValueError(f"ops must be a non-empty subset of + - *, got {self.ops!r}")
        if not 0.0 <= self.heldout_fraction <= 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1], got {self.heldout_fraction}")
        if "{expression}" not in self.template:
            raise ValueError(f"template must contain {{expression}}, got {self.template!r}")

    def split_of(self, problem: Problem) -> str:
        """``"test"`` for the held-out fraction, else ``"train"``: a function of the expression and the salt."""
        key = format_expression(problem.operands, problem.ops)
        return "test" if _split_score(key, self.split_salt) < self.heldout_fraction else "train"

    def random_problem(self, rng: random.Random) -> Problem:
        operands = tuple(rng.randint(self.min_value, self.max_value) for _ in range(self.num_operands))
        ops = tuple(rng.choice(self.ops) for _ in range(self.num_operands - 1))
        return self.problem(operands, ops)

    def problem(self, operands: tuple[int, ...], ops: tuple[str, ...]) -> Problem:
        base = make_problem(operands, ops)
        return Problem(words_prompt(base.operands, base.ops, self.template), base.answer, base.operands, base.ops)

    def sample(self, n: int, split: str, rng: random.Random, max_tries_per_item: int = 1000) -> list[Problem]:
        """``n`` problems of ``split`` drawn with replacement (rejection sampling; raises on an empty split)."""
        return sample_split(self, n, split, rng, max_tries_per_item)
