"""The policy's parameters one at a time, whole: under ZeRO-3 each is gathered from its partitions on every rank
(a collective, so every rank walks the parameters in the same order) and released again before the next."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def full_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    """The parameter's unpartitioned shape (ZeRO-3 keeps it in ``ds_shape``)."""
    return tuple(getattr(param, "ds_shape", param.shape))


def gathered(param: torch.nn.Parameter):
    """A context in which ``param`` holds its full tensor on every rank (a no-op unless ZeRO-3 partitioned it)."""
    if hasattr(param, "ds_id"):  # partitioned by ZeRO-3: gather the full tensor on every rank
        import deepspeed

        return deepspeed.zero.GatheredParameters([param], modifier_rank=None)
    return contextlib.nullcontext()


def iter_parameters(model: torch.nn.Module, dtype: torch.dtype | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor on CPU)`` per parameter, gathering ZeRO-3 partitions one at a time (collective)."""
    for name, param in model.named_parameters():
        with gathered(param):
            tensor = param.detach()
            yield name, tensor.to(dtype=dtype or tensor.dtype, device="cpu").contiguous()
