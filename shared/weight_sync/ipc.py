"""CUDA IPC handles of the learner's send buffer, as JSON (no pickle crosses the hub).

``torch.multiprocessing.reductions.reduce_tensor`` gives the arguments of ``rebuild_cuda_tensor``: classes,
dtype, sizes, the raw handles (bytes) and the device index. The device index is the learner's numbering; the
generator may see the same GPU under another index (CUDA_VISIBLE_DEVICES), so the handle carries the device's
UUID and the receiver looks its own index up. GPU only; untested on the CPU machine this was written on.
"""

from __future__ import annotations

import base64

import torch


def device_uuid(device: torch.device) -> str | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def local_index_of(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise RuntimeError(f"GPU {uuid} is not visible to this process: CUDA IPC needs the learner's GPU")


def _b64(value) -> str | None:
    return None if value is None else base64.b64encode(bytes(value)).decode()


def _unb64(value: str | None) -> bytes | None:
    return None if value is None else base64.b64decode(value)


def export_handle(buffer: torch.Tensor) -> dict:
    """The IPC handle of ``buffer`` (a 1-D CUDA uint8 tensor that the learner keeps alive while it is shared)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if buffer.device.type != "cuda" or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError("CUDA IPC shares a 1-D uint8 CUDA buffer")
    _, args = reduce_tensor(buffer)
    (_cls, size, stride, offset, _storage_cls, _dtype, device, handle, storage_bytes, storage_offset,
     requires_grad, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required) = args
    return {"size": list(size), "stride": list(stride), "offset": int(offset), "device_uuid": device_uuid(buffer.device),
            "handle": _b64(handle), "storage_bytes": int(storage_bytes), "storage_offset": int(storage_offset),
            "ref_counter_handle": _b64(ref_counter_handle), "ref_counter_offset": int(ref_counter_offset),
            "event_handle": _b64(event_handle), "event_sync_required": bool(event_sync_required),
            "requires_grad": bool(requires_grad)}


def open_handle(handle: dict) -> torch.Tensor:
    """The learner's buffer mapped into this process (same GPU, another process)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    index = local_index_of(handle["device_uuid"])
    return rebuild_cuda_tensor(
        torch.Tensor, tuple(handle["size"]), tuple(handle["stride"]), handle["offset"], torch.storage.UntypedStorage,
        torch.uint8, index, _unb64(handle["handle"]), handle["storage_bytes"], handle["storage_offset"],
        handle["requires_grad"], _unb64(handle["ref_counter_handle"]), handle["ref_counter_offset"],
        _unb64(handle["event_handle"]), handle["event_sync_required"])
