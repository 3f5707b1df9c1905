"""The built-in calculator: ``<calc>347*29</calc>`` is answered ``<result>10063</result>``.

Safe by construction: no ``eval``. An expression is integers joined by ``+``, ``-`` and ``*`` (spaces allowed, usual
precedence, an optional leading minus), at most ``max_chars`` characters and ``max_digits`` digits per number, so
a result is bounded too. Anything else is answered ``<result>error</result>`` (the model sees it; no failure).
A turn without a ``<calc>`` call is the model's answer: the trajectory is done.

:func:`calculate` is the same calculator as a chat tool (``generator.environment: {name: tools, args: {tools:
[generator.environments.calculator:calculate]}}``, docs/multi-turn.md); a bad expression raises, which the tools
environment answers as an error tool message.
"""

from __future__ import annotations

import re
from typing import Any

from generator.environments.base import ENVIRONMENTS

_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_TOKEN = re.compile(r"\s*(\d+|[-+*])")


class CalculatorError(ValueError):
    """An expression outside the calculator's syntax or bounds."""


def evaluate(expression: str, *, max_chars: int = 64, max_digits: int = 12) -> int:
    """The value of ``expression`` (integers, ``+ - *``, precedence of ``*``); CalculatorError otherwise."""
    if len(expression) > max_chars:
        raise CalculatorError(f"expression longer than {max_chars} characters")
    tokens, position = [], 0
    stripped = expression.rstrip()
    while position < len(stripped):
        match = _TOKEN.match(stripped, position)
        if match is None:
            raise CalculatorError(f"unexpected {stripped[position:position + 5]!r}")
        tokens.append(match.group(1))
        position = match.end()
    if not tokens:
        raise CalculatorError("empty expression")
    sign = 1
    if tokens[0] == "-":
        sign, tokens = -1, tokens[1:]
    # numbers at even positions, operators at odd ones
    if not tokens or len(tokens) % 2 == 0:
        raise CalculatorError("an expression must alternate numbers and operators")
    for i, token in enumerate(tokens):
        is_number = token.isdigit()
        if is_number != (i % 2 == 0):
            raise CalculatorError(f"misplaced {token!r}")
        if is_number and len(token) > max_digits:
            raise CalculatorError(f"a number longer than {max_digits} digits")
    total, term = 0, sign * int(tokens[0])
    for op, number in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            term *= int(number)
        else:
            total += term
            term = int(number) if op == "+" else -int(number)
    return total + term


def calculate(expression: str) -> str:
    """Compute an integer arithmetic expression exactly.

    Args:
        expression: Integers joined by +, - and *, e.g. "347*29" or "12 + 3*4".
    """
    return str(evaluate(expression))


@ENVIRONMENTS.register("calculator")
class Calculator:
    """One trajectory's calculator. ``args``: ``max_chars`` and ``max_digits`` of an expression."""

    stop = ["</calc>"]

    def __init__(self, max_chars: int = 64, max_digits: int = 12) -> None:
        self.max_chars, self.max_digits = max_chars, max_digits
        self.calls = 0

    def reset(self, sample: dict[str, Any]) -> str | None:
        return None

    def step(self, model_turn_text: str) -> str | None:
        calls = _CALL.findall(model_turn_text)
        if not calls:
            return None
        self.calls += 1
        try:
            value = str(evaluate(calls[-1], max_chars=self.max_chars, max_digits=self.max_digits))
        except CalculatorError:
            value = "error"
        return f"<result>{value}</result>"
