"""Batch assembly the learner does not wait for: each group's rows are laid out once, when the group becomes ready
(in the upload or scoring thread), so that leasing a batch is a few copies per group.

The result is exactly :meth:`TrainBatch.from_groups` (same values, dtypes and widths; tests compare them); that
method builds every row with its own ``cat`` and pads a list of rows, a cost paid per row on every batch. Only the
token-aligned tensors are built here: every other field comes from :meth:`TrainBatch.fields_of_groups`, which
``from_groups`` uses too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.protocol.records import RolloutGroup, TrainBatch
from shared.tensors.masks import completion_mask


@dataclass
class GroupRows:
    """One group as batch rows: ``[G, P + C]`` token ids and ``[G, C]`` logprobs, zero beyond each row's length."""

    input_ids: torch.Tensor          # int64
    behaviour: torch.Tensor          # float32
    ref: torch.Tensor | None         # float32, None without a reference model
    width: int                       # longest row (prompt + completion) of the group
    completion_width: int            # longest completion of the group
    mask: torch.Tensor | None = None  # [G, C] bool, the group's completion_mask (None: a single-turn group)
    teacher: torch.Tensor | None = None  # float32, None without a teacher (ref_server.teacher_model)

    @classmethod
    def of(cls, group: RolloutGroup, ref_logprobs: list[torch.Tensor] | None,
           teacher_logprobs: list[torch.Tensor] | None = None) -> GroupRows:
        """``ref_logprobs``, ``teacher_logprobs``: the scorers' per-row tensors (row i has ``completion_lengths[i]``
        entries)."""
        size, prompt = group.group_size, group.prompt_ids.long()
        lengths = group.completion_lengths.long()
        columns = group.completion_ids.shape[1]
        valid = completion_mask(lengths, columns)
        completion = group.completion_ids.long().masked_fill(~valid, 0)
        longest = int(lengths.max()) if size else 0
        return cls(input_ids=torch.cat([prompt.expand(size, -1), completion], dim=1),
                   behaviour=group.behaviour_logprobs.float().masked_fill(~valid, 0.0),
                   ref=_rows_of(ref_logprobs, size, columns), teacher=_rows_of(teacher_logprobs, size, columns),
                   width=prompt.numel() + longest, completion_width=longest,
                   mask=None if group.completion_mask is None else completion_mask(lengths, columns, group.completion_mask))


def _rows_of(scored: list[torch.Tensor] | None, size: int, columns: int) -> torch.Tensor | None:
    """A scorer's per-row logprobs as ``[size, columns]`` float32, zero beyond each row (None stays None)."""
    if scored is None:
        return None
    out = torch.zeros(size, columns, dtype=torch.float32)
    for i, row in enumerate(scored):
        out[i, :row.numel()] = row.float()
    return out


def assemble_batch(groups: list[RolloutGroup], rows: list[GroupRows], *, batch_id: str) -> TrainBatch:
    """The batch of ``groups`` (all of one temperature, as the hub guarantees) from their prepared rows."""
    fields = TrainBatch.fields_of_groups(groups)
    total = sum(g.group_size for g in groups)
    width = max(r.width for r in rows)
    completion_width = max(r.completion_width for r in rows)
    input_ids = torch.zeros(total, width, dtype=torch.long)
    behaviour = torch.zeros(total, completion_width, dtype=torch.float32)
    with_ref, with_teacher = rows[0].ref is not None, rows[0].teacher is not None
    ref = torch.zeros(total, completion_width, dtype=torch.float32) if with_ref else None
    teacher = torch.zeros(total, completion_width, dtype=torch.float32) if with_teacher else None
    any_mask = any(r.mask is not None for r in rows)
    mask = torch.ones(total, completion_width, dtype=torch.bool) if any_mask else None
    start = 0
    for group, r in zip(groups, rows):
        end = start + group.group_size
        input_ids[start:end, :r.width] = r.input_ids[:, :r.width]
        behaviour[start:end, :r.completion_width] = r.behaviour[:, :r.completion_width]
        if ref is not None:
            ref[start:end, :r.completion_width] = r.ref[:, :r.completion_width]
        if teacher is not None:
            teacher[start:end, :r.completion_width] = r.teacher[:, :r.completion_width]
        if mask is not None and r.mask is not None:
            mask[start:end] = False
            mask[start:end, :r.completion_width] = r.mask[:, :r.completion_width]
        start = end
    return TrainBatch(input_ids=input_ids, behaviour_logprobs=behaviour, ref_logprobs=ref, batch_id=batch_id,
                      completion_mask=mask, teacher_logprobs=teacher, **fields)
