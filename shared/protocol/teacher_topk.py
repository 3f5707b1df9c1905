"""The teacher's top-k next tokens in a train batch (top-k logit distillation, ``algorithm.distill.mode:
topk_forward_kl``): their layout, wire form and checks.

``teacher_topk_ids`` (int32) and ``teacher_topk_logprobs`` (float32) are ``[B, L, k]``, laid out like
``behaviour_logprobs`` ``[B, L]``: entry ``[i, j]`` holds the k most likely tokens (most likely first) of the
teacher's distribution that predicts row i's completion token j, and their logprobs at the batch's sampling
temperature (the teacher's logits divided by it, as the reverse-KL mode's ``teacher_logprobs`` and the student's
logprobs are). Values past a row's completion length mean nothing (the hub writes 0). Both or neither: a batch
without them (any other mode, an older hub) encodes exactly as before they existed, so older clients are unchanged.

On the wire they are the I32 tensor ``teacher_topk_ids`` and the F32 tensor ``teacher_topk_logprobs``; decoding
refuses (:class:`shared.protocol.wire.WireError`, a 4xx where a request carries it) one without the other, other
dtypes, other shapes and an empty k; :func:`topk_problem` is the learner's check of the values (ids within its
vocabulary, finite logprobs at the completion tokens).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch

from shared.protocol.errors import ProtocolError, require
from shared.protocol.wire import WireError
from shared.tensors.masks import completion_mask

IDS = "teacher_topk_ids"
LOGPROBS = "teacher_topk_logprobs"


def topk_tensors(record: Any) -> dict[str, torch.Tensor]:
    """The wire tensors of ``record``'s top-k (int32 ids, float32 logprobs): none when it has none."""
    if record.teacher_topk_ids is None:
        return {}
    return {IDS: record.teacher_topk_ids.to(torch.int32), LOGPROBS: record.teacher_topk_logprobs.float()}


def take_topk(tensors: MutableMapping[str, torch.Tensor], shape: torch.Size | tuple[int, ...]) -> dict[str, Any]:
    """The top-k out of decoded ``tensors`` (removed from it) for a batch whose ``behaviour_logprobs`` are ``shape``
    ``[B, L]``: both None when absent; :class:`WireError` naming the problem when malformed."""
    ids, logprobs = tensors.pop(IDS, None), tensors.pop(LOGPROBS, None)
    if ids is None and logprobs is None:
        return {IDS: None, LOGPROBS: None}
    if ids is None or logprobs is None:
        raise WireError(f"{IDS} and {LOGPROBS} come together: the batch holds only {IDS if ids is not None else LOGPROBS}")
    if ids.dtype != torch.int32 or logprobs.dtype != torch.float32:
        raise WireError(f"{IDS} must be int32 and {LOGPROBS} float32, got {ids.dtype} and {logprobs.dtype}")
    rows, width = tuple(shape)
    if ids.dim() != 3 or tuple(ids.shape[:2]) != (rows, width) or ids.shape[2] < 1 or ids.shape != logprobs.shape:
        raise WireError(f"{IDS} and {LOGPROBS} must both be [B, L, k] = [{rows}, {width}, k >= 1] like "
                        f"behaviour_logprobs, got {list(ids.shape)} and {list(logprobs.shape)}")
    return {IDS: ids, LOGPROBS: logprobs}


def select_topk(record: Any, rows: torch.Tensor, width: int) -> dict[str, torch.Tensor | None]:
    """``record``'s top-k of ``rows``, ``width`` completion columns wide (None stays None)."""
    if record.teacher_topk_ids is None:
        return {IDS: None, LOGPROBS: None}
    return {IDS: record.teacher_topk_ids[rows, :width], LOGPROBS: record.teacher_topk_logprobs[rows, :width]}


def topk_problem(batch: Any, vocab_size: int | None) -> None:
    """:class:`ProtocolError` when a decoded batch's top-k cannot be trained on: ids outside ``[0, vocab_size)`` or
    a logprob not finite (or above 0) at a completion token (padding is not read)."""
    ids, logprobs = batch.teacher_topk_ids, batch.teacher_topk_logprobs
    if ids is None:
        return
    valid = completion_mask(batch.completion_lengths.reshape(-1).long(), ids.shape[1])
    if valid.shape != ids.shape[:2]:
        raise ProtocolError(f"{IDS} has {ids.shape[1]} columns, fewer than the longest completion")
    ids, logprobs = ids[valid], logprobs[valid]
    if ids.numel():
        low, high = int(ids.min()), int(ids.max())
        require(low >= 0 and (vocab_size is None or high < vocab_size),
                f"{IDS}: token ids must be in [0, {vocab_size}), got {low if low < 0 else high}")
        require(bool(torch.isfinite(logprobs).all()), f"{LOGPROBS} holds values that are not finite")
        require(float(logprobs.max()) <= 0.0, f"{LOGPROBS} holds a value above 0: not a log-probability")
