"""A short supervised warm-up so that RL on the tiny model has a signal to amplify.

A randomly initialised model never emits ``<answer>..</answer>`` (or a chain of running totals), so every GRPO
group would get reward 0 and zero advantage. SFT teaches the format and the arithmetic; the demo then fine-tunes on a flawed teacher so that
the RL run has accuracy left to win.

Each phase runs a fixed number of steps, or, with a target, until greedy accuracy on a validation set crosses
it (checked every few steps, the step count being a cap): where the accuracy jumps depends on the seed, the
thread count and the hardware, so a fixed step count lands the model anywhere on the jump.

Every setting is the config's ``demo`` section (:class:`shared.config.schema.DemoConfig`, documented in
docs/config.md); the seed is the run's. The demonstrations are in :mod:`deploy.demo.sft_data`, greedy generation
and accuracy in :mod:`deploy.demo.greedy`.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from operator import itemgetter

import torch

from deploy.demo.calc_data import answer_turn_context, calculator_demonstrations
from deploy.demo.chain_data import check_flawed_chain_task, flawed_chain_demonstrations
from deploy.demo.greedy import greedy_accuracy
from deploy.demo.sft_data import Task, build_sft_batch, flawed_demonstrations, sample_excluding, target_text
from generator.tasks.arithmetic import ArithmeticTask, Problem
from generator.tasks.chain import ChainTask
from learner.schedule import lr_schedule
from shared.config.schema import DemoConfig
from shared.progress import Ticker

log = logging.getLogger("grpo.demo.warmup")

# How often a warm-up phase says how far it is: it runs for minutes on a small CPU (about 10 lines in 5 minutes).
PROGRESS_EVERY_S = 30.0


class WarmupTargetMissed(RuntimeError):
    """A warm-up phase reached its step cap without reaching its accuracy target."""


def warmup_record(cfg: DemoConfig, seed: int) -> dict:
    """The warm-up's settings as the built model's stats record them (JSON values): a model built with other
    settings is rebuilt."""
    return {"seed": seed, **cfg.model_dump(mode="json")}


@dataclass
class StopRule:
    """Ends an SFT phase once greedy accuracy on ``validation`` crosses ``target`` (``above``: >=, else <=).

    Checked after every ``every`` steps and after the cap's last step; each check is kept in ``checks`` as
    ``(steps done, accuracy)``. The greedy answers continue ``context(problem)`` when given (the calculator demo:
    the answer turn after the tool's call and result), else the problem's prompt.
    """

    phase: str  # named in the error message
    target: float
    above: bool
    every: int
    validation: Sequence[Problem]
    max_new_tokens: int = 16
    context: Callable[[Problem], str] | None = None
    checks: list[tuple[int, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"{self.phase}: checks every {self.every} steps; need at least 1")
        if not self.validation:
            raise ValueError(f"{self.phase}: an accuracy target needs a non-empty validation set")
        self.checked_problems = list(self.validation) if self.context is None else [
            replace(p, prompt=self.context(p)) for p in self.validation]

    def done(self, model, tokenizer, task: Task, steps_done: int, cap: int) -> bool:
        """Whether the phase may stop after ``steps_done`` steps (evaluates only at check steps)."""
        if steps_done % self.every and steps_done != cap:
            return False
        accuracy = greedy_accuracy(model, tokenizer, task, self.checked_problems, self.max_new_tokens)
        self.checks.append((steps_done, accuracy))
        return self.met(accuracy)

    def met(self, accuracy: float) -> bool:
        return accuracy >= self.target if self.above else accuracy <= self.target

    def require_reached(self, cap: int) -> None:
        """Raise ``WarmupTargetMissed`` unless the last check met the target."""
        if self.checks and self.met(self.checks[-1][1]):
            return
        last = self.checks[-1][1] if self.checks else float("nan")
        pick = max if self.above else min
        best_step, best = pick(self.checks, key=itemgetter(1)) if self.checks else (0, float("nan"))
        raise WarmupTargetMissed(
            f"warm-up phase '{self.phase}' stopped at its cap of {cap} steps with greedy validation accuracy "
            f"{last:.1%} (best {best:.1%} at step {best_step}); its target is {'>=' if self.above else '<='} "
            f"{self.target:.1%}. Raise the cap or relax the target.")


@dataclass
class PhaseResult:
    """What one SFT phase did: per-step losses and its validation checks (empty without a target)."""

    losses: list[float]
    checks: list[tuple[int, float]]

    @property
    def validation_accuracy(self) -> float | None:
        """Greedy validation accuracy at the last check (``None`` if the phase had no target)."""
        return self.checks[-1][1] if self.checks else None


def needs_validation(cfg: DemoConfig) -> bool:
    """Whether either phase has an accuracy target (and so a validation set)."""
    return cfg.warmup_target_accuracy is not None or (cfg.flawed_steps > 0
                                                      and cfg.flawed_target_accuracy is not None)


def clean_stop_rule(cfg: DemoConfig, validation: Sequence[Problem]) -> StopRule | None:
    """The correct demonstrations' target: greedy accuracy on ``validation``; with tool demonstrations
    (``cfg.tool_fraction`` > 0) the accuracy of the answer turn after the right call and the calculator's result,
    i.e. how well the model copies the result (a direct answer cannot call the tool, and whether the model learns to
    copy within a fixed step count depends on the machine's arithmetic: docs/calculator-demo.md)."""
    if cfg.warmup_target_accuracy is None:
        return None
    tool = cfg.tool_fraction > 0
    return StopRule("correct demonstrations" + (" (the answer copied from the calculator)" if tool else ""),
                    cfg.warmup_target_accuracy, True, cfg.warmup_check_every, validation,
                    cfg.greedy_max_new_tokens, answer_turn_context if tool else None)


def flawed_stop_rule(cfg: DemoConfig, validation: Sequence[Problem]) -> StopRule | None:
    if cfg.flawed_target_accuracy is None:
        return None
    return StopRule("flawed teacher", cfg.flawed_target_accuracy, False, cfg.flawed_check_every, validation,
                    cfg.greedy_max_new_tokens)


def warmup_lr_schedule(optimizer: torch.optim.Optimizer, cfg: DemoConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """The correct demonstrations' rate: a ramp over ``warmup_lr_ramp_steps``, then cosine decay to
    ``warmup_min_lr_ratio`` of the peak at ``warmup_steps``, then that floor (:mod:`learner.schedule`)."""
    return lr_schedule(optimizer, schedule="cosine", warmup_steps=cfg.warmup_lr_ramp_steps,
                       max_steps=cfg.warmup_steps, min_lr_ratio=cfg.warmup_min_lr_ratio)


def supervised_warmup(model, tokenizer, task: Task, cfg: DemoConfig, seed: int,
                      validation: Sequence[Problem] = ()) -> PhaseResult:
    """Train on fresh ``train``-split batches (never a ``validation`` problem) for ``cfg.warmup_steps`` steps, or
    until ``cfg.warmup_target_accuracy`` is reached on ``validation`` (then ``cfg.warmup_max_steps`` is the cap, and
    steps past ``cfg.warmup_steps`` run at the schedule's floor rate).

    Held-out problems are never sampled, so warm-up accuracy on the test split is a fair starting point.
    Leaves the model in eval mode; raises ``WarmupTargetMissed`` if a target is set and the cap comes first.
    """
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.warmup_lr, betas=tuple(cfg.warmup_adam_betas),
                                  weight_decay=cfg.warmup_weight_decay)
    stop = clean_stop_rule(cfg, validation)
    cap = cfg.warmup_steps if stop is None else cfg.warmup_max_steps

    def correct_batch() -> tuple[list[Problem], list]:
        if cfg.tool_fraction > 0:  # the calculator demo (deploy.demo.calc_data)
            return calculator_demonstrations(task, cfg.batch_size, cfg.tool_fraction, rng, validation)
        problems = sample_excluding(task, cfg.batch_size, rng, validation)
        return problems, [target_text(task, p) for p in problems]

    losses = _sft_steps(model, tokenizer, task, optimizer, cfg, cap, correct_batch,
                        warmup_lr_schedule(optimizer, cfg), stop, phase="correct demonstrations")
    if stop is not None:
        stop.require_reached(cap)
    return PhaseResult(losses, stop.checks if stop is not None else [])


def _sft_steps(model, tokenizer, task: Task, optimizer, cfg: DemoConfig, steps: int,
               next_batch: Callable[[], tuple[list[Problem], list]], scheduler=None,
               stop: StopRule | None = None, phase: str = "supervised") -> list[float]:
    """Up to ``steps`` supervised steps on ``next_batch()`` batches (problems and their targets, strings or
    segments as :func:`deploy.demo.sft_data.build_sft_batch` takes them; the rate stepped by
    ``scheduler`` if given, else the optimizer's own), ending early when ``stop`` says so; returns the per-step
    losses and leaves the model in eval mode. Says how far it is every :data:`PROGRESS_EVERY_S` seconds (logger
    ``grpo.demo.warmup``): steps of the cap, the loss, the last validation check."""
    model.train()
    losses: list[float] = []
    ticker = Ticker(f"warm-up ({phase})", steps, log.info, every_s=PROGRESS_EVERY_S, unit="steps",
                    bounded=stop is not None)
    for step in range(steps):
        problems, targets = next_batch()
        input_ids, labels = build_sft_batch(tokenizer, problems, cfg.max_sequence_tokens, targets)
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(float(loss.detach()))
        done = stop is not None and stop.done(model, tokenizer, task, step + 1, steps)
        ticker.update(step + 1, _phase_detail(losses, stop), finished=done)
        if done:
            break
    model.eval()
    return losses


def _phase_detail(losses: list[float], stop: StopRule | None) -> str:
    """``loss 0.412, validation accuracy 63.0% at step 400 (target >= 80.0%)``: the mean loss of the last steps and
    the last accuracy check."""
    recent = losses[-20:]
    text = f"loss {sum(recent) / len(recent):.3f}"
    if stop is not None and stop.checks:
        at, accuracy = stop.checks[-1]
        text += (f", validation accuracy {accuracy:.1%} at step {at} (target {'>=' if stop.above else '<='} "
                 f"{stop.target:.1%})")
    return text


def flawed_teacher_finetune(model, tokenizer, task: Task, cfg: DemoConfig, seed: int,
                            validation: Sequence[Problem] = ()) -> PhaseResult:
    """``cfg.flawed_steps`` SFT steps on a flawed teacher's demonstrations, or fewer: with
    ``cfg.flawed_target_accuracy`` set, until greedy accuracy on ``validation`` falls to it.

    Arithmetic: each demonstration drops its carries, borrows and minus sign (``slipped``) with probability
    ``cfg.flawed_slip``; the rest are correct; only 2-operand ``+``/``-`` tasks have a sloppy answer
    (``sloppy_result``). Chain: with that probability the teacher slips in the intermediate lines only
    (``deploy.demo.chain_data.sloppy_chain``). A fresh AdamW at the constant ``cfg.flawed_lr`` (a separate
    fine-tuning run, as when a pretrained model is fine-tuned on someone else's data). Leaves the model in eval
    mode; raises ``WarmupTargetMissed`` if a target is set and the cap comes first.
    """
    if not cfg.flawed_steps:
        return PhaseResult([], [])
    rng = random.Random(seed + 1)
    next_batch = _flawed_batches(task, cfg, rng, validation)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.flawed_lr, weight_decay=0.0)
    stop = flawed_stop_rule(cfg, validation)
    losses = _sft_steps(model, tokenizer, task, optimizer, cfg, cfg.flawed_steps, next_batch, stop=stop,
                        phase="flawed teacher")
    if stop is not None:
        stop.require_reached(cfg.flawed_steps)
    return PhaseResult(losses, stop.checks if stop is not None else [])


def _flawed_batches(task: Task, cfg: DemoConfig, rng: random.Random, validation: Sequence[Problem]
                    ) -> Callable[[], tuple[list[Problem], list[str]]]:
    """The flawed teacher's batches for ``task`` (problems never in ``validation``, with the teacher's targets)."""
    if isinstance(task, ChainTask):
        check_flawed_chain_task(task)

        def chain_batch() -> tuple[list[Problem], list[str]]:
            problems = sample_excluding(task, cfg.batch_size, rng, validation)
            return problems, flawed_chain_demonstrations(task, problems, cfg.flawed_slip, rng)

        return chain_batch
    if not isinstance(task, ArithmeticTask) or task.num_operands != 2 or not set(task.ops) <= {"+", "-"} \
            or task.min_value < 0:
        raise ValueError("the flawed teacher needs a task of a+b / a-b with non-negative operands")

    def arithmetic_batch() -> tuple[list[Problem], list[str]]:
        problems = flawed_demonstrations(task, cfg.batch_size, cfg.flawed_slip, rng, validation)
        return problems, [target_text(task, p) for p in problems]

    return arithmetic_batch
