"""The demonstrations of the demo's supervised warm-up: SFT batches (prompt + answer + EOS, loss on the answer),
the validation set the accuracy targets are checked on, fresh training problems that avoid it, and the flawed
teacher's answers."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

import torch

from generator.tasks.arithmetic import ArithmeticTask, Problem, format_target, sloppy_result
from generator.tasks.chain import ChainTask
from shared.config.schema import DemoConfig

Task = ArithmeticTask | ChainTask  # the built-in tasks the demo can warm the tiny model up on


def eos_id(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token_id; SFT targets and generation need one")
    return int(tokenizer.eos_token_id)


def pad_id(tokenizer) -> int:
    """Pad id, falling back to EOS (common for causal LMs); masks never rely on it being distinct."""
    return int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else eos_id(tokenizer)


def pad_sft_sequences(
    pairs: Sequence[tuple[list[int], list[int]]], pad_id: int, max_len: int | None = None,
    completion_labels: Sequence[list[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ``prompt + completion`` id lists; labels are the completion ids (or ``completion_labels``, the
    same length, -100 on tokens left out of the loss), -100 elsewhere.

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
    if completion_labels is None:
        completion_labels = [c for _, c in pairs]
    if [len(c) for _, c in pairs] != [len(c) for c in completion_labels]:
        raise ValueError("completion_labels must match the completions' lengths")
    labels = pad([torch.tensor([-100] * len(p) + list(c), dtype=torch.long)
                  for (p, _), c in zip(pairs, completion_labels)], batch_first=True, padding_value=-100)
    return input_ids, labels


def target_text(task: Task, problem: Problem) -> str:
    """The completion a perfect policy emits: ``<answer>82</answer>`` (arithmetic) or one total per line (chain)."""
    return task.target(problem) if isinstance(task, ChainTask) else format_target(problem)


Segment = tuple[str, bool]  # a piece of a target and whether it is in the loss (False: an environment's text)


def build_sft_batch(
    tokenizer, problems: Sequence[Problem], max_len: int | None = None,
    targets: Sequence[str | Sequence[Segment]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [B,T], labels [B,T])`` for prompt + target + EOS, right-padded; the targets are ``targets``
    (one per problem) or, by default, the arithmetic task's ``format_target``. A target is a string, or a list of
    ``(text, in_loss)`` segments: a multi-turn demonstration whose environment text (``in_loss`` False) the model
    reads but is not trained to write, as the learner's mask does in RL.

    Prompt and target are tokenized separately (as in RL, where completion tokens follow prompt tokens), and each
    segment on its own (as multi-turn rollouts append an observation's tokens), without automatic special tokens;
    EOS is appended explicitly. Right padding + causal attention means real tokens never attend to padding, so no
    attention mask is needed for the loss.
    """
    eos = eos_id(tokenizer)
    if targets is None:
        targets = [format_target(p) for p in problems]
    if len(targets) != len(problems):
        raise ValueError(f"{len(problems)} problems but {len(targets)} targets")
    pairs, labels = [], []
    for problem, target in zip(problems, targets):
        ids, in_loss = [], []
        for text, trained in ([(target, True)] if isinstance(target, str) else target):
            piece = tokenizer.encode(text, add_special_tokens=False)
            ids += piece
            in_loss += [trained] * len(piece)
        ids.append(eos)
        in_loss.append(True)
        pairs.append((tokenizer.encode(problem.prompt, add_special_tokens=False), ids))
        labels.append([i if trained else -100 for i, trained in zip(ids, in_loss)])
    return pad_sft_sequences(pairs, pad_id(tokenizer), max_len, labels)


def slipped(problem: Problem) -> Problem:
    """The same problem with the answer a teacher who forgets carries, borrows and minus signs would write."""
    return replace(problem, answer=str(sloppy_result(problem.operands, problem.ops)))


def validation_problems(task: Task, cfg: DemoConfig, max_rounds: int = 100) -> list[Problem]:
    """``cfg.validation_examples`` distinct train-split problems (fixed by ``cfg.validation_seed``)."""
    rng = random.Random(cfg.validation_seed)
    chosen: dict[str, Problem] = {}
    for _ in range(max_rounds):
        if len(chosen) >= cfg.validation_examples:
            return list(chosen.values())
        for problem in task.sample(cfg.validation_examples - len(chosen), "train", rng):
            chosen.setdefault(problem.prompt, problem)
    raise ValueError(f"could not draw {cfg.validation_examples} distinct train-split problems for validation "
                     f"(got {len(chosen)}); the task is too small for this validation_examples")


def sample_excluding(task: Task, n: int, rng: random.Random, excluded: Sequence[Problem] = (),
                     max_rounds: int = 1000) -> list[Problem]:
    """``n`` train-split problems, none of them in ``excluded`` (the validation set)."""
    skip = {p.prompt for p in excluded}
    out: list[Problem] = []
    for _ in range(max_rounds):
        if len(out) >= n:
            return out
        out.extend(p for p in task.sample(n - len(out), "train", rng) if p.prompt not in skip)
    raise RuntimeError(f"could not draw {n} train-split problems outside the validation set")


def flawed_demonstrations(task: ArithmeticTask, n: int, slip: float, rng: random.Random,
                          excluded: Sequence[Problem] = ()) -> list[Problem]:
    """``n`` train-split problems (none in ``excluded``), each answered sloppily (``slipped``) with probability
    ``slip``."""
    return [slipped(p) if rng.random() < slip else p for p in sample_excluding(task, n, rng, excluded)]
