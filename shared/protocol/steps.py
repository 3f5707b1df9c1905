"""Step rewards (process supervision) of a rollout group and of a train batch: their layout, checks and wire form.

Completion ``i`` has ``K_i >= 0`` steps; step ``j`` of it ends at token ``e_ij`` (the 0-based index of the step's
last token among the completion's tokens) and has reward ``r_ij``. They travel as three flat ``[S]`` tensors,
``S = sum_i K_i``, listed by completion and, within a completion, by end:

* ``step_rewards`` float32: ``r_ij``;
* ``step_index`` int64: the completion of the step, its row: ``i`` in a group, the batch row in a train batch;
* ``step_end`` int64: ``e_ij``.

The wire keys (safetensors tensors) are these names. All three absent (``None``) means outcome-only: nothing is
added to the message, so an outcome-only group encodes exactly as before step rewards existed. All three empty
means "step rewards, but none": ``K_i = 0`` for every completion.

A train batch carries the three fields when at least one of its groups does; a group without them then contributes
no steps (``K_i = 0`` for its rows). The hub mixes such groups freely: it knows no algorithm, and the learner's
estimator decides what steps mean (``process_advantages`` in :mod:`shared.grpo.advantages`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch

from shared.protocol.errors import ProtocolError, require

# At most this many steps in one group (all its completions together); besides, a completion has at most one step
# per token (ends are strictly increasing inside it). Bounds the work of checking and of the estimator.
MAX_STEPS_PER_GROUP = 65536
STEP_FIELDS = ("step_rewards", "step_index", "step_end")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def steps_from_lists(steps: Sequence[Sequence[tuple[int, float]]], sizes: Sequence[int]) -> dict[str, torch.Tensor]:
    """The three step fields from per-completion lists: ``steps[i]`` is completion i's ``(end, reward)`` pairs.
    Types and the float32 range are checked here (a reward such as 1e300 would become inf); everything else by
    :func:`check_steps`."""
    require(len(steps) == len(sizes), f"step lists for {len(steps)} completions, but the group has {len(sizes)}")
    ends, rewards, rows = [], [], []
    for i, pairs in enumerate(steps):
        for j, pair in enumerate(pairs):
            require(isinstance(pair, (tuple, list)) and len(pair) == 2,
                    f"completion {i}, step {j}: expected an (end, reward) pair, got {pair!r}")
            end, reward = pair
            require(type(end) is int and -2**63 <= end < 2**63,
                    f"completion {i}, step {j}: step end must be an int64 integer, got {end!r}")
            require(_number(reward), f"completion {i}, step {j}: step reward must be a number, got {reward!r}")
            ends.append(end)
            rewards.append(float(reward) if isinstance(reward, float) or abs(reward) < 2**1000 else math.inf)
            rows.append(i)
    require(len(rows) <= MAX_STEPS_PER_GROUP, f"{len(rows)} steps in one group; at most {MAX_STEPS_PER_GROUP}")
    wide = torch.tensor(rewards, dtype=torch.float64)
    index = torch.tensor(rows, dtype=torch.long)
    _check_finite(wide, index)
    return {"step_rewards": wide.float(), "step_index": index, "step_end": torch.tensor(ends, dtype=torch.long)}


def _step_name(step_index: torch.Tensor, k: int) -> str:
    row = int(step_index[k])
    return f"step {int((step_index[:k] == row).sum())} of completion {row} (entry {k})"


def _check_finite(step_rewards: torch.Tensor, step_index: torch.Tensor) -> None:
    """Finite in float32, the dtype the batch and the estimator get (a float64 1e300 is refused here)."""
    bad = (~torch.isfinite(step_rewards.float())).nonzero()
    if bad.numel():
        k = int(bad[0])
        where = _step_name(step_index, k) if k < step_index.numel() else f"entry {k}"
        raise ProtocolError(f"step_rewards: {where} has reward {step_rewards[k].item()!r}, not a finite float32")


def check_steps(step_rewards: torch.Tensor | None, step_index: torch.Tensor | None, step_end: torch.Tensor | None,
                completion_lengths: torch.Tensor) -> None:
    """Everything the estimator relies on, as :class:`ProtocolError` naming the field and the step."""
    given = [name for name, t in zip(STEP_FIELDS, (step_rewards, step_index, step_end)) if t is not None]
    if not given:
        return
    require(len(given) == 3, f"step_rewards, step_index and step_end go together; got only {', '.join(given)}")
    assert step_rewards is not None and step_index is not None and step_end is not None
    require(step_rewards.is_floating_point(), f"step_rewards must be floating-point, got {step_rewards.dtype}")
    for name, t in (("step_index", step_index), ("step_end", step_end)):
        require(not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool,
                f"{name} must be an integer tensor, got {t.dtype}")
    shapes = [tuple(t.shape) for t in (step_rewards, step_index, step_end)]
    require(all(len(s) == 1 for s in shapes) and len(set(shapes)) == 1,
            f"step_rewards, step_index and step_end must all be [S], got shapes {shapes}")
    count, rows = step_rewards.numel(), completion_lengths.numel()
    require(count <= MAX_STEPS_PER_GROUP, f"{count} steps in one group; at most {MAX_STEPS_PER_GROUP}")
    index, end = step_index.long(), step_end.long()
    outside = ((index < 0) | (index >= rows)).nonzero()
    if outside.numel():
        k = int(outside[0])
        raise ProtocolError(f"step_index: entry {k} is {int(index[k])}, outside the group's {rows} completions")
    _check_finite(step_rewards, index)
    unsorted = (index[1:] < index[:-1]).nonzero()
    if unsorted.numel():
        k = int(unsorted[0]) + 1
        raise ProtocolError(f"step_index: entry {k} (completion {int(index[k])}) comes after a step of completion "
                            f"{int(index[k - 1])} (steps must be listed by completion)")
    lengths = completion_lengths.long()[index]
    past = ((end < 0) | (end >= lengths)).nonzero()
    if past.numel():
        k = int(past[0])
        raise ProtocolError(f"step_end: {_step_name(index, k)} ends at token {int(end[k])}, outside the "
                            f"completion's {int(lengths[k])} tokens")
    repeated = ((index[1:] == index[:-1]) & (end[1:] <= end[:-1])).nonzero()
    if repeated.numel():
        k = int(repeated[0]) + 1
        raise ProtocolError(f"step_end: {_step_name(index, k)} ends at token {int(end[k])}, not after the previous "
                            f"step's end {int(end[k - 1])} (ends must be strictly increasing within a completion)")


def step_tensors(record: Any) -> dict[str, torch.Tensor]:
    """The wire tensors of ``record``'s step fields (float32 / int64): none when it is outcome-only."""
    if record.step_rewards is None:
        return {}
    return {"step_rewards": record.step_rewards.float(), "step_index": record.step_index.long(),
            "step_end": record.step_end.long()}


