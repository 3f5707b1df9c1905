"""Moves between host and device that wait for the device as little as possible.

On a GPU every read of a device value (``int(t.max())``, ``t.tolist()``, ``mask.nonzero()``, ``x[bool_mask]``)
blocks the host until the device has run everything queued before it; no more kernels are queued meanwhile. So
values known on the host go to the device as asynchronous copies (:func:`to_device`), and device values the host
needs come back together, in one copy (:func:`host_values`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[float] | torch.Tensor, device: torch.device,
              dtype: torch.dtype | None = torch.long) -> torch.Tensor:
    """``values`` (a list or a host tensor) as a tensor on ``device`` without waiting for that device.

    A blocking host-to-CUDA copy synchronises the stream first (it waits for every queued kernel); a non-blocking
    copy from pinned memory is queued like a kernel. So for CUDA the values are staged in pinned memory (PyTorch's
    caching host allocator keeps the block until the copy has run). A tensor already on ``device`` is returned as
    is (cast to ``dtype`` when one is given)."""
    device = torch.device(device)
    if isinstance(values, torch.Tensor):
        host = values if dtype is None else values.to(dtype)
    else:
        host = torch.tensor(values, dtype=dtype)
    if host.device == device or (device.type == "cpu" and host.device.type == "cpu"):
        return host
    if host.device.type != "cpu":
        return host.to(device)  # device to device: queued, no host wait
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def host_values(*lengths: Sequence[int] | torch.Tensor) -> list[list[int]]:
    """Each argument as a list of ints. Tensors come to the host together, in one copy (one device wait at most)."""
    tensors = [t for t in lengths if isinstance(t, torch.Tensor)]
    fetched: list[list[int]] = []
    if tensors:
        flat = torch.cat([t.reshape(-1).long() for t in tensors]) if len(tensors) > 1 else tensors[0].reshape(-1)
        values = flat.cpu().tolist()
        for t in tensors:
            fetched.append([int(v) for v in values[:t.numel()]])
            values = values[t.numel():]
    out = []
    for item in lengths:
        out.append(fetched.pop(0) if isinstance(item, torch.Tensor) else [int(v) for v in item])
    return out
