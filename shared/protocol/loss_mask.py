"""The loss mask of multi-turn trajectories: which completion tokens the model wrote (1) and which the environment
did (0), in a rollout group and in a train batch; its layout, checks and wire form.

A multi-turn completion is the model's turns with the environment's observations appended between them as tokens.
Every token is scored (the reference model sees the whole sequence, and the policy's forward must too, because later
model tokens are conditioned on the observations), but only the model's own tokens are trained on: the loss, the KL
term, the entropy, the clip fractions and the token counts use ``mask & valid``.

``completion_mask`` is a ``[rows, L]`` bool tensor aligned with the completion tokens (``completion_ids`` of a group,
``behaviour_logprobs`` of a batch); values beyond a row's length mean nothing. ``None`` means "all ones": a
single-turn group carries nothing, so it encodes exactly as it did before masks existed (as with step rewards,
:mod:`shared.protocol.steps`). On the wire it is the BOOL tensor ``completion_mask``. A batch carries one when at least
one of its groups does; the rows of the others are all ones.

Every non-empty completion holds at least one model token: a row the model did not write has nothing to learn from
and would count as a sequence in the seq-mean aggregations with no tokens.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

import torch

from shared.protocol.errors import ProtocolError, require
from shared.tensors.masks import completion_mask

MASK_FIELD = "completion_mask"


def mask_from_lists(masks: Sequence[Sequence[int | bool]], sizes: Sequence[int], width: int) -> torch.Tensor:
    """``[len(sizes), width]`` bool from per-completion lists of 0/1 (``masks[i]`` has ``sizes[i]`` entries)."""
    require(len(masks) == len(sizes), f"masks for {len(masks)} completions, but the group has {len(sizes)}")
    out = torch.zeros(len(sizes), width, dtype=torch.bool)
    for i, (row, size) in enumerate(zip(masks, sizes)):
        require(len(row) == size, f"completion {i}: {len(row)} mask values for {size} tokens")
        for value in row:
            require(type(value) in (int, bool) and value in (0, 1),
                    f"completion {i}: mask values must be 0 or 1, got {value!r}")
        if size:
            out[i, :size] = torch.tensor([bool(v) for v in row], dtype=torch.bool)
    return out


def check_mask(mask: torch.Tensor | None, completion_ids: torch.Tensor, completion_lengths: torch.Tensor) -> None:
    """A group's (or batch's) mask as :class:`ProtocolError` naming the problem: shape of the completions, 0/1
    values, at least one model token in every non-empty completion."""
    if mask is None:
        return
    require(isinstance(mask, torch.Tensor), f"{MASK_FIELD} must be a tensor")
    require(tuple(mask.shape) == tuple(completion_ids.shape),
            f"{MASK_FIELD} must have the shape of the completions {tuple(completion_ids.shape)}, got "
            f"{tuple(mask.shape)}")
    require(not mask.is_floating_point() and not mask.is_complex(),
            f"{MASK_FIELD} must be a bool (or 0/1 integer) tensor, got {mask.dtype}")
    if mask.dtype != torch.bool:
        bad = ((mask != 0) & (mask != 1)).nonzero()
        if bad.numel():
            row, col = (int(v) for v in bad[0])
            raise ProtocolError(f"{MASK_FIELD}: completion {row}, token {col} is {int(mask[row, col])}, not 0 or 1")
    lengths = completion_lengths.long()
    model_tokens = completion_mask(lengths, mask.shape[1], mask).sum(dim=1)
    empty = ((lengths > 0) & (model_tokens == 0)).nonzero()
    if empty.numel():
        row = int(empty[0])
        raise ProtocolError(f"{MASK_FIELD}: completion {row} has {int(lengths[row])} tokens but none written by the "
                            "model (every non-empty completion needs at least one model token)")


def mask_tensors(record: Any) -> dict[str, torch.Tensor]:
    """The wire tensor of ``record``'s mask (bool): none when it has no mask."""
    return {} if record.completion_mask is None else {MASK_FIELD: record.completion_mask.bool()}


def take_mask(tensors: MutableMapping[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """The mask out of decoded ``tensors`` (removed from it), None when absent."""
    return {MASK_FIELD: tensors.pop(MASK_FIELD, None)}


def batch_mask(groups: Sequence[Any], width: int) -> torch.Tensor | None:
    """A batch's ``[B, width]`` mask: every group's rows in order (False past a row's length), all ones for a group
    without a mask; None when no group has one (the batch then encodes as before masks)."""
    if all(g.completion_mask is None for g in groups):
        return None
    rows = []
    for g in groups:
        if g.completion_mask is None:
            rows.append(torch.ones(g.group_size, width, dtype=torch.bool))
            continue
        part = torch.zeros(g.group_size, width, dtype=torch.bool)
        cols = min(width, g.completion_mask.shape[1])
        part[:, :cols] = completion_mask(g.completion_lengths, cols, g.completion_mask)
        rows.append(part)
    return torch.cat(rows)
