"""A short supervised warm-up so that RL on the tiny model has a signal to amplify.

A randomly initialised model never emits ``<answer>..</answer>``, so every GRPO group would get reward 0 and
zero advantage. SFT teaches the format and the arithmetic; the demo then fine-tunes on a flawed teacher so that
the RL run has accuracy left to win.

Each phase runs a fixed number of steps, or, with a target, until greedy accuracy on a validation set crosses
it (checked every few steps, the step count being a cap): where the accuracy jumps depends on the seed, the
thread count and the hardware, so a fixed step count lands the model anywhere on the jump.

Also here: batched greedy generation and accuracy, used before/after warm-up and by RL evaluations.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from operator import itemgetter

import torch

from generator.tasks.arithmetic import (
    ArithmeticTask,
    Problem,
    extract_answer,
    format_target,
    sloppy_result,
)


@dataclass
class WarmupConfig:
    """SFT settings. Defaults were measured on the default task and ``TinyModelSpec``.

    ``steps`` is the knob when no target is set: held-out accuracy rises in a sharp, seed-dependent jump once the
    model learns the units-digit table (before it, answers are right to within 10 but the last digit is chance).
    At 400 steps seeds 0-4 landed at 30/20/19/37/27% (300 steps: 21%, 500: 76% for seed 0): well inside
    (10%, 60%), so RL has both a signal and room to improve. Batch 128 learned as much per example as batch 32
    at less CPU per example; weight decay 0.1 reached the jump in roughly half the steps; lr 6e-3 and above
    learned slower. The jump's position also moves with the data order (seed 0 at 1000 steps: 99%, or 53% with
    the validation problems left out of the batches) and was reported to move with thread count and hardware,
    which is why the demo sets targets (``target_accuracy``, ``flawed_target_accuracy``) and uses the step counts
    as caps.
    """

    steps: int = 400
    batch_size: int = 128
    lr: float = 3e-3
    lr_warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    adam_betas: tuple[float, float] = (0.9, 0.98)
    grad_clip: float = 1.0
    seed: int = 0
    max_len: int = 64
    eval_size: int = 500
    eval_seed: int = 1234
    eval_max_new_tokens: int = 16
    # A second phase after the clean one: demonstrations from a flawed teacher who forgets carries and borrows
    # in a fraction ``flawed_slip`` of its answers (``sloppy_result``), at a constant ``flawed_lr``. The model
    # keeps the carry in its sampling distribution while its greedy answers copy the teacher's habit: the
    # situation GRPO with an exact reward is for (the demo's starting point; see README "What the demo shows").
    flawed_steps: int = 0
    flawed_slip: float = 0.8
    flawed_lr: float = 3e-4
    # Targets. None: run exactly ``steps`` / ``flawed_steps``. Else the phase stops at the first check (every
    # ``check_every`` / ``flawed_check_every`` steps, and at the cap) where greedy accuracy on the validation set
    # is >= ``target_accuracy`` (correct demonstrations) or <= ``flawed_target_accuracy`` (flawed teacher), and
    # raises ``WarmupTargetMissed`` if the cap comes first. The caps are ``max_steps`` (None: ``steps``) and
    # ``flawed_steps``. The first phase's cosine schedule spans ``steps`` either way and stays at its floor
    # after it, so raising the cap (the remedy a miss suggests) does not change the steps before the old cap.
    # The floor matters then: the demo uses a third of the peak (0.1 crept from 44% at step 1000 to 73% at
    # step 2150; a third reached 84% at step 1500).
    target_accuracy: float | None = None
    max_steps: int | None = None
    check_every: int = 50
    flawed_target_accuracy: float | None = None
    flawed_check_every: int = 10
    # The validation set (built only when a target is set): distinct train-split problems that no warm-up
    # batch contains. Train split, so the test split stays for ``grpo eval``; never trained on, so a check
    # measures generalisation like the held-out evaluation does, without looking at it.
    validation_size: int = 500
    validation_seed: int = 4321


class WarmupTargetMissed(RuntimeError):
    """A warm-up phase reached its step cap without reaching its accuracy target."""


@dataclass
class StopRule:
    """Ends an SFT phase once greedy accuracy on ``validation`` crosses ``target`` (``above``: >=, else <=).

    Checked after every ``every`` steps and after the cap's last step; each check is kept in ``checks`` as
    ``(steps done, accuracy)``.
    """

    phase: str  # named in the error message
    target: float
    above: bool
    every: int
    validation: Sequence[Problem]
    max_new_tokens: int = 16
    checks: list[tuple[int, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"{self.phase}: checks every {self.every} steps; need at least 1")
        if not self.validation:
            raise ValueError(f"{self.phase}: an accuracy target needs a non-empty validation set")

    def done(self, model, tokenizer, task: ArithmeticTask, steps_done: int, cap: int) -> bool:
        """Whether the phase may stop after ``steps_done`` steps (evaluates only at check steps)."""
        if steps_done % self.every and steps_done != cap:
            return False
        accuracy = greedy_accuracy(model, tokenizer, task, self.validation, self.max_new_tokens)
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


@dataclass
class GreedyEval:
    """Greedy-decoding scores on a list of problems."""

    accuracy: float
    format_rate: float  # fraction with a closed <answer>...</answer> pair, right or wrong
    n: int
    completions: list[str]


def _eos_id(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token_id; SFT targets and generation need one")
    return int(tokenizer.eos_token_id)


def _pad_id(tokenizer) -> int:
    """Pad id, falling back to EOS (common for causal LMs); masks never rely on it being distinct."""
    return int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else _eos_id(tokenizer)


def pad_sft_sequences(
    pairs: Sequence[tuple[list[int], list[int]]], pad_id: int, max_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ``prompt + completion`` id lists; labels are the completion ids, -100 elsewhere.

    The loss mask is built from the lengths, never by comparing ids with ``pad_id``: with ``pad == eos`` an
    id comparison would mask out the EOS the model must learn to emit.
    """
    if not pairs:
        raise ValueError("empty batch")
    lengths = [len(p) + len(c) for p, c in pairs]
    width = max(lengths)
    if max_len is not None and width > max_len:
        raise ValueError(f"sequence of {width} tokens exceeds max_len={max_len}; truncating would drop EOS")
    pad = torch.nn.utils.rnn.pad_sequence
    input_ids = pad([torch.tensor([*p, *c], dtype=torch.long) for p, c in pairs], batch_first=True,
                    padding_value=pad_id)
    labels = pad([torch.tensor([-100] * len(p) + list(c), dtype=torch.long) for p, c in pairs], batch_first=True,
                 padding_value=-100)
    return input_ids, labels


