"""Row lengths known on the host, so that the forward never waits for the device to learn a size.

On a GPU every read of a device value (``int(t.max())``, ``t.tolist()``, ``mask.nonzero()``, ``x[bool_mask]``)
blocks the host until the device has run everything queued before it; no more kernels are queued meanwhile. The
lengths of a micro-batch's rows come from the host (the batch is cut there), so the checks, maxima, sums and widths
are taken from host lists, and only small index tensors go to the device, as asynchronous copies
(:func:`shared.tensors.transfers.to_device`). Index tensors of data-dependent size are built on the device with their size given
(``repeat_interleave(..., output_size=n)``), never discovered there (:func:`ragged_positions`).

Lengths given as device tensors (other callers of the public functions) still work: both come to the host in one
copy (:func:`row_lengths`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.tensors.transfers import host_values, to_device


@dataclass(frozen=True)
class RowLengths:
    """Prompt and completion lengths of ``B`` right-padded ``[prompt + completion + padding]`` rows, checked, as
    host lists (for every size, maximum and check) and as ``[B]`` tensors on the rows' device (for index
    arithmetic that stays there)."""

    prompt: list[int]                    # prompt tokens of each row, on the host
    completion: list[int]                # completion tokens of each row, on the host
    prompt_on_device: torch.Tensor       # the same prompt lengths, [B] on the rows' device
    completion_on_device: torch.Tensor   # the same completion lengths, [B] on the rows' device

    @property
    def totals(self) -> list[int]:
        """Tokens of each row (prompt + completion), on the host."""
        return [p + c for p, c in zip(self.prompt, self.completion)]


def row_lengths(input_ids: torch.Tensor, prompt_lengths: Sequence[int] | torch.Tensor,
                completion_lengths: Sequence[int] | torch.Tensor | None = None) -> RowLengths:
    """The rows' lengths, checked on the host (completions default to the rest of each row).

    Lists are taken as they are (no device read); tensors come to the host in one copy. Raises ``ValueError``
    naming what is wrong (shapes, a prompt without tokens, a negative completion, a row longer than ``input_ids``).
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
    batch, seq_len = input_ids.shape
    device = input_ids.device
    given = [prompt_lengths] if completion_lengths is None else [prompt_lengths, completion_lengths]
    for lengths in given:
        shape = tuple(lengths.shape) if isinstance(lengths, torch.Tensor) else (len(lengths),)
        if shape != (batch,):
            raise ValueError("prompt_lengths and completion_lengths must be [B]")
    host = host_values(*given)
    prompt = host[0]
    completion = host[1] if completion_lengths is not None else [seq_len - p for p in prompt]
    if batch and min(prompt) < 1:
        raise ValueError("every prompt needs at least one token (the first completion token is predicted from it)")
    if batch and min(completion) < 0:
        raise ValueError("completion_lengths must be >= 0")
    if batch and max(p + c for p, c in zip(prompt, completion)) > seq_len:
        raise ValueError("prompt_lengths + completion_lengths exceeds the sequence length")
    # a tensor given on the device stays there (no copy back); host values are copied over without a wait
    prompt_on_device = to_device(prompt_lengths if torch.is_tensor(prompt_lengths) else prompt, device)
    if completion_lengths is None:
        completion_on_device = seq_len - prompt_on_device
    else:
        completion_on_device = to_device(completion_lengths if torch.is_tensor(completion_lengths) else completion,
                                         device)
    return RowLengths(prompt, completion, prompt_on_device, completion_on_device)


def ragged_positions(lengths: Sequence[int], lengths_on_device: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, positions)`` of every ``j < lengths[row]``, row by row: what ``lengths_to_mask(lengths)
    .nonzero(as_tuple=True)`` gives, built on the device with the count known on the host (no device read).

    ``lengths`` and ``lengths_on_device`` hold the same values (host list, device tensor)."""
    total = sum(lengths)
    device = lengths_on_device.device
    counts = lengths_on_device.long()
    rows = torch.arange(len(lengths), device=device).repeat_interleave(counts, output_size=total)
    starts = torch.cumsum(counts, 0) - counts
    positions = torch.arange(total, device=device) - starts.repeat_interleave(counts, output_size=total)
    return rows, positions
