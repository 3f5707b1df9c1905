"""Batched greedy generation and accuracy on the built-in tasks' problems (arithmetic, chain): the warm-up's validation checks and the tiny
model's held-out measurements before and after each phase."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deploy.demo.chain_data import chain_formatted
from deploy.demo.sft_data import Task, eos_id, pad_id
from generator.tasks.arithmetic import Problem, extract_answer
from generator.tasks.chain import ChainTask


@dataclass
class GreedyEval:
    """Greedy-decoding scores on a list of problems."""

    accuracy: float
    format_rate: float  # fraction in the task's form, right or wrong: a closed <answer>...</answer> pair (arithmetic),
    # one integer per line, as many lines as steps (chain)
    n: int
    completions: list[str]


@torch.no_grad()
def generate_greedy(
    model, tokenizer, prompts: Sequence[str], max_new_tokens: int, batch_size: int = 256
) -> list[str]:
    """Greedy completions (text after the prompt, cut at EOS, special tokens dropped), batched.

    Prompts are left-padded with an attention mask and explicit position ids, so each row generates what it
    would alone (RoPE alone would tolerate shifted positions; absolute-position models would not). The prompt is
    run once and each new token attends to the KV cache (the model's own ``past_key_values``): a full recompute per
    token cost ~8x the forward work at these lengths, and the warm-up runs dozens of validation checks.
    """
    if any(not p for p in prompts):
        raise ValueError("empty prompt: greedy generation needs at least one prompt token")
    was_training = model.training
    model.eval()
    eos, pad = eos_id(tokenizer), pad_id(tokenizer)
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
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    step_ids, past = input_ids, None
    for _ in range(max_new_tokens):
        out = model(input_ids=step_ids, attention_mask=mask, position_ids=positions, past_key_values=past,
                    use_cache=True)
        past = out.past_key_values
        next_ids = out.logits[:, -1, :].argmax(dim=-1)
        for row in range(len(chunk)):
            if not done[row]:
                token = int(next_ids[row])
                if token == eos:
                    done[row] = True
                else:
                    generated[row].append(token)
        if bool(done.all()):
            break
        # a finished row goes on with padding that nothing attends to (mask 0), so the batch keeps its shape
        step_ids = torch.where(done, torch.full_like(next_ids, pad), next_ids)[:, None]
        positions = mask.sum(dim=1, keepdim=True)  # the new token's position: the real tokens before it
        mask = torch.cat([mask, (~done).long()[:, None]], dim=1)
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in generated]


def evaluate_greedy(
    model, tokenizer, task: Task, problems: Sequence[Problem], max_new_tokens: int = 16
) -> GreedyEval:
    """Accuracy and format rate of greedy completions, scored with ``task.score``."""
    completions = generate_greedy(model, tokenizer, [p.prompt for p in problems], max_new_tokens)
    rewards = [task.score(p, c) for p, c in zip(problems, completions)]
    if isinstance(task, ChainTask):
        formatted = [chain_formatted(task, c) for c in completions]
    else:
        formatted = [extract_answer(c) is not None for c in completions]
    n = len(problems)
    return GreedyEval(
        accuracy=sum(rewards) / n if n else 0.0,
        format_rate=sum(formatted) / n if n else 0.0,
        n=n,
        completions=completions,
    )


def greedy_accuracy(
    model, tokenizer, task: Task, problems: Sequence[Problem], max_new_tokens: int = 16
) -> float:
    """Fraction of ``problems`` whose greedy completion has the right answer."""
    return evaluate_greedy(model, tokenizer, task, problems, max_new_tokens).accuracy
