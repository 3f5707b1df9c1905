"""The configured rewards combined: a weighted outcome total, per-reward components, step rewards; errors contained.

:meth:`RewardSet.score_group` scores a group with every term. Per completion and term the value is a float (an
outcome score) or a :class:`StepScores`:

* **Outcome total** (``GroupScores.total``): ``sum_terms weight * outcome``, where a StepScores' outcome is its
  ``outcome`` field, and 0 when it gives none (its steps then carry all its signal). ``components`` keeps each
  term's unweighted outcome. The total is always present (metrics, outcome-supervised training).
* **Steps** (``GroupScores.steps``): ``None`` when no term scored steps for the group (an outcome-only group, which
  pays nothing for steps). Otherwise one entry per completion: a list of ``(character end, reward)`` where the
  reward is ``weight * r`` summed over the terms that scored that completion's steps; ``[]`` when no term gave it
  steps; ``None`` when its step reward failed (it then carries no steps at all, counted in ``step_errors``).
* **Not applicable** (``GroupScores.not_applicable``): a TRL-style python reward (generator/rewards/trl_style.py)
  may return ``None`` for a completion. That completion gets no value from the term: its component is 0.0 and it
  adds nothing to the total (TRL's ``nansum``), it is no failure, and means over a term's values leave it out
  (:meth:`GroupScores.applicable`).
* **Two step terms** on one completion must locate the same steps (the same character ends, e.g. both split on
  ``"\\n\\n"``); their weighted rewards are then summed step by step. Different boundaries have no meaningful sum:
  that completion's steps are dropped with a logged error and counted (its outcome scores are kept).

Containment (a reward's failure never leaves :meth:`RewardSet.score_group`): an exception for the whole group scores every completion
``on_error``; a value that is not finite in float32 once weighted (NaN, inf, 1e39: the group carries float32, where
1e39 is inf) or unconvertible, or a StepScores that does not fit its completion (a separator
splitting the text into a different number of steps than the rewards, an end past the text), scores that completion
``on_error``; both are counted in ``errors``. When a term that has scored steps before fails on a completion, that
completion's steps are dropped too (its process signal is unknown, and a partial sum would be wrong). A total or a
summed step reward that overflows float32 although each term fitted is scored like a failure of every term there
(``on_error`` each, counted under ``"total"``; the steps dropped), so that the group can still be uploaded.

Containment has one limit: a term that fails on most completions (a wrong field name, a bug) would train the model
on ``on_error`` alone. ``GroupScores.failures`` says, per term and completion, what failed (a
:class:`~generator.failures.Failure`, with its file:line) and the generator's :class:`~generator.failures.FailureRule`
stops the run when a term fails too often. A :class:`~generator.rewards.base.ServiceDown` (a PRM or HTTP reward that
does not answer) is not contained: it leaves :meth:`RewardSet.score_group`, and the generator waits for the service.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from generator.failures import CallHung, Failure, ServiceDown, call_within
from generator.rewards.base import REWARDS, GroupReward, RewardConfigError, Score, as_score, takes_token_ids
from generator.rewards.steps import StepScores
from generator.rewards.trl_style import RewardContext
from shared.errors import UsageError
from shared.protocol.float32 import finite_float32

log = logging.getLogger("grpo.generator.rewards")

USER_TIMEOUT_S = 300.0   # a python reward's time limit per group call when its timeout_s is not set
CharSteps = list[tuple[int, float]]   # (exclusive character end, reward) per step of one completion


@dataclass
class RewardTerm:
    name: str
    fn: GroupReward
    weight: float
    on_error: float
    gives_steps: bool = False   # set once the term has returned a StepScores: its failures then drop steps
    gives_outcome: bool = False  # set once it has returned an outcome (a number, or a StepScores' outcome)
    timeout_s: float | None = None  # wall-clock limit of one call (None: none; RewardSpec.timeout_s)


@dataclass
class GroupScores:
    total: list[float]                    # weighted outcome sum per completion
    components: dict[str, list[float]]    # reward name -> unweighted outcome per completion
    # reward name (every term; "total" when a weighted sum overflowed) -> per completion what failed, None: scored
    failures: dict[str, list[Failure | None]]
    steps: list[CharSteps | None] | None = None   # see the module docstring; None: an outcome-only group
    step_errors: int = 0                  # completions whose steps were dropped (a failed step reward, a mismatch)
    # reward name -> per completion whether it returned None ("not applicable", TRL-style rewards); names of terms
    # that gave a value everywhere left out. Such a completion's component is 0.0 (no share of the total).
    not_applicable: dict[str, list[bool]] = field(default_factory=dict)

    def applicable(self, name: str) -> list[bool]:
        """Per completion, whether reward ``name`` gave it a value (for means that leave "not applicable" out)."""
        skipped = self.not_applicable.get(name)
        return [True] * len(self.total) if skipped is None else [not s for s in skipped]

    @property
    def errors(self) -> dict[str, int]:
        """Reward name -> completions scored with its on_error (names with none left out)."""
        counts = {name: sum(f is not None for f in failed) for name, failed in self.failures.items()}
        return {name: count for name, count in counts.items() if count}


@dataclass
class _TermSteps:
    """What the terms gave one group's completions: per completion, term name -> (character ends, weighted
    rewards); which completions lost their steps; whether any term scored steps."""

    parts: list[dict[str, tuple[list[int], list[float]]]]
    failed: list[bool]
    any_steps: bool = False


def merge_term_steps(parts: dict[str, tuple[list[int], list[float]]]) -> CharSteps:
    """One completion's steps from every term that scored them: the same character ends required, rewards summed."""
    if not parts:
        return []
    (first, (ends, rewards)), *others = parts.items()
    summed = list(rewards)
    for name, (other_ends, other_rewards) in others:
        if other_ends != ends:
            raise ValueError(f"step rewards {first!r} and {name!r} locate different steps (character ends {ends} "
                             f"vs {other_ends}); two step rewards are summed only when their steps agree")
        summed = [a + b for a, b in zip(summed, other_rewards)]
    if not all(finite_float32(r) for r in summed):
        raise ValueError(f"summed step rewards {summed} are not finite in float32")
    return list(zip(ends, summed))


