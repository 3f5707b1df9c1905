"""Writing the policy as a safetensors file one parameter at a time (the final Hugging Face folder).

Publishing to the generators is :mod:`shared.weight_sync.publisher`: a send buffer and background transfers.

The safetensors header (names, dtypes, shapes, offsets) is known from parameter metadata alone, so the file is
written header first and then each tensor as soon as it is gathered: memory never holds more than one full
parameter beyond the model itself. Under ZeRO-3 every rank takes part in each gather (a collective); only rank 0
writes. Names are the Hugging Face model's, so generators and ``from_pretrained`` load the file as is (a tied LM
head appears once, under the embedding's name, as in ``named_parameters``).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from shared.protocol.safetensors_header import dtype_name, encode_header
from shared.weight_sync.params import iter_parameters, policy_tensors

log = logging.getLogger("grpo.learner")

# the exported file's allow-list (names of the one table in shared/protocol/safetensors_header.py)
FILE_DTYPES = frozenset({"F32", "F16", "BF16", "F64", "I64", "I32", "I8", "U8", "BOOL"})


def header_for(model: torch.nn.Module, dtype: torch.dtype | None = None,
               metadata: dict[str, str] | None = None) -> tuple[bytes, int]:
    """The safetensors header for ``model``'s policy tensors (:func:`policy_tensors`: the parameters in
    ``named_parameters`` order, LoRA layers merged) and the data size."""
    tensors, offset = [], 0
    for tensor in policy_tensors(model):
        name, shape = tensor.name, tensor.shape
        torch_dtype = dtype or tensor.dtype
        code = dtype_name(torch_dtype)
        if code not in FILE_DTYPES:
            raise ValueError(f"parameter {name!r}: {torch_dtype} is not written to weight files")
        size = torch.Size(shape).numel() * torch_dtype.itemsize
        tensors.append((name, code, shape, offset, offset + size))
        offset += size
    return encode_header(tensors, metadata), offset


def write_safetensors(model: torch.nn.Module, path: str | Path, *, is_writer: bool, dtype: torch.dtype | None = None,
                      metadata: dict[str, str] | None = None) -> int:
    """Stream ``model``'s parameters into ``path`` (written as ``path.partial`` then renamed). All ranks must call
    this under ZeRO-3; only the ``is_writer`` rank touches the file. Returns the file size on the writer."""
    path = Path(path)
    header, data_size = header_for(model, dtype, metadata)
    fh = open(path.with_name(path.name + ".partial"), "wb") if is_writer else None
    try:
        if fh is not None:
            fh.write(header)
        for _, tensor in iter_parameters(model, dtype):
            if fh is not None:
                fh.write(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        if fh is not None:
            fh.flush()
            os.fsync(fh.fileno())
    finally:
        if fh is not None:
            fh.close()
    if not is_writer:
        return 0
    os.replace(path.with_name(path.name + ".partial"), path)
    return len(header) + data_size


def export_hf_folder(engine, source_dir: str | Path, out_dir: str | Path, *, rank: int) -> None:
    """A Hugging Face folder of the current policy: config, tokenizer and generation files copied from the initial
    model folder, weights written as ``model.safetensors``. ``AutoModelForCausalLM`` loads it."""
    out = Path(out_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        for item in Path(source_dir).iterdir():
            if item.is_file() and not item.name.endswith((".safetensors", ".bin", ".pt", ".index.json")):
                shutil.copy2(item, out / item.name)
    write_safetensors(engine.module, out / "model.safetensors", is_writer=rank == 0)
    if dist.is_initialized():
        dist.barrier()
