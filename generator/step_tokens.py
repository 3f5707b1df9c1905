"""Step rewards from the text to the tokens: where each step ends among a completion's tokens, engine-independent.

The rewards see ``text = decode(token_ids)`` (``tokenizer.decode(ids, skip_special_tokens=True)``, as
:meth:`generator.loop.RolloutLoop.build_group` decodes). A step ending at exclusive character offset ``c`` ends at
the token holding character ``c - 1``: the smallest ``k`` whose decoded prefix ``decode(token_ids[:k + 1])`` starts
with ``text[:c]``. Decoded prefixes are the tokenizer's own account of which characters a token completes, so this is
exact where offsets are not: byte-level BPE splitting one UTF-8 character over several tokens (the prefix ends in
U+FFFD until the character's last byte), SentencePiece's leading-space marker, special tokens skipped mid-text (they
complete no character). A binary search per step, from the previous step's token on, keeps it to
``O(steps * log(tokens))`` decodes; it keeps the invariant "the prefix before ``lo`` does not cover ``c``", so its
answer ``k`` always satisfies "``k + 1`` tokens cover ``c`` characters, ``k`` tokens do not". Where every decoded
prefix is a prefix of the text (any valid text) that ``k`` is unique. A sampled completion can hold an invalid byte
sequence, and a byte-fallback decoder (Llama's) then garbles a whole prefix that ends inside it (``C2 80 00 C2``
decodes to four U+FFFD although ``C2 80 00`` decodes to two characters): prefixes stop being monotone there, and
the answer is one of the tokens where coverage begins, which still satisfies the definition above.

How the outcome joins the steps (``generator.step_rewards``, shared/config/schema/generator.py) is
:func:`with_outcome`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shared.config.schema.generator import StepRewardsConfig

log = logging.getLogger("grpo.generator.steps")

Decode = Callable[[Sequence[int]], str]
TokenSteps = list[tuple[int, float]]   # (0-based index of the step's last token, reward)


def tokenizer_decode(tokenizer) -> Decode:
    """The decode the rewards' text comes from."""
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)


def char_ends_to_tokens(decode: Decode, token_ids: Sequence[int], char_ends: Sequence[int],
                        text: str | None = None) -> list[int]:
    """For each exclusive character end ``c`` (increasing, in ``1..len(text)``), the index of the token holding
    character ``c - 1`` of ``text = decode(token_ids)``."""
    ids = list(token_ids)
    text = decode(ids) if text is None else text
    prefixes: dict[int, str] = {len(ids): text}

    def covers(k: int, c: int) -> bool:   # the first k + 1 tokens decode to at least text[:c]
        if k + 1 not in prefixes:
            prefixes[k + 1] = decode(ids[:k + 1])
        return prefixes[k + 1].startswith(text[:c])

    out, lo, previous = [], 0, 0
    for c in char_ends:
        if not previous < c <= len(text):
            raise ValueError(f"step end {c} is not in {previous + 1}..{len(text)} (ends must increase and stay "
                             f"inside the {len(text)}-character text)")
        hi = len(ids) - 1   # covers(hi, c): the whole decode is text
        while lo < hi:
            mid = (lo + hi) // 2
            if covers(mid, c):
                hi = mid
            else:
                lo = mid + 1
        out.append(lo)
        previous = c
    return out


def merge_same_token(token_ends: Sequence[int], rewards: Sequence[float]) -> TokenSteps:
    """Steps whose ends fall in the same token (a step ending mid-token followed by one ending in it) become one
    step there with their rewards summed: every token up to that end would have received both anyway."""
    steps: TokenSteps = []
    for end, reward in zip(token_ends, rewards):
        if steps and steps[-1][0] == end:
            steps[-1] = (end, steps[-1][1] + reward)
        else:
            steps.append((end, float(reward)))
    return steps


def with_outcome(steps: TokenSteps, outcome: float, num_tokens: int, config: StepRewardsConfig) -> TokenSteps:
    """``final_step``: ``outcome_weight * outcome`` is added to the step ending at the last token, appended when no
    step ends there (also for a completion without steps); ``none``: the steps as they are."""
    if config.outcome == "none" or num_tokens == 0:
        return list(steps)
    last, extra = num_tokens - 1, config.outcome_weight * outcome
    if steps and steps[-1][0] == last:
        return [*steps[:-1], (last, steps[-1][1] + extra)]
    return [*steps, (last, extra)]


@dataclass
class GroupTokenSteps:
    steps: list[TokenSteps]   # per completion, ready for RolloutGroup.from_samples(steps=...)
    errors: int               # completions whose step ends could not be mapped (they carry no steps)


def group_token_steps(decode: Decode, token_ids: Sequence[Sequence[int]], texts: Sequence[str],
                      char_steps: Sequence[Sequence[tuple[int, float]] | None], outcomes: Sequence[float],
                      config: StepRewardsConfig) -> GroupTokenSteps:
    """A process-supervised group's token steps: each completion's character steps mapped to tokens and joined with
    its outcome total. ``char_steps[i] is None`` (its step reward failed) gives no steps at all, outcome included."""
    steps: list[TokenSteps] = []
    errors = 0
    for i, (ids, text, found) in enumerate(zip(token_ids, texts, char_steps)):
        if found is None:
            steps.append([])
            continue
        try:
            ends = char_ends_to_tokens(decode, ids, [c for c, _ in found], text)
        except ValueError as exc:
            log.warning("completion %d: cannot place its steps on tokens (%s); it carries no steps", i, exc)
            errors += 1
            steps.append([])
            continue
        steps.append(with_outcome(merge_same_token(ends, [r for _, r in found]), outcomes[i], len(ids), config))
    return GroupTokenSteps(steps, errors)
