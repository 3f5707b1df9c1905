"""Where a service runs: one reading of the ``device`` settings for the ref server, generator and learner."""

from __future__ import annotations

import torch

from shared.errors import UsageError


class DeviceError(UsageError):
    """A device setting that names no usable device on this machine."""


def resolve_device(spec: str, *, local_rank: int = 0) -> torch.device:
    """'auto' -> a GPU if one is visible, else the CPU; 'cpu'; 'cuda' -> GPU ``local_rank``; 'cuda:N' -> GPU N.

    GPU indices always count the GPUs visible to this process (CUDA_VISIBLE_DEVICES), never the node's.
    """
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except RuntimeError as exc:
        raise DeviceError(f"device {spec!r} is not a device: {exc}") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise DeviceError(f"device {spec!r}: only 'auto', 'cpu', 'cuda' and 'cuda:N' are supported")
    if not torch.cuda.is_available():
        raise DeviceError(f"device {spec!r} asked for, but no GPU is visible")
    index = local_rank if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise DeviceError(f"device {spec!r}: GPU {index} asked for, {torch.cuda.device_count()} visible")
    return torch.device("cuda", index)


def default_dtype(spec: str, device: torch.device) -> torch.dtype:
    """'auto' -> bfloat16 on a GPU, float32 on the CPU; else the named torch dtype."""
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, spec)
