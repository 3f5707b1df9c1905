"""Numbers checked in the dtype and range their consumer uses, where they enter (uploads, the spool, the generator).

A float field crosses the wire in whatever float dtype its sender chose (F64, F32, F16, BF16), but every consumer
computes in float32: a train batch holds float32, the learner's advantages and losses read it. A float64 1e300 (or
1e39) is finite where it arrives and inf once cast, and a check done before the cast lets it through to crash the
learner. So every float is checked *after* conversion to float32, and values with a known range (log-probabilities)
against that range too. Token ids are checked against the model's vocabulary when the checker knows it, and are never
negative. Each refusal is a :class:`shared.protocol.errors.ProtocolError` naming the field and the entry, short (one
number, never the whole input), fit for a 4xx answer.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from shared.protocol.errors import ProtocolError
from shared.protocol.float32 import FLOAT32_OVERFLOW, finite_float32  # noqa: F401 - re-exported: one home, torch-free
from shared.tensors.masks import completion_mask

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
# A sampled token had a probability > 0 in the sampler's dtype: > e^-104 in float32, > e^-745 in float64. Far below
# that is not a log-probability but garbage (which would overflow the learner's sums); -1e4 leaves room for engines
# that report logprobs under another temperature than they sampled with.
MIN_LOGPROB = -1e4
# log p <= 0, up to rounding: a probability normalised in bfloat16 can come out as 1.0078 (log: 0.0078).
MAX_LOGPROB = 0.01


def as_float32(name: str, values: torch.Tensor, *, low: float = -math.inf, high: float = math.inf,
               mask: torch.Tensor | None = None) -> torch.Tensor:
    """``values`` as float32, after checking that every entry (every entry where ``mask`` is True) is finite in
    float32 and within ``[low, high]``; else a ProtocolError naming ``name`` and the first bad entry."""
    if not values.is_floating_point():
        raise ProtocolError(f"{name} must be a floating-point tensor, got {values.dtype}")
    as32 = values.float()
    good = torch.isfinite(as32) & (as32 >= low) & (as32 <= high)
    if mask is not None:
        good |= ~mask
    bad = (~good).nonzero()
    if bad.numel():
        where = tuple(int(i) for i in bad[0])
        value = float(values[where])
        problem = ("is not a finite float32 (the dtype the learner uses)" if not math.isfinite(float(as32[where]))
                   else f"is outside [{low:g}, {high:g}]")
        raise ProtocolError(f"{name}{list(where)} = {value:.6g} {problem}")
    return as32


def check_logprobs(name: str, values: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Log-probabilities: finite in float32 and in ``[MIN_LOGPROB, MAX_LOGPROB]`` where ``mask`` is True."""
    return as_float32(name, values, low=MIN_LOGPROB, high=MAX_LOGPROB, mask=mask)


def check_token_ids(name: str, ids: torch.Tensor, vocab_size: int | None) -> None:
    """Token ids: an integer tensor, every entry >= 0 and (when ``vocab_size`` is known) < ``vocab_size``."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ProtocolError(f"{name} must be an integer tensor, got {ids.dtype}")
    if not ids.numel():
        return
    high = vocab_size if vocab_size is not None else None
    low_bad = int(ids.min()) < 0
    high_bad = high is not None and int(ids.max()) >= high
    if low_bad or high_bad:
        bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise ProtocolError(f"{name}: token ids must be in {bound}, got {int(ids.min() if low_bad else ids.max())}")


def batch_problem(batch: Any, vocab_size: int | None) -> str | None:
    """What in a decoded :class:`shared.protocol.records.TrainBatch` the learner cannot train on (token ids outside
    its vocabulary, floats not finite in float32 where they count), or None. The hub checks every group at upload;
    this is the consumer's own check, for what the hub could not know (its vocabulary) or a hub of another version."""
    try:
        check_token_ids("input_ids", batch.input_ids, vocab_size)
        as_float32("rewards", batch.rewards)
        for name in ("behaviour_logprobs", "ref_logprobs", "teacher_logprobs"):
            values = getattr(batch, name)
            if values is not None:   # [B, L]: only the completion tokens count, padding means nothing
                valid = completion_mask(batch.completion_lengths.reshape(-1), values.shape[-1])
                as_float32(name, values, mask=valid if valid.shape == values.shape else None)
        if getattr(batch, "teacher_topk_ids", None) is not None:  # top-k distillation: ids in the vocabulary
            from shared.protocol.teacher_topk import topk_problem

            topk_problem(batch, vocab_size)
        if batch.step_rewards is not None:
            as_float32("step_rewards", batch.step_rewards)
        if batch.completion_mask is not None:  # multi-turn: aligned with the completion tokens
            from shared.protocol.loss_mask import check_mask

            check_mask(batch.completion_mask, batch.behaviour_logprobs, batch.completion_lengths)
        if batch.token_versions is not None:  # continuous generation: no token older than its row's version
            from shared.protocol.token_versions import check_versions

            check_versions(batch.token_versions, batch.completion_lengths, batch.policy_versions,
                           tuple(batch.behaviour_logprobs.shape))
    except ProtocolError as exc:
        return str(exc)
    return None
