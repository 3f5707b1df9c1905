"""Reward functions, chosen and weighted from config, that never crash the generator.

A reward is built by a registered factory from its config arguments and returns one float per completion of a
group: ``fn(prompt, completions, example) -> list[float]`` (a group at a time, so a reward model over HTTP can
score it in one request). :class:`RewardSet` combines them: the total is the weighted sum, each component is
kept unweighted for per-reward metrics, and an exception or a non-finite value is logged and scored with the
reward's ``on_error`` value instead of stopping the rollout loop.

New rewards are one decorated factory: ``@REWARDS.register("name")``.
"""

from __future__ import annotations

import importlib
import logging
import math
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import requests

from generator.tasks.arithmetic import check_answer, extract_answer, normalize_int
from generator.tasks.arithmetic_words import final_number_correct
from shared.errors import UsageError
from shared.registry import Registry

log = logging.getLogger("grpo.generator.rewards")

GroupReward = Callable[[str, Sequence[str], dict[str, Any]], list[float]]
REWARDS: Registry = Registry("reward")


class RewardConfigError(UsageError, ValueError):
    """A reward that cannot be built from its config (unknown function, bad arguments, duplicate name)."""


def per_completion(fn: Callable[[str, str, dict[str, Any]], float]) -> GroupReward:
    """Lift ``fn(prompt, completion, example) -> float`` to a group reward."""

    def one(prompt: str, completion: str, example: dict[str, Any]) -> float:
        try:
            return float(fn(prompt, completion, example))
        except Exception as exc:  # noqa: BLE001 - contained per completion; NaN marks it for on_error
            log.warning("reward %s failed on one completion (%s: %s)", getattr(fn, "__name__", "?"),
                        type(exc).__name__, exc)
            return math.nan

    def group(prompt: str, completions: Sequence[str], example: dict[str, Any]) -> list[float]:
        return [one(prompt, completion, example) for completion in completions]

    group.__name__ = getattr(fn, "__name__", "reward")
    return group


@REWARDS.register("format")
def format_reward(pattern: str = r"^<think>.*?</think>\s*<answer>.*?</answer>$", match: float = 1.25,
                  mismatch: float = -1.0, strip: bool = True) -> GroupReward:
    """simple_GRPO's format reward: ``match`` if the completion is ``<think>...</think><answer>...</answer>``."""
    regex = re.compile(pattern, re.DOTALL)

    def score(prompt: str, completion: str, example: dict[str, Any]) -> float:
        text = completion.strip() if strip else completion
        return match if regex.match(text) else mismatch

    return per_completion(score)


def gold_answer(example: dict[str, Any], field: str = "answer") -> str:
    """The reference answer: GSM8K's text after ``####`` when present, else the whole field."""
    if field not in example:
        raise KeyError(f"the example has no {field!r} field (fields: {sorted(example)})")
    answer = str(example[field])
    return answer.split("####")[-1].strip() if "####" in answer else answer.strip()


@REWARDS.register("math")
def math_reward(correct: float = 1.0, wrong: float = 0.0, answer_field: str = "answer",
                use_answer_tag: bool = True, timeout_s: int = 5) -> GroupReward:
    """Mathematical equivalence with math-verify (``-3``, ``\\frac{1}{2}`` vs ``0.5``, ``\\boxed{72}``...).

    With ``use_answer_tag`` the text inside the last ``<answer>...</answer>`` is checked when there is one.
    math-verify's timeouts use SIGALRM, which only works in the main thread; elsewhere they are disabled.
    """
    from math_verify import parse, verify

    def score(prompt: str, completion: str, example: dict[str, Any]) -> float:
        main = threading.current_thread() is threading.main_thread()
        timeout = timeout_s if main else None
        gold = parse(gold_answer(example, answer_field), parsing_timeout=timeout)
        if not gold:
            raise ValueError(f"cannot parse the reference answer {example.get(answer_field)!r}")
        text = (extract_answer(completion) if use_answer_tag else None) or completion
        predicted = parse(text, parsing_timeout=timeout)
        return correct if predicted and verify(gold, predicted, timeout_seconds=timeout) else wrong

    return per_completion(score)