class RewardSet:
    """The configured rewards; ``score_group`` gives totals, per-reward values and steps, errors contained."""

    def __init__(self, terms: list[RewardTerm], max_steps: int | None = None) -> None:
        names = [t.name for t in terms]
        if len(set(names)) != len(names):
            raise RewardConfigError(f"reward names must be unique, got {names} (use 'label' to tell two apart)")
        self.terms = terms
        # TRL-style terms' trainer_state and log_metric (generator/rewards/trl_style.py), one for the set: the
        # loop sets trainer_state.global_step to the version it serves
        self.context = RewardContext(max_steps)
        for term in terms:
            if isinstance(getattr(term.fn, "context", None), RewardContext):
                term.fn.context = self.context

    @classmethod
    def from_specs(cls, specs: Sequence[Any], max_steps: int | None = None) -> RewardSet:
        """From config entries with ``name``, ``label``, ``weight``, ``on_error`` and ``args`` (``max_steps``:
        ``learner.max_steps``, what TRL-style rewards read as ``trainer_state.max_steps``)."""
        return cls([cls.build_term(spec, i) for i, spec in enumerate(specs)], max_steps)

    @staticmethod
    def build_term(spec: Any, index: int) -> RewardTerm:
        """The term of config entry ``generator.rewards[index]``; a RewardConfigError naming it when its factory
        refuses its arguments (or, for a python reward, its function)."""
        factory = REWARDS.get(spec.name)
        try:
            fn = factory(**spec.args)
        except TypeError as exc:
            raise RewardConfigError(f"generator.rewards[{index}] ({spec.name}): bad arguments {spec.args}: "
                                    f"{exc}") from None
        except UsageError as exc:
            raise RewardConfigError(f"generator.rewards[{index}] ({spec.name}): {exc}") from None
        timeout_s = spec.timeout_s if spec.timeout_s is not None else USER_TIMEOUT_S if spec.name == "python" else 0
        return RewardTerm(spec.label or spec.name, fn, spec.weight, spec.on_error, timeout_s=timeout_s or None)

    def score_group(self, prompt: str, completions: Sequence[str], example: dict[str, Any],
                    completion_ids: Sequence[Sequence[int]] | None = None) -> GroupScores:
        """Every term's values for the group (``completion_ids``: the completions' token ids, for TRL-style
        rewards, which may ask for them)."""
        n = len(completions)
        total = [0.0] * n
        components: dict[str, list[float]] = {}
        failures: dict[str, list[Failure | None]] = {}
        not_applicable: dict[str, list[bool]] = {}
        found = _TermSteps(parts=[{} for _ in range(n)], failed=[False] * n)
        for term in self.terms:
            values, failures[term.name] = self._safe(term, prompt, completions, example, completion_ids)
            if any(v is None for v in values):   # TRL's None: no value from this term, no failure
                not_applicable[term.name] = [v is None for v in values]
                values = [0.0 if v is None else v for v in values]
            term.gives_steps = term.gives_steps or any(isinstance(v, StepScores) for v in values)
            term.gives_outcome = term.gives_outcome or any(
                (v.outcome is not None) if isinstance(v, StepScores) else not math.isnan(v) for v in values)
            outcomes = [self._outcome(term, i, v, completions[i], found, failures[term.name])
                        for i, v in enumerate(values)]
            components[term.name] = outcomes
            total = [t + term.weight * v for t, v in zip(total, outcomes)]
        self._contain_overflow(total, found, failures)
        if not found.any_steps:
            return GroupScores(total, components, failures, not_applicable=not_applicable)
        steps: list[CharSteps | None] = []
        for i in range(n):
            merged = None
            if not found.failed[i]:
                try:
                    merged = merge_term_steps(found.parts[i])
                except ValueError as exc:
                    log.warning("completion %d: %s; it carries no steps", i, exc)
            steps.append(merged)
        return GroupScores(total, components, failures, steps, sum(s is None for s in steps), not_applicable)

    def _contain_overflow(self, total: list[float], found: _TermSteps,
                          failures: dict[str, list[Failure | None]]) -> None:
        """Totals that overflow float32 (each term fitted, their sum does not): ``on_error`` of every term, counted
        under ``"total"``, the completion's steps dropped."""
        for i, value in enumerate(total):
            if not finite_float32(value):
                total[i] = sum(term.weight * term.on_error for term in self.terms)
                log.warning("completion %d: the weighted total %.6g is not finite in float32; scoring it %s with no "
                            "steps", i, value, total[i])
                failures.setdefault("total", [None] * len(total))[i] = Failure(
                    f"the weighted total {value:.6g} is not finite in float32")
                found.failed[i] = True

    @staticmethod
    def _outcome(term: RewardTerm, i: int, value: Score, text: str, found: _TermSteps,
                 failed: list[Failure | None]) -> float:
        """The term's outcome for completion ``i``; records its steps (or their failure) in ``found``."""
        if not isinstance(value, StepScores):
            if math.isnan(value) and term.gives_steps:
                found.failed[i] = True   # a step reward that failed here: its steps are unknown
            found.any_steps = found.any_steps or term.gives_steps
            return term.on_error if math.isnan(value) else value
        found.any_steps = True
        try:
            ends = value.char_ends(text)
        except ValueError as exc:
            log.warning("reward %r: bad step scores for completion %d (%s); scoring it %s with no steps",
                        term.name, i, exc, term.on_error)
            failed[i] = Failure(f"bad step scores: {exc}")
            found.failed[i] = True
            return term.on_error
        found.parts[i][term.name] = (ends, [term.weight * r for r in value.rewards])
        return 0.0 if value.outcome is None else float(value.outcome)

    @staticmethod
    def _safe(term: RewardTerm, prompt: str, completions: Sequence[str], example: dict[str, Any],
              completion_ids: Sequence[Sequence[int]] | None = None) -> tuple[list[Score | None], list[Failure | None]]:
        """The term's values, one per completion, a failed one NaN, None where a TRL-style term said "not
        applicable"; and per completion what failed (None: it scored or did not apply). A ServiceDown is not
        contained."""
        n = len(completions)
        with_ids = takes_token_ids(term.fn)
        try:
            raw = list(call_within(lambda: term.fn(prompt, completions, example, completion_ids) if with_ids
                                   else term.fn(prompt, completions, example), term.timeout_s,
                                   f"the reward's timeout_s (generator.rewards '{term.name}')"))
            if len(raw) != n:
                raise ValueError(f"returned {len(raw)} values for {n} completions")
        except ServiceDown:
            raise
        except (Exception, CallHung) as exc:  # noqa: BLE001 - a reward must never take the generator down
            log.warning("reward %r failed on a group (%s: %s); scoring it %s", term.name, type(exc).__name__,
                        exc, term.on_error)
            return [math.nan] * n, [exc.failure if isinstance(exc, CallHung) else Failure.of(exc)] * n
        # per_completion's lift says what raised on each completion; otherwise the value itself was the failure
        raised = getattr(term.fn, "failures", None)
        raised = raised if isinstance(raised, list) and len(raised) == n else [None] * n
        values: list[Score | None] = []
        failures: list[Failure | None] = []
        for value, error in zip(raw, raised):
            if value is None and with_ids:
                values.append(None)
                failures.append(None)
                continue
            try:
                score = as_score(value)
            except (TypeError, ValueError):
                score, error = math.nan, error or Failure(f"returned {value!r}, not a number")
            if error is None and not _fits_float32(term.weight, score):
                error = Failure(f"returned {value!r}, not finite in float32 once weighted by {term.weight}")
            values.append(math.nan if error is not None else score)
            failures.append(error)
        if any(failures):
            log.warning("reward %r failed or was not finite in float32 (weighted) for %d completions; scoring them %s",
                        term.name, sum(f is not None for f in failures), term.on_error)
        return values, failures


def _fits_float32(weight: float, value: Score) -> bool:
    """Whether a term's value, weighted, is finite in float32 (the dtype of a group's rewards and step rewards): a
    float, or a StepScores' every step reward and outcome."""
    if not isinstance(value, StepScores):
        return finite_float32(value) and finite_float32(weight * value)
    numbers = [*value.rewards, *([] if value.outcome is None else [float(value.outcome)])]
    return all(finite_float32(x) and finite_float32(weight * x) for x in numbers)
