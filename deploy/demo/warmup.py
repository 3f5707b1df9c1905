"""A short supervised warm-up so that RL on the tiny model has a signal to amplify.

A randomly initialised model never emits ``<answer>..</answer>``, so every GRPO group would get reward 0 and
zero advantage. A few hundred SFT steps teach the format and some arithmetic, deliberately stopping well
short of mastery: the RL demo has to have accuracy left to win.

Also here: batched greedy generation and accuracy, used before/after warm-up and by RL evaluations.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

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

    ``steps`` is the knob: held-out accuracy rises in a sharp, seed-dependent jump once the model learns the
    units-digit table (before it, answers are right to within 10 but the last digit is chance). At 400 steps
    seeds 0-4 landed at 30/20/19/37/27% (300 steps: 21%, 500: 76% for seed 0): well inside (10%, 60%), so RL
    has both a signal and room to improve. Batch 128 learned as much per example as batch 32 at less CPU per
    example; weight decay 0.1 reached the jump in roughly half the steps; lr 6e-3 and above learned slower.
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
    input_ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(pairs), width), -100, dtype=torch.long)
    for row, (prompt, completion) in enumerate(pairs):
        seq = list(prompt) + list(completion)
        input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        labels[row, len(prompt) : len(seq)] = torch.tensor(list(completion), dtype=torch.long)
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
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    if step < cfg.lr_warmup_steps:
        return cfg.lr * (step + 1) / cfg.lr_warmup_steps
    span = max(cfg.steps - cfg.lr_warmup_steps, 1)
    progress = min((step - cfg.lr_warmup_steps) / span, 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def slipped(problem: Problem) -> Problem:
    """The same problem with the answer a teacher who forgets carries, borrows and minus signs would write."""
    return replace(problem, answer=str(sloppy_result(problem.operands, problem.ops)))


def supervised_warmup(model, tokenizer, task: ArithmeticTask, cfg: WarmupConfig) -> list[float]:
    """Train on fresh ``train``-split batches for ``cfg.steps`` steps; returns the per-step losses.

    Held-out problems are never sampled, so warm-up accuracy on the test split is a fair starting point.
    Leaves the model in eval mode.
    """
    rng = random.Random(cfg.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=tuple(cfg.adam_betas), weight_decay=cfg.weight_decay
    )
    return _sft_steps(model, tokenizer, optimizer, cfg, cfg.steps,
                      lambda: task.sample(cfg.batch_size, "train", rng), lambda step: lr_at(step, cfg))


def _sft_steps(model, tokenizer, optimizer, cfg: WarmupConfig, steps: int, next_problems, lr_for_step=None
               ) -> list[float]:
    """``steps`` supervised steps on ``next_problems()`` batches (lr from ``lr_for_step(step)`` if given, else the
    optimizer's own); returns the per-step losses and leaves the model in eval mode."""
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
    model.eval()
    return losses


def flawed_demonstrations(task: ArithmeticTask, n: int, slip: float, rng: random.Random) -> list[Problem]:
    """``n`` train-split problems, each answered sloppily (``slipped``) with probability ``slip``."""
    return [slipped(p) if rng.random() < slip else p for p in task.sample(n, "train", rng)]


def flawed_teacher_finetune(model, tokenizer, task: ArithmeticTask, cfg: WarmupConfig) -> list[float]:
    """``cfg.flawed_steps`` SFT steps on a flawed teacher's demonstrations; returns the per-step losses.

    Each demonstration drops its carries, borrows and minus sign (``slipped``) with probability
    ``cfg.flawed_slip``; the rest are correct. A fresh AdamW at the constant ``cfg.flawed_lr`` (a separate
    fine-tuning run, as when a pretrained model is fine-tuned on someone else's data). Only 2-operand ``+``/``-`` tasks have a sloppy
    answer (``sloppy_result``). Leaves the model in eval mode.
    """
    if not cfg.flawed_steps:
        return []
    if task.num_operands != 2 or not set(task.ops) <= {"+", "-"} or task.min_value < 0:
        raise ValueError("the flawed teacher needs a task of a+b / a-b with non-negative operands")
    rng = random.Random(cfg.seed + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.flawed_lr, weight_decay=0.0)
    return _sft_steps(model, tokenizer, optimizer, cfg, cfg.flawed_steps,
                      lambda: flawed_demonstrations(task, cfg.batch_size, cfg.flawed_slip, rng))


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
