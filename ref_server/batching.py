"""Batch assembly the learner does not wait for: each group's rows are laid out once, when the group becomes ready
(in the upload or scoring thread), so that leasing a batch is a few copies per group.

The result is exactly :meth:`TrainBatch.from_groups` (same values, dtypes and widths; tests compare them); that
method builds every row with its own ``cat`` and pads a list of rows, a cost paid per row on every batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.protocol import RolloutGroup, TrainBatch


@dataclass
class GroupRows:
    """One group as batch rows: ``[G, P + C]`` token ids and ``[G, C]`` logprobs, zero beyond each row's length."""

    input_ids: torch.Tensor          # int64
    behaviour: torch.Tensor          # float32
    ref: torch.Tensor | None         # float32, None without a reference model
    width: int                       # longest row (prompt + completion) of the group
    completion_width: int            # longest completion of the group

    @classmethod
    def of(cls, group: RolloutGroup, ref_logprobs: list[torch.Tensor] | None) -> GroupRows:
        """``ref_logprobs``: the scorer's per-row tensors (row i has ``completion_lengths[i]`` entries)."""
        size, prompt = group.group_size, group.prompt_ids.long()
        lengths = group.completion_lengths.long()
        columns = group.completion_ids.shape[1]
        valid = torch.arange(columns) < lengths.unsqueeze(1)
        completion = group.completion_ids.long().masked_fill(~valid, 0)
        ref = None
        if ref_logprobs is not None:
            ref = torch.zeros(size, columns, dtype=torch.float32)
            for i, row in enumerate(ref_logprobs):
                ref[i, :row.numel()] = row.float()
        longest = int(lengths.max()) if size else 0
        return cls(input_ids=torch.cat([prompt.expand(size, -1), completion], dim=1),
                   behaviour=group.behaviour_logprobs.float().masked_fill(~valid, 0.0), ref=ref,
                   width=prompt.numel() + longest, completion_width=longest)


def assemble_batch(groups: list[RolloutGroup], rows: list[GroupRows], *, batch_id: str) -> TrainBatch:
    """The batch of ``groups`` (all of one temperature, as the hub guarantees) from their prepared rows."""
    sizes = torch.tensor([g.group_size for g in groups])
    total = int(sizes.sum())
    width = max(r.width for r in rows)
    completion_width = max(r.completion_width for r in rows)
    input_ids = torch.zeros(total, width, dtype=torch.long)
    behaviour = torch.zeros(total, completion_width, dtype=torch.float32)
    with_ref = rows[0].ref is not None
    ref = torch.zeros(total, completion_width, dtype=torch.float32) if with_ref else None
    start = 0
    for group, r in zip(groups, rows):
        end = start + group.group_size
        input_ids[start:end, :r.width] = r.input_ids[:, :r.width]
        behaviour[start:end, :r.completion_width] = r.behaviour[:, :r.completion_width]
        if ref is not None:
            ref[start:end, :r.completion_width] = r.ref[:, :r.completion_width]
        start = end
    names = sorted({name for g in groups for name in g.reward_components})
    return TrainBatch(
        input_ids=input_ids, behaviour_logprobs=behaviour, ref_logprobs=ref,
        prompt_lengths=torch.tensor([g.prompt_ids.numel() for g in groups]).repeat_interleave(sizes),
        completion_lengths=torch.cat([g.completion_lengths.long() for g in groups]),
        rewards=torch.cat([g.rewards.float() for g in groups]),
        group_index=torch.arange(len(groups)).repeat_interleave(sizes),
        policy_versions=torch.tensor([g.policy_version for g in groups]).repeat_interleave(sizes),
        truncated=torch.tensor([r == "length" for g in groups for r in g.finish_reasons], dtype=torch.bool),
        reward_components={name: torch.cat([g.reward_components.get(name, torch.full((g.group_size,), float("nan")))
                                            for g in groups]) for name in names},
        group_ids=[g.group_id for g in groups], generator_ids=[g.generator_id for g in groups],
        temperature=groups[0].sampling.temperature, batch_id=batch_id)
