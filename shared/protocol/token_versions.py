"""Per-token policy versions: which weights version sampled each completion token, in a rollout group and in a train
batch; their layout, checks and wire form.

A continuous generator loads new weights while sequences are being sampled, so one completion can hold tokens of
several versions. ``token_versions`` is a ``[rows, L]`` int64 tensor aligned with the completion tokens
(``completion_ids`` of a group, ``behaviour_logprobs`` of a batch), right-padded; values beyond a row's length mean
nothing. One meaning per field:

* a token's version is the version of the weights whose distribution it was sampled from (its behaviour logprob
  is that distribution's);
* the group's ``policy_version`` is the OLDEST version any of its tokens was sampled with, so that every staleness
  check (the hub's pacing and staleness drop, the learner's ``min_version`` and its lag buckets), which reads
  ``policy_version``, counts a row as old as its oldest token.

Checked (:func:`check_versions`): integer values in ``[policy_version, 2^53)`` at every valid position, never
decreasing within a row (weights only move forward while a sequence is sampled), and for a group their minimum
over its valid tokens is ``policy_version``. Environment tokens of a multi-turn completion are valid positions
too: they carry the version of the model turn before them (or any version that keeps the row non-decreasing).

``None`` means every token has the row's ``policy_version``: a group sampled by one version carries nothing, so it
encodes exactly as before per-token versions existed (as with step rewards and masks, :mod:`shared.protocol.steps`,
:mod:`shared.protocol.loss_mask`). On the wire it is the I64 tensor ``token_versions``. A batch carries one when at
least one of its groups does; the rows of the others (and every padding position) hold the row's policy_version.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

import torch

from shared.protocol.errors import ProtocolError, require
from shared.tensors.masks import completion_mask

VERSIONS_FIELD = "token_versions"
# policy_version is an int64 tensor in a train batch and a JSON number in answers: keep it exact in both.
MAX_VERSION = 2**53


def versions_from_lists(versions: Sequence[Sequence[int] | None], sizes: Sequence[int], width: int,
                        policy_version: int) -> torch.Tensor | None:
    """``[len(sizes), width]`` int64 from per-completion lists (``versions[i]`` has ``sizes[i]`` entries; None: every
    token of completion i has ``policy_version``); padding holds ``policy_version``. None when every token of every
    completion has ``policy_version`` (nothing to send). Types are checked here, ranges and order by
    :func:`check_versions`."""
    require(len(versions) == len(sizes), f"versions for {len(versions)} completions, but the group has {len(sizes)}")
    require(type(policy_version) is int and 0 <= policy_version < MAX_VERSION,
            f"policy_version must be an integer in [0, 2^53), got {policy_version!r}")
    out = torch.full((len(sizes), width), policy_version, dtype=torch.long)
    for i, (row, size) in enumerate(zip(versions, sizes)):
        if row is None:
            continue
        require(len(row) == size, f"completion {i}: {len(row)} token versions for {size} tokens")
        for value in row:
            require(type(value) is int and 0 <= value < MAX_VERSION,
                    f"completion {i}: token versions must be integers in [0, 2^53), got {value!r}")
        if size:
            out[i, :size] = torch.tensor(list(row), dtype=torch.long)
    return None if bool((out == policy_version).all()) else out


def check_versions(versions: torch.Tensor | None, completion_lengths: torch.Tensor, row_versions: torch.Tensor,
                   shape: tuple[int, ...], *, oldest: int | None = None) -> None:
    """A group's (or batch's) token versions as :class:`ProtocolError` naming the problem: an integer tensor of
    ``shape`` (the completions'), at each valid position (``completion_lengths``) a value in
    ``[row_versions[row], 2^53)``, never decreasing within a row; with ``oldest`` (a group's policy_version) the
    minimum over the valid positions equals it. Padding positions are not read."""
    if versions is None:
        return
    require(isinstance(versions, torch.Tensor), f"{VERSIONS_FIELD} must be a tensor")
    require(tuple(versions.shape) == tuple(shape),
            f"{VERSIONS_FIELD} must have the shape of the completions {tuple(shape)}, got {tuple(versions.shape)}")
    require(not versions.is_floating_point() and not versions.is_complex() and versions.dtype != torch.bool,
            f"{VERSIONS_FIELD} must be an integer tensor, got {versions.dtype}")
    rows = shape[0] if shape else 0
    require(tuple(completion_lengths.shape) == (rows,) and tuple(row_versions.shape) == (rows,),
            f"{VERSIONS_FIELD}: {rows} rows need {rows} completion lengths and policy versions")
    values = versions.long()
    valid = completion_mask(completion_lengths.long(), values.shape[1])
    floor = row_versions.long().reshape(-1, 1)
    bad = (valid & ((values < floor) | (values >= MAX_VERSION))).nonzero()
    if bad.numel():
        row, col = (int(v) for v in bad[0])
        raise ProtocolError(f"{VERSIONS_FIELD}: completion {row}, token {col} is {int(values[row, col])}, outside "
                            f"[{int(floor[row])}, 2^53) (no token is older than its row's policy_version)")
    down = (valid[:, 1:] & (values[:, 1:] < values[:, :-1])).nonzero()
    if down.numel():
        row, col = (int(v) for v in down[0])
        raise ProtocolError(f"{VERSIONS_FIELD}: completion {row}, token {col + 1} has version "
                            f"{int(values[row, col + 1])} after {int(values[row, col])} (versions never decrease "
                            "within a completion)")
    if oldest is not None and bool(valid.any()):
        least = int(values.masked_fill(~valid, MAX_VERSION).min())
        require(least == oldest, f"{VERSIONS_FIELD}: the oldest token version is {least}, but policy_version is "
                                 f"{oldest} (policy_version must be the oldest version of the group's tokens)")


def version_tensors(record: Any) -> dict[str, torch.Tensor]:
    """The wire tensor of ``record``'s token versions (int64): none when it has none."""
    return {} if record.token_versions is None else {VERSIONS_FIELD: record.token_versions.long()}


def take_versions(tensors: MutableMapping[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """The token versions out of decoded ``tensors`` (removed from it), None when absent."""
    return {VERSIONS_FIELD: tensors.pop(VERSIONS_FIELD, None)}


def batch_versions(groups: Sequence[Any]) -> dict[str, torch.Tensor]:
    """A batch's ``token_versions`` ``[B, L]`` (``L`` the longest completion, the batch's logprob width): every
    group's rows in order, each row's policy_version at its padding and on every row of a group without token
    versions. Empty when no group has any (the batch then encodes as before)."""
    if all(g.token_versions is None for g in groups):
        return {}
    width = max(int(g.completion_lengths.max()) for g in groups)
    rows = []
    for g in groups:
        part = torch.full((g.group_size, width), g.policy_version, dtype=torch.long)
        if g.token_versions is not None:
            cols = min(width, g.token_versions.shape[1])
            valid = completion_mask(g.completion_lengths.long(), cols)
            part[:, :cols] = torch.where(valid, g.token_versions[:, :cols].long(), g.policy_version)
        rows.append(part)
    return {VERSIONS_FIELD: torch.cat(rows)}


def newest_version(group: Any) -> int:
    """The newest version that sampled a token of ``group`` (its policy_version without token versions)."""
    if group.token_versions is None:
        return group.policy_version
    valid = completion_mask(group.completion_lengths.long(), group.token_versions.shape[1])
    values = group.token_versions.long().masked_fill(~valid, group.policy_version)
    return max(group.policy_version, int(values.max()) if values.numel() else 0)