def build_sft_batch(
    tokenizer, problems: Sequence[Problem], max_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [B,T], labels [B,T])`` for prompt + target + EOS, right-padded.

    Prompt and target are tokenized separately (as in RL, where completion tokens follow prompt tokens) and
    without automatic special tokens; EOS is appended explicitly. Right padding + causal attention means real
    tokens never attend to padding, so no attention mask is needed for the loss.
    """
    eos = _eos_id(tokenizer)
    pairs = [
        (
            tokenizer.encode(p.prompt, add_special_tokens=False),
            tokenizer.encode(format_target(p), add_special_tokens=False) + [eos],
        )
        for p in problems
    ]
    return pad_sft_sequences(pairs, _pad_id(tokenizer), max_len)


def lr_at(step: int, cfg: WarmupConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr`` at step ``cfg.steps``, then that floor."""
    if step < cfg.lr_warmup_steps:
        return cfg.lr * (step + 1) / cfg.lr_warmup_steps
    span = max(cfg.steps - cfg.lr_warmup_steps, 1)
    progress = min((step - cfg.lr_warmup_steps) / span, 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def slipped(problem: Problem) -> Problem:
    """The same problem with the answer a teacher who forgets carries, borrows and minus signs would write."""
    return replace(problem, answer=str(sloppy_result(problem.operands, problem.ops)))


def needs_validation(cfg: WarmupConfig) -> bool:
    """Whether either phase has an accuracy target (and so a validation set)."""
    return cfg.target_accuracy is not None or (cfg.flawed_steps > 0 and cfg.flawed_target_accuracy is not None)


def validation_problems(task: ArithmeticTask, cfg: WarmupConfig, max_rounds: int = 100) -> list[Problem]:
    """``cfg.validation_size`` distinct train-split problems (fixed by ``cfg.validation_seed``)."""
    rng = random.Random(cfg.validation_seed)
    chosen: dict[str, Problem] = {}
    for _ in range(max_rounds):
        if len(chosen) >= cfg.validation_size:
            return list(chosen.values())
        for problem in task.sample(cfg.validation_size - len(chosen), "train", rng):
            chosen.setdefault(problem.prompt, problem)
    raise ValueError(f"could not draw {cfg.validation_size} distinct train-split problems for validation "
                     f"(got {len(chosen)}); the task is too small for this validation_size")


def sample_excluding(task: ArithmeticTask, n: int, rng: random.Random, excluded: Sequence[Problem] = (),
                     max_rounds: int = 1000) -> list[Problem]:
    """``n`` train-split problems, none of them in ``excluded`` (the validation set)."""
    skip = {p.prompt for p in excluded}
    out: list[Problem] = []
    for _ in range(max_rounds):
        if len(out) >= n:
            return out
        out.extend(p for p in task.sample(n - len(out), "train", rng) if p.prompt not in skip)
    raise RuntimeError(f"could not draw {n} train-split problems outside the validation set")


def clean_stop_rule(cfg: WarmupConfig, validation: Sequence[Problem]) -> StopRule | None:
    if cfg.target_accuracy is None:
        return None
    return StopRule("correct demonstrations", cfg.target_accuracy, True, cfg.check_every, validation,
                    cfg.eval_max_new_tokens)


def flawed_stop_rule(cfg: WarmupConfig, validation: Sequence[Problem]) -> StopRule | None:
    if cfg.flawed_target_accuracy is None:
        return None
    return StopRule("flawed teacher", cfg.flawed_target_accuracy, False, cfg.flawed_check_every, validation,
                    cfg.eval_max_new_tokens)


def supervised_warmup(model, tokenizer, task: ArithmeticTask, cfg: WarmupConfig,
                      validation: Sequence[Problem] = ()) -> PhaseResult:
    """Train on fresh ``train``-split batches (never a ``validation`` problem) for ``cfg.steps`` steps, or until
    ``cfg.target_accuracy`` is reached on ``validation`` (then ``cfg.max_steps``, default ``cfg.steps``, is the
    cap, and steps past ``cfg.steps`` run at the schedule's floor rate).

    Held-out problems are never sampled, so warm-up accuracy on the test split is a fair starting point.
    Leaves the model in eval mode; raises ``WarmupTargetMissed`` if a target is set and the cap comes first.
    """
    rng = random.Random(cfg.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=tuple(cfg.adam_betas), weight_decay=cfg.weight_decay
    )
    stop = clean_stop_rule(cfg, validation)
    cap = cfg.steps if stop is None or cfg.max_steps is None else cfg.max_steps
    losses = _sft_steps(model, tokenizer, task, optimizer, cfg, cap,
                        lambda: sample_excluding(task, cfg.batch_size, rng, validation),
                        lambda step: lr_at(step, cfg), stop)
    if stop is not None:
        stop.require_reached(cap)
    return PhaseResult(losses, stop.checks if stop is not None else [])


def _sft_steps(model, tokenizer, task: ArithmeticTask, optimizer, cfg: WarmupConfig, steps: int, next_problems,
               lr_for_step=None, stop: StopRule | None = None) -> list[float]:
    """Up to ``steps`` supervised steps on ``next_problems()`` batches (lr from ``lr_for_step(step)`` if given,
    else the optimizer's own), ending early when ``stop`` says so; returns the per-step losses and leaves the
    model in eval mode."""
    model.train()
    losses: list[float] = []
    for step in range(steps):
        if lr_for_step is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr_for_step(step)
        input_ids, labels = build_sft_batch(tokenizer, next_problems(), cfg.max_len)
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        losses.append(float(loss.detach()))
        if stop is not None and stop.done(model, tokenizer, task, step + 1, steps):
            break
    model.eval()
    return losses


def flawed_demonstrations(task: ArithmeticTask, n: int, slip: float, rng: random.Random,
                          excluded: Sequence[Problem] = ()) -> list[Problem]:
    """``n`` train-split problems (none in ``excluded``), each answered sloppily (``slipped``) with probability
    ``slip``."""
    return [slipped(p) if rng.random() < slip else p for p in sample_excluding(task, n, rng, excluded)]


def flawed_teacher_finetune(model, tokenizer, task: ArithmeticTask, cfg: WarmupConfig,
                            validation: Sequence[Problem] = ()) -> PhaseResult:
    """``cfg.flawed_steps`` SFT steps on a flawed teacher's demonstrations, or fewer: with
    ``cfg.flawed_target_accuracy`` set, until greedy accuracy on ``validation`` falls to it.

    Each demonstration drops its carries, borrows and minus sign (``slipped``) with probability
    ``cfg.flawed_slip``; the rest are correct. A fresh AdamW at the constant ``cfg.flawed_lr`` (a separate
    fine-tuning run, as when a pretrained model is fine-tuned on someone else's data). Only 2-operand ``+``/``-``
    tasks have a sloppy answer (``sloppy_result``). Leaves the model in eval mode; raises
    ``WarmupTargetMissed`` if a target is set and the cap comes first.
    """
    if not cfg.flawed_steps:
        return PhaseResult([], [])
    if task.num_operands != 2 or not set(task.ops) <= {"+", "-"} or task.min_value < 0:
        raise ValueError("the flawed teacher needs a task of a+b / a-b with non-negative operands")
    rng = random.Random(cfg.seed + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.flawed_lr, weight_decay=0.0)
    stop = flawed_stop_rule(cfg, validation)
    losses = _sft_steps(model, tokenizer, task, optimizer, cfg, cfg.flawed_steps,
                        lambda: flawed_demonstrations(task, cfg.batch_size, cfg.flawed_slip, rng, validation),
                        stop=stop)
    if stop is not None:
        stop.require_reached(cfg.flawed_steps)
    return PhaseResult(losses, stop.checks if stop is not None else [])


@torch.no_grad()
def generate_greedy(
    model, tokenizer, prompts: Sequence[str], max_new_tokens: int, batch_size: int = 256
) -> list[str]:
    """Greedy completions (text after the prompt, cut at EOS, special tokens dropped), batched.

    Prompts are left-padded with an attention mask and explicit position ids, so each row generates what it
    would alone (RoPE alone would tolerate shifted positions; absolute-position models would not). No KV
    cache: sequences are a few dozen tokens, and a full recompute is simple and version-proof.
    """
    if any(not p for p in prompts):
        raise ValueError("empty prompt: greedy generation needs at least one prompt token")
    was_training = model.training
    model.eval()
    eos, pad = _eos_id(tokenizer), _pad_id(tokenizer)
    out: list[str] = []
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = [
                tokenizer.encode(p, add_special_tokens=False) for p in prompts[start : start + batch_size]
            ]
            out.extend(_greedy_chunk(model, tokenizer, chunk, max_new_tokens, eos, pad))
    finally:
        model.train(was_training)
    return out


def _greedy_chunk(
    model, tokenizer, chunk: list[list[int]], max_new_tokens: int, eos: int, pad: int
) -> list[str]:
    width = max(len(ids) for ids in chunk)
    input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
    mask = torch.zeros((len(chunk), width), dtype=torch.long)
    for row, ids in enumerate(chunk):
        input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        mask[row, width - len(ids) :] = 1
    generated: list[list[int]] = [[] for _ in chunk]
    done = torch.zeros(len(chunk), dtype=torch.bool)
    for _ in range(max_new_tokens):
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits[:, -1, :]
        next_ids = logits.argmax(dim=-1)
        for row in range(len(chunk)):
            if not done[row]:
                token = int(next_ids[row])
                if token == eos:
                    done[row] = True
                else:
                    generated[row].append(token)
        if bool(done.all()):
            break
        next_ids = torch.where(done, torch.full_like(next_ids, pad), next_ids)
        input_ids = torch.cat([input_ids, next_ids[:, None]], dim=1)
        mask = torch.cat([mask, (~done).long()[:, None]], dim=1)
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in generated]


def evaluate_greedy(
    model, tokenizer, task: ArithmeticTask, problems: Sequence[Problem], max_new_tokens: int = 16
) -> GreedyEval:
    """Accuracy and format rate of greedy completions, scored with ``task.score``."""
    completions = generate_greedy(model, tokenizer, [p.prompt for p in problems], max_new_tokens)
    rewards = [task.score(p, c) for p, c in zip(problems, completions)]
    formatted = [extract_answer(c) is not None for c in completions]
    n = len(problems)
    return GreedyEval(
        accuracy=sum(rewards) / n if n else 0.0,
        format_rate=sum(formatted) / n if n else 0.0,
        n=n,
        completions=completions,
    )


def greedy_accuracy(
    model, tokenizer, task: ArithmeticTask, problems: Sequence[Problem], max_new_tokens: int = 16
) -> float:
    """Fraction of ``problems`` whose greedy completion has the right answer."""
    return evaluate_greedy(model, tokenizer, task, problems, max_new_tokens).accuracy
