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

from ref_server.scoring.scorer import TopRow
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
    # [G, C, k] int32 / float32: the teacher's top-k next tokens per completion token (shared.protocol.teacher_topk);
    # None unless algorithm.distill.mode is topk_forward_kl
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None

    @classmethod
    def of(cls, group: RolloutGroup, ref_logprobs: list[torch.Tensor] | None,
           teacher_logprobs: list[torch.Tensor] | list[TopRow] | None = None) -> GroupRows:
        """``ref_logprobs``, ``teacher_logprobs``: the scorers' per-row tensors (row i has ``completion_lengths[i]``
        entries); a teacher scored with top-k gives :class:`TopRow` s (their ``[C + 1, k]`` top-k keep the first C
        rows: the distributions that predict the completion's tokens)."""
        topk = None
        if teacher_logprobs and isinstance(teacher_logprobs[0], TopRow):
            topk = _topk_of(teacher_logprobs, group.group_size, group.completion_ids.shape[1])
            teacher_logprobs = [row.logprobs for row in teacher_logprobs]
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
                   mask=None if group.completion_mask is None else completion_mask(lengths, columns, group.completion_mask),
                   topk_ids=topk[0] if topk else None, topk_logprobs=topk[1] if topk else None)


def _rows_of(scored: list[torch.Tensor] | None, size: int, columns: int) -> torch.Tensor | None:
    """A scorer's per-row logprobs as ``[size, columns]`` float32, zero beyond each row (None stays None)."""
    if scored is None:
        return None
    out = torch.zeros(size, columns, dtype=torch.float32)
    for i, row in enumerate(scored):
        out[i, :row.numel()] = row.float()
    return out


def _topk_of(rows: list[TopRow], size: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k of each row as ``[size, columns, k]`` int32 ids and float32 logprobs, 0 past each row."""
    k = rows[0].top_ids.shape[1]
    ids = torch.zeros(size, columns, k, dtype=torch.int32)
    logprobs = torch.zeros(size, columns, k, dtype=torch.float32)
    for i, row in enumerate(rows):
        c = row.logprobs.numel()
        ids[i, :c] = row.top_ids[:c].to(torch.int32)
        logprobs[i, :c] = row.top_logprobs[:c].float()
    return ids, logprobs


def _assemble_topk(groups: list[RolloutGroup], rows: list[GroupRows], width: int) -> dict[str, torch.Tensor | None]:
    """The batch's ``teacher_topk_ids`` / ``teacher_topk_logprobs`` ``[B, width, k]`` from the groups' rows (None
    when the groups have none)."""
    if any(r.topk_ids is None for r in rows) or len({r.topk_ids.shape[2] for r in rows}) != 1:
        return {"teacher_topk_ids": None, "teacher_topk_logprobs": None}
    total, k = sum(g.group_size for g in groups), rows[0].topk_ids.shape[2]
    ids = torch.zeros(total, width, k, dtype=torch.int32)
    logprobs = torch.zeros(total, width, k, dtype=torch.float32)
    start = 0
    for group, r in zip(groups, rows):
        end = start + group.group_size
        ids[start:end, :r.completion_width] = r.topk_ids[:, :r.completion_width]
        logprobs[start:end, :r.completion_width] = r.topk_logprobs[:, :r.completion_width]
        start = end
    return {"teacher_topk_ids": ids, "teacher_topk_logprobs": logprobs}


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
                      completion_mask=mask, teacher_logprobs=teacher, **fields,
                      **_assemble_topk(groups, rows, completion_width))
