"""The built-in arithmetic task: ``"37+45="`` -> ``"<answer>82</answer>"``.

It exists so the whole stack (generators, reference server, learner) can be exercised end to end on a CPU
with a tiny model and a reward that is cheap, exact and impossible to argue with.

Two properties matter more than anything else here:

* The train/test split is a pure function of the problem text (a salted SHA-256, never Python's per-process
  ``hash()``), so no sampling seed, worker count or process restart can leak a held-out problem into training.
* ``check_answer`` never raises on model output: a reward function that throws on garbage kills a rollout
  worker, and early RL produces plenty of garbage.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

# Matches one integer answer: optional sign, ASCII digits only (no "8_2", no Arabic-Indic digits, no "82.0").
_INT_RE = re.compile(r"[+-]?[0-9]+", re.ASCII)
_OPEN_TAG = "<answer>"
_CLOSE_TAG = "</answer>"


@dataclass(frozen=True)
class Problem:
    """One arithmetic question; ``prompt`` is what the model sees, ``answer`` the exact integer as text."""

    prompt: str
    answer: str
    operands: tuple[int, ...]
    ops: tuple[str, ...]


def evaluate(operands: tuple[int, ...], ops: tuple[str, ...]) -> int:
    """Evaluate with the usual precedence (``*`` before ``+``/``-``, left to right) without ``eval``."""
    if len(ops) != len(operands) - 1:
        raise ValueError(f"{len(operands)} operands need {len(operands) - 1} ops, got {len(ops)}")
    # Fold multiplications into terms first, then add/subtract the terms left to right.
    terms = [operands[0]]
    signs = [1]
    for op, value in zip(ops, operands[1:]):
        if op == "*":
            terms[-1] *= value
        elif op in ("+", "-"):
            terms.append(value)
            signs.append(1 if op == "+" else -1)
        else:
            raise ValueError(f"unsupported op {op!r}; supported: + - *")
    return sum(s * t for s, t in zip(signs, terms))


def format_expression(operands: tuple[int, ...], ops: tuple[str, ...]) -> str:
    """``(37, 45), ("+",)`` -> ``"37+45"``: no spaces, so a char-level model sees short prompts."""
    parts = [str(operands[0])]
    for op, value in zip(ops, operands[1:]):
        parts.append(op)
        parts.append(str(value))
    return "".join(parts)


def make_problem(operands: tuple[int, ...], ops: tuple[str, ...]) -> Problem:
    operands = tuple(int(v) for v in operands)
    ops = tuple(ops)
    return Problem(
        prompt=format_expression(operands, ops) + "=",
        answer=str(evaluate(operands, ops)),
        operands=operands,
        ops=ops,
    )


def sloppy_result(operands: tuple[int, ...], ops: tuple[str, ...]) -> int:
    """What a sloppy student writes for ``a+b`` or ``a-b`` (non-negative operands): every carry, borrow and minus
    sign forgotten.

    Each digit below the leading one is ``(x + y) mod 10`` (or ``(x - y) mod 10``), the leading digits are added
    (subtracted) as they are, and ``a-b`` with ``a < b`` is worked as ``b-a``: ``58+67`` -> ``115`` (true 125),
    ``41-38`` -> ``13`` (true 3), ``38-41`` -> ``13`` (true -3), ``12-34`` -> ``22`` (true -22). Equal to
    :func:`evaluate` whenever no carry, borrow or sign is needed. It models the systematic errors of a flawed
    teacher (``deploy.demo.warmup.flawed_teacher_finetune``); other expressions raise ``ValueError``.
    """
    if len(operands) != 2 or len(ops) != 1 or ops[0] not in ("+", "-") or min(operands) < 0:
        raise ValueError(f"the sloppy result is defined for a+b and a-b with non-negative operands, got "
                         f"{format_expression(operands, ops)!r}")
    a, b = operands
    if ops[0] == "-" and a < b:
        a, b = b, a
    width = max(len(str(a)), len(str(b)))
    x, y = str(a).rjust(width, "0"), str(b).rjust(width, "0")
    sign = 1 if ops[0] == "+" else -1
    lead = int(x[0]) + sign * int(y[0])
    low = "".join(str((int(p) + sign * int(q)) % 10) for p, q in zip(x[1:], y[1:]))
    return lead * 10 ** len(low) + (int(low) if low else 0)


def format_target(problem: Problem) -> str:
    """The completion a perfect policy emits (the EOS token is appended by whoever tokenizes it)."""
    return f"{_OPEN_TAG}{problem.answer}{_CLOSE_TAG}"


def extract_answer(text: str) -> str | None:
    """Content of the last *closed* ``<answer>...</answer>`` pair, stripped; ``None`` if there is none.

    "Last" because a model that thinks out loud may write a draft answer before its final one. The opening tag
    is the last ``<answer>`` before the last ``</answer>``, so ``"<answer>1<answer>2</answer>"`` gives ``"2"``.
    An unclosed trailing ``<answer>`` is ignored: ``"<answer>3</answer><answer>4"`` gives ``"3"``.
    """
    if not isinstance(text, str):
        return None
    end = text.rfind(_CLOSE_TAG)
    if end < 0:
        return None
    start = text.rfind(_OPEN_TAG, 0, end)
    if start < 0:
        return None
    return text[start + len(_OPEN_TAG) : end].strip()


def normalize_int(text: str) -> str | None:
    """Canonical form of an integer string, or ``None`` if it is not one.

    Accepted: surrounding whitespace, a leading ``+`` and leading zeros (``"0082"`` == ``"82"``): the reward
    measures the value, and these are harmless spellings of it. Rejected: decimals (``"82.0"``; the task is
    integer arithmetic and accepting floats invites ``"81.9999"`` debates), inner spaces, ``_`` separators and
    non-ASCII digits (``int()`` would accept the last two). Works on strings, never ``int()``, so a 10,000-digit
    completion cannot trip Python's int-parsing limit.
    """
    text = text.strip()
    if not _INT_RE.fullmatch(text):
        return None
    negative = text[0] == "-"
    digits = text.lstrip("+-").lstrip("0") or "0"
    return ("-" + digits) if negative and digits != "0" else digits


def check_answer(completion_text: str, answer: str) -> float:
    """1.0 if the last ``<answer>`` in the completion is the same integer as ``answer``, else 0.0.

    Never raises on the completion. ``answer`` comes from the task, so an answer that is not an integer is a
    bug in the caller and raises ``ValueError`` instead of silently rewarding nothing.
    """
    expected = normalize_int(answer)
    if expected is None:
        raise ValueError(f"reference answer {answer!r} is not an integer")
    got = extract_answer(completion_text)
    if got is None:
        return 0.0
    return 1.0 if normalize_int(got) == expected else 0.0


def _split_score(key: str, salt: str) -> float:
    """Uniform in [0, 1), stable across processes, machines and Python versions."""
    digest = hashlib.sha256(f"{salt}\x00{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def sample_split(task, n: int, split: str, rng: random.Random, max_tries_per_item: int = 1000) -> list[Problem]:
    """``n`` problems of ``split`` from ``task.random_problem`` / ``task.split_of``, by rejection sampling with a
    budget (an empty split raises instead of looping forever). Shared by the arithmetic tasks."""
    _check_split(split)
    out: list[Problem] = []
    budget = max_tries_per_item * max(n, 1)
    while len(out) < n:
        if budget <= 0:
            raise RuntimeError(f"could not draw {n} {split!r} problems; is the split empty?")
        budget -= 1
        problem = task.random_problem(rng)
        if task.split_of(problem) == split:
            out.append(problem)
    return out


@dataclass
class ArithmeticTask:
    """Integer expressions over ``[min_value, max_value]`` with ``num_operands`` operands drawn from ``ops``."""

    min_value: int = 0
    max_value: int = 99
    ops: tuple[str, ...] = ("+", "-")
    num_operands: int = 2
    heldout_fraction: float = 0.1
    split_salt: str = "grpo-arith"

    def __post_init__(self) -> None:
        self.ops = tuple(self.ops)  # a YAML/JSON config hands us a list
        if self.min_value > self.max_value:
            raise ValueError(f"min_value {self.min_value} > max_value {self.max_value}")
        if self.num_operands < 2:
            raise ValueError("num_operands must be >= 2")
        if not self.ops or any(op not in ("+", "-", "*") for op in self.ops):
            raise ValueError(f"ops must be a non-empty subset of + - *, got {self.ops!r}")
        if not 0.0 <= self.heldout_fraction <= 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1], got {self.heldout_fraction}")

    @property
    def space_size(self) -> int:
        """Number of distinct problems (both splits together)."""
        values = self.max_value - self.min_value + 1
        return values**self.num_operands * len(self.ops) ** (self.num_operands - 1)

    def split_of(self, problem: Problem) -> str:
        """``"test"`` for the held-out fraction, else ``"train"``; depends only on the prompt and the salt."""
        return "test" if _split_score(problem.prompt, self.split_salt) < self.heldout_fraction else "train"

    def random_problem(self, rng: random.Random) -> Problem:
        operands = tuple(rng.randint(self.min_value, self.max_value) for _ in range(self.num_operands))
        ops = tuple(rng.choice(self.ops) for _ in range(self.num_operands - 1))
        return make_problem(operands, ops)

    def sample(self, n: int, split: str, rng: random.Random, max_tries_per_item: int = 1000) -> list[Problem]:
        """``n`` problems from ``split``, drawn with replacement by rejection sampling.

        Raises instead of looping forever when the split is (nearly) empty, e.g. ``heldout_fraction=0``.
        """
        return sample_split(self, n, split, rng, max_tries_per_item)

    def enumerate(self, split: str | None = None, max_problems: int = 1_000_000) -> Iterator[Problem]:
        """Every problem (of ``split``, or all if ``None``) in a fixed order; refuses huge spaces."""
        if split is not None:
            _check_split(split)
        if self.space_size > max_problems:
            raise ValueError(f"{self.space_size} problems > max_problems={max_problems}")
        values = range(self.min_value, self.max_value + 1)
        for operands in itertools.product(values, repeat=self.num_operands):
            for ops in itertools.product(self.ops, repeat=self.num_operands - 1):
                problem = make_problem(operands, ops)
                if split is None or self.split_of(problem) == split:
                    yield problem

    def score(self, problem: Problem, completion_text: str) -> float:
        """The reward for one completion (see ``check_answer``)."""
        return check_answer(completion_text, problem.answer)


def _check_split(split: str) -> None:
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
