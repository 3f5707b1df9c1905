"""Masks and masked reductions, always derived from lengths.

Why lengths and never the pad id: EOS is often also the pad token, so ``input_ids != pad_id`` would drop the
EOS that ends every finished completion (and the model would never learn to stop).

Layout used across grpo-stack: per-token completion tensors are ``[B, L]``, left-aligned (column 0 is the
first completion token of every row), right-padded, with ``L >= max(completion_lengths)``.
"""

from __future__ import annotations

import torch


def lengths_to_mask(lengths: torch.Tensor, max_len: int | None = None) -> torch.Tensor:
    """``mask[i, j] = j < lengths[i]`` as a bool tensor of shape ``[B, max_len]``.

    ``max_len`` defaults to ``max(lengths)`` (0 for an empty batch). Negative lengths are an error.
    """
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D, got shape {tuple(lengths.shape)}")
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError("lengths must be >= 0")
    if max_len is None:
        max_len = int(lengths.max()) if lengths.numel() else 0
    elif lengths.numel() and int(lengths.max()) > max_len:
        raise ValueError(f"a length {int(lengths.max())} exceeds max_len {max_len}")
    positions = torch.arange(max_len, device=lengths.device)
    return positions.unsqueeze(0) < lengths.unsqueeze(1)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(values * mask)``; masked-out entries are zeroed with ``where`` so a NaN/inf there cannot leak."""
    zeroed = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return zeroed.sum() if dim is None else zeroed.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(values * mask) / max(sum(mask), 1)``: an all-masked row gives 0, not NaN."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1).to(values.dtype)


def masked_min_max(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max over the masked entries; both 0 when nothing is masked in (a metric, never a NaN).

    Masked arithmetic, not ``values[mask]``: boolean indexing and ``if mask.any()`` would each wait for a GPU."""
    mask = mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    if values.numel() == 0:
        return zero, zero
    if values.is_floating_point():
        high, low = float("inf"), float("-inf")
    else:
        high, low = torch.iinfo(values.dtype).max, torch.iinfo(values.dtype).min
    anything = mask.any()
    smallest = values.masked_fill(~mask, high).amin()
    largest = values.masked_fill(~mask, low).amax()
    return torch.where(anything, smallest, zero), torch.where(anything, largest, zero)