def take_steps(tensors: MutableMapping[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """The step fields out of decoded ``tensors`` (removed from it): all three, or all None when absent."""
    found = {name: tensors.pop(name, None) for name in STEP_FIELDS}
    given = [name for name, t in found.items() if t is not None]
    require(len(given) in (0, 3), f"step_rewards, step_index and step_end go together; got only {', '.join(given)}")
    return found


def batch_steps(groups: Sequence[Any]) -> dict[str, torch.Tensor]:
    """A batch's step fields: every group's steps, in group order, ``step_index`` shifted by the group's first row.
    Empty when no group has step fields; a group without them contributes no steps."""
    if all(g.step_rewards is None for g in groups):
        return {}
    rewards, index, ends = [torch.zeros(0)], [torch.zeros(0, dtype=torch.long)], [torch.zeros(0, dtype=torch.long)]
    offset = 0
    for g in groups:
        if g.step_rewards is not None:
            rewards.append(g.step_rewards.float())
            index.append(g.step_index.long() + offset)
            ends.append(g.step_end.long())
        offset += g.group_size
    return {"step_rewards": torch.cat(rewards), "step_index": torch.cat(index), "step_end": torch.cat(ends)}


def select_steps(fields: Mapping[str, torch.Tensor | None], rows: torch.Tensor, num_rows: int) -> dict:
    """The step fields of a batch cut to ``rows`` (ascending batch rows, renumbered 0..len(rows)-1)."""
    if fields["step_rewards"] is None:
        return {}
    renumber = torch.full((num_rows,), -1, dtype=torch.long)
    renumber[rows] = torch.arange(rows.numel())
    new_rows = renumber[fields["step_index"]]
    kept = new_rows >= 0
    return {"step_rewards": fields["step_rewards"][kept], "step_index": new_rows[kept],
            "step_end": fields["step_end"][kept]}
