"""Masks and masked reductions, always derived from lengths.

Why lengths and never the pad id: EOS is often also the pad token, so ``input_ids != pad_id`` would drop the
EOS that ends every finished completion (and the model would never learn to stop).

Layout used across grpo-stack: per-token completion tensors are ``[B, L]``, left-aligned (column 0 is the
first completion token of every row), right-padded, with ``L >= max(completion_lengths)``.

Two ways to turn lengths into a mask:

* :func:`completion_mask` compares on the lengths' device and checks nothing, so it never waits for a GPU
  (check host lengths on the host first, then move them with :func:`shared.tensors.transfers.to_device`);
* :func:`lengths_to_mask` checks the lengths first (negative, longer than the width), reading them back.

Multi-turn completions hold the environment's tokens between the model's turns; the loss mask (``[B, >= L]``
bool, True where the model wrote the token; None: all) marks which count (:mod:`shared.protocol.loss_mask` is its
wire form). :func:`completion_mask` with a ``loss_mask`` gives the tokens a loss or metric counts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def completion_mask(lengths: torch.Tensor | Sequence[int], width: int,
                    loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``mask[i, j] = j < lengths[i]`` (and, with ``loss_mask``, ``loss_mask[i, j]``), bool ``[N, width]``.

    Compared where ``lengths`` is (a list becomes a host tensor), without any check or read-back. The attention
    mask of right-padded rows is the same with the rows' total lengths."""
    lengths = torch.as_tensor(lengths)
    valid = torch.arange(width, device=lengths.device) < lengths.unsqueeze(1)
    return model_token_mask(loss_mask, valid)


def model_token_mask(loss_mask: torch.Tensor | None, valid: torch.Tensor) -> torch.Tensor:
    """``valid & loss_mask`` (``valid`` as it is when there is no loss mask): the tokens a loss or metric counts.
    ``loss_mask`` may be wider than ``valid`` (its first columns are used) and on another device (moved)."""
    if loss_mask is None:
        return valid
    return valid & loss_mask[:, :valid.shape[1]].to(device=valid.device, dtype=torch.bool)


def lengths_to_mask(lengths: torch.Tensor, max_len: int | None = None) -> torch.Tensor:
    """``mask[i, j] = j < lengths[i]`` as a bool tensor of shape ``[B, max_len]``, the lengths checked first.

    ``max_len`` defaults to ``max(lengths)`` (0 for an empty batch). Negative lengths are an error. The checks read
    the lengths back (a wait for a GPU); :func:`completion_mask` does not.
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
    return completion_mask(lengths, max_len)


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