def digit_agreement(predicted: str, gold: str) -> float:
    """Fraction of digit positions (aligned from the units digit, sign included) where two integers agree."""
    width = max(len(predicted), len(gold))
    a, b = predicted.rjust(width), gold.rjust(width)
    return sum(x == y for x, y in zip(a, b)) / width


@REWARDS.register("arithmetic")
def arithmetic_reward(correct: float = 1.0, wrong: float = 0.0, answer_field: str = "answer",
                      partial: float = 0.0) -> GroupReward:
    """The built-in arithmetic task's checker: the last ``<answer>`` holds exactly the integer result.

    ``partial > 0`` adds shaping for a wrong integer answer: ``wrong + partial * digit_agreement`` (digits compared
    from the units up), a denser signal for a small model that gets the size right before the last digit.
    """

    def score(prompt: str, completion: str, example: dict[str, Any]) -> float:
        gold = str(example[answer_field])
        if check_answer(completion, gold) == 1.0:
            return correct
        if partial:
            predicted = normalize_int(extract_answer(completion) or "")
            if predicted is not None:
                return wrong + partial * digit_agreement(predicted, normalize_int(gold) or gold)
        return wrong

    return per_completion(score)


@REWARDS.register("final_number")
def final_number_reward(correct: float = 1.0, wrong: float = 0.0, answer_field: str = "answer",
                        operands_field: str = "operands", max_other_numbers: int = 3) -> GroupReward:
    """For models that answer in prose: the number given as the answer (a ``\\boxed{}``, the number after the last
    "answer is/:", else the last number) equals the reference; numbers listed after it, or more than
    ``max_other_numbers`` of working besides the operands, get no credit (generator/tasks/arithmetic_words.py)."""

    def score(prompt: str, completion: str, example: dict[str, Any]) -> float:
        operands = example.get(operands_field) or ()
        ok = final_number_correct(completion, gold_answer(example, answer_field), operands, max_other_numbers)
        return correct if ok else wrong

    return per_completion(score)


@REWARDS.register("code")
def code_reward(timeout_s: float = 5.0, memory_mb: int = 512, tests_field: str = "tests",
                extract_code_block: bool = True) -> GroupReward:
    """Run the completion's code against the example's tests in a sandboxed subprocess (see generator/sandbox.py);
    the reward is the fraction of tests that pass.

    Tests are ``assert`` statements (with set-up statements if needed). The verdict is computed outside the
    sandbox from the plain values of the solution-dependent sub-expressions, so the code cannot forge it
    (docs/reward-hacks.md); tests whose form cannot be checked that way (asserts inside loops, no assert)
    fail with the reason in the run's detail.
    """
    from generator.sandbox import SandboxLimits, extract_code, run_tests

    limits = SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb)

    def score(prompt: str, completion: str, example: dict[str, Any]) -> float:
        tests = example.get(tests_field)
        if not isinstance(tests, list) or not tests:
            raise ValueError(f"the example's {tests_field!r} field must be a non-empty list of test statements")
        code = extract_code(completion) if extract_code_block else completion
        return run_tests(code, [str(t) for t in tests], limits).fraction_passed

    return per_completion(score)


@REWARDS.register("http")
def http_reward(url: str, timeout_s: float = 30.0, token: str | None = None) -> GroupReward:
    """A reward model behind HTTP: ``POST url {"prompts": [...], "completions": [...]}`` -> ``{"scores": [...]}``.

    One request per group. A wrong number of scores is an error (scored ``on_error``), never a silent zero.
    """
    session = requests.Session()
    if token:
        session.headers["Authorization"] = f"Bearer {token}"

    def group(prompt: str, completions: Sequence[str], example: dict[str, Any]) -> list[float]:
        response = session.post(url, json={"prompts": [prompt] * len(completions),
                                           "completions": list(completions)}, timeout=timeout_s)
        response.raise_for_status()
        scores = response.json().get("scores")
        if not isinstance(scores, list) or len(scores) != len(completions):
            raise ValueError(f"{url} returned {scores!r} for {len(completions)} completions")
        return [float(s) for s in scores]

    return group


