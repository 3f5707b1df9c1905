"""The built-in rewards, one registered factory each: format, math, arithmetic, final_number, code, http, python
(simple or TRL-style: generator/rewards/trl_style.py).

Each factory takes its config ``args`` and returns a group reward ``fn(prompt, completions, example)`` whose values
are floats (outcome scores) or :class:`generator.rewards.steps.StepScores` (step scores); see
:mod:`generator.rewards.base`.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Any

import requests

from generator.failures import ServiceDown
from generator.rewards.base import REWARDS, GroupReward, per_completion
from generator.tasks.arithmetic import check_answer, extract_answer, normalize_int
from generator.tasks.arithmetic_words import final_number_correct
from shared.errors import UsageError


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
    """Run the completion's code against the example's tests in a sandboxed subprocess (see generator/sandbox/);
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

    One request per group. A server that does not answer (connection refused, a timeout, 5xx, 429) is down: the
    generator pauses until it answers (:class:`~generator.rewards.base.ServiceDown`). One that answers something
    unusable (4xx, not JSON, a wrong number of scores) fails the group (scored ``on_error``, counted under the rule
    on failing rewards), never a silent zero.
    """
    session = requests.Session()
    if token:
        session.headers["Authorization"] = f"Bearer {token}"

    def group(prompt: str, completions: Sequence[str], example: dict[str, Any]) -> list[float]:
        try:
            response = session.post(url, json={"prompts": [prompt] * len(completions),
                                               "completions": list(completions)}, timeout=timeout_s)
        except (requests.ConnectionError, requests.Timeout) as exc:
            raise ServiceDown("HTTP reward", url, f"{type(exc).__name__}: {exc}") from None
        if response.status_code >= 500 or response.status_code == 429:
            raise ServiceDown("HTTP reward", url, f"HTTP {response.status_code}: {response.text[:200]}")
        response.raise_for_status()
        scores = response.json().get("scores")
        if not isinstance(scores, list) or len(scores) != len(completions):
            raise ValueError(f"{url} returned {scores!r} for {len(completions)} completions")
        return [float(s) for s in scores]

    return group


# The calling conventions of a python reward, shown in every error about one.
PER_COMPLETION_CONTRACT = "fn(prompt: str, completion: str, example: dict, **args) -> float"
PER_GROUP_CONTRACT = "fn(prompt: str, completions: list[str], example: dict, **args) -> list[float]"


@REWARDS.register("python")
def python_reward(function: str, per_group: bool = False, style: str = "auto", conversational: bool | None = None,
                  factory_args: dict[str, Any] | None = None, **kwargs: Any) -> GroupReward:
    """Your own function, named ``path/to/file.py:fn`` or ``package.module:fn``.

    A relative file path is taken from the working directory (where ``grpo run`` is started), as every other path
    in a config is (dataset.path, model folders); a module must be importable (on ``PYTHONPATH``).

    Simple style: called with keyword arguments, as ``fn(prompt=..., completion=..., example=..., **kwargs) ->
    float`` per completion, or with ``per_group: true`` as ``fn(prompt=..., completions=[...], example=...,
    **kwargs) -> list[float]``, where ``kwargs`` are this reward's other config ``args`` and ``example`` is the
    dataset row (every field of a JSONL line). Either may return :class:`generator.rewards.steps.StepScores` instead
    of a float to score a completion step by step.

    TRL style (``style: trl``, or found from the signature; generator/rewards/trl_style.py): TRL's
    ``fn(prompts, completions, completion_ids, **columns) -> list[float | None]``, called once per group
    (``conversational`` forces chat-message prompts and completions, the default takes them from the dataset).

    ``factory_args``: ``function`` names a factory (TRL's ``get_soft_overlong_punishment``); the reward is what
    ``function(**factory_args)`` returns. The signature is checked when the reward is built, so a function that
    cannot be called its way stops the run at start-up with the contract in the error.
    """
    from generator.rewards.trl_style import check_trl_function, reward_style, trl_group_reward
    from shared.user_code import check_callable, check_keyword_args, load_object

    key = f"function {function!r}"
    fn = load_object(function, key)
    if factory_args is not None:
        if not isinstance(factory_args, dict):
            raise UsageError(f"factory_args: expected a mapping of keyword arguments, got {factory_args!r}")
        check_keyword_args(fn, factory_args, f"{key} (factory_args)")
        try:
            fn = fn(**factory_args)
        except Exception as exc:  # noqa: BLE001 - the user's factory refused its arguments: named, at start-up
            raise UsageError(f"{key}(**factory_args) failed: {type(exc).__name__}: {exc}") from None
    if reward_style(fn, "simple" if per_group and style == "auto" else style, "style") == "trl":
        if per_group:
            raise UsageError("per_group applies to the simple style; a TRL-style function is always called once "
                             "per group (drop per_group, or set style: simple)")
        check_trl_function(fn, key, kwargs)
        return trl_group_reward(fn, kwargs, conversational)
    if conversational is not None:
        raise UsageError("conversational applies to TRL-style functions only (style: trl)")
    if per_group:
        check_callable(fn, key, keywords=("prompt", "completions", "example"), contract=PER_GROUP_CONTRACT,
                       extra=kwargs)

        def group(prompt: str, completions: Sequence[str], example: dict[str, Any]) -> list[Any]:
            return list(fn(prompt=prompt, completions=list(completions), example=example, **kwargs))

        group.__name__ = getattr(fn, "__name__", "python")
        return group
    check_callable(fn, key, keywords=("prompt", "completion", "example"), contract=PER_COMPLETION_CONTRACT,
                   extra=kwargs)

    def score(prompt: str, completion: str, example: dict[str, Any]) -> Any:
        return fn(prompt=prompt, completion=completion, example=example, **kwargs)

    score.__name__ = getattr(fn, "__name__", "python")
    return per_completion(score)