@REWARDS.register("python")
def python_reward(function: str, per_group: bool = False, **kwargs: Any) -> GroupReward:
    """Any importable function named ``module:function``.

    Called as ``fn(prompt=..., completion=..., example=..., **kwargs) -> float`` per completion, or with
    ``per_group: true`` as ``fn(prompt=..., completions=[...], example=..., **kwargs) -> list[float]``.
    """
    module_name, sep, attr = function.partition(":")
    if not sep or not module_name or not attr:
        raise RewardConfigError(f"python reward needs 'module:function', got {function!r}")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise RewardConfigError(f"cannot import reward function {function!r}: {exc}") from None
    if per_group:
        return lambda prompt, completions, example: list(fn(prompt=prompt, completions=list(completions),
                                                             example=example, **kwargs))
    return per_completion(lambda prompt, completion, example: fn(prompt=prompt, completion=completion,
                                                                 example=example, **kwargs))


@dataclass
class RewardTerm:
    name: str
    fn: GroupReward
    weight: float
    on_error: float


@dataclass
class GroupScores:
    total: list[float]                    # weighted sum per completion
    components: dict[str, list[float]]    # reward name -> unweighted value per completion
    errors: dict[str, int]                # reward name -> completions scored with on_error


class RewardSet:
    """The configured rewards; ``score_group`` is total + per-reward values, errors contained and counted."""

    def __init__(self, terms: list[RewardTerm]) -> None:
        if not terms:
            raise RewardConfigError("at least one reward is needed")
        names = [t.name for t in terms]
        if len(set(names)) != len(names):
            raise RewardConfigError(f"reward names must be unique, got {names} (use 'label' to tell two apart)")
        self.terms = terms

    @classmethod
    def from_specs(cls, specs: Sequence[Any]) -> RewardSet:
        """From config entries with ``name``, ``label``, ``weight``, ``on_error`` and ``args``."""
        terms = []
        for spec in specs:
            factory = REWARDS.get(spec.name)
            try:
                fn = factory(**spec.args)
            except TypeError as exc:
                raise RewardConfigError(f"reward {spec.name!r}: bad arguments {spec.args}: {exc}") from None
            terms.append(RewardTerm(spec.label or spec.name, fn, spec.weight, spec.on_error))
        return cls(terms)

    def score_group(self, prompt: str, completions: Sequence[str], example: dict[str, Any]) -> GroupScores:
        n = len(completions)
        total = [0.0] * n
        components: dict[str, list[float]] = {}
        errors: dict[str, int] = {}
        for term in self.terms:
            values = self._safe(term, prompt, completions, example, errors)
            components[term.name] = values
            total = [t + term.weight * v for t, v in zip(total, values)]
        return GroupScores(total, components, errors)

    @staticmethod
    def _safe(term: RewardTerm, prompt: str, completions: Sequence[str], example: dict[str, Any],
              errors: dict[str, int]) -> list[float]:
        try:
            values = [float(v) for v in term.fn(prompt, completions, example)]
            if len(values) != len(completions):
                raise ValueError(f"returned {len(values)} values for {len(completions)} completions")
        except Exception as exc:  # noqa: BLE001 - a reward must never take the generator down
            log.warning("reward %r failed on a group (%s: %s); scoring it %s", term.name, type(exc).__name__,
                        exc, term.on_error)
            errors[term.name] = errors.get(term.name, 0) + len(completions)
            return [term.on_error] * len(completions)
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            log.warning("reward %r failed or was not finite for %d completions; scoring them %s", term.name,
                        len(bad), term.on_error)
            errors[term.name] = errors.get(term.name, 0) + len(bad)
            values = [term.on_error if i in bad else v for i, v in enumerate(values)]
        return values
