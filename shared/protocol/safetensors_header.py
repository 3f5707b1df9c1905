"""The safetensors header in one place: the dtype table, writing a header, reading and checking one.

A safetensors file is an 8-byte little-endian header size, a JSON header (per tensor: ``dtype``, ``shape``,
``data_offsets`` into the data section; optional ``__metadata__`` of strings) and the data section. Every user of
the format goes through this module: the rollout wire format (:mod:`shared.protocol.wire`), the weight sync's flat
layout and file export, and the weight relay's checks of uploaded files (:mod:`shared.weight_sync`). Each use keeps
its own allow-list of dtype names (the rollout wire takes all of :data:`DTYPES`, weights fewer); the table from
name to torch dtype is this one.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import torch

from shared.protocol import strict_json

# the one table: safetensors dtype name <-> torch dtype
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
# A header is JSON describing the tensors; anything larger than this is not one of our messages or weight files.
MAX_HEADER_BYTES = 16 * 2**20
METADATA = "__metadata__"


class HeaderError(ValueError):
    """A header that is malformed or describes what its reader does not accept; the message says what is wrong."""


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of ``dtype`` (ValueError for one the table does not hold)."""
    name = NAMES.get(dtype)
    if name is None:
        raise ValueError(f"safetensors has no dtype for {dtype}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of the safetensors name ``name`` (KeyError for an unknown name)."""
    return DTYPES[name]


def itemsize(name: str) -> int:
    """Bytes per element of the safetensors dtype ``name``."""
    return DTYPES[name].itemsize


def encode_header(tensors: Iterable[tuple[str, str, Sequence[int], int, int]],
                  metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte size + JSON header for ``(name, dtype name, shape, begin, end)`` per tensor (offsets into the
    data section), with ``{"format": "pt", **metadata}`` as metadata; padded so the data starts 8-byte aligned."""
    header: dict[str, object] = {METADATA: {"format": "pt", **(metadata or {})}}
    for name, dtype, shape, begin, end in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def read_header(data: bytes | memoryview, allowed: Collection[str]) -> dict[str, Any]:
    """Parse and sanity-check the header at the start of ``data`` (size, JSON object, metadata of strings, every
    tensor entry an object of ``dtype`` (one of ``allowed``), ``shape`` and ``data_offsets`` of the JSON types they
    must have) without touching the data section. Problems are :class:`HeaderError`: whatever JSON the header
    holds, nothing else is raised."""
    if len(data) < 8:
        raise HeaderError("body is not safetensors: shorter than its 8-byte header size")
    (header_size,) = struct.unpack("<Q", bytes(data[:8]))
    if header_size > MAX_HEADER_BYTES or header_size > len(data) - 8:
        raise HeaderError(f"body is not safetensors: header size {header_size} does not fit a {len(data)}-byte body")
    try:  # strict: no NaN/Infinity, bounded nesting, numbers in range (json.loads raised RecursionError: a 500)
        header = strict_json.loads(bytes(data[8:8 + header_size]))
    except strict_json.StrictJSONError as exc:
        raise HeaderError(f"body is not safetensors: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise HeaderError("body is not safetensors: header is not a JSON object")
    metadata = header.get(METADATA, {})
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise HeaderError(f"body is not safetensors: {METADATA} is not an object of strings")
    for name, spec in header.items():
        if name != METADATA:
            _check_tensor_entry(name, spec, allowed)
    return header


def _check_tensor_entry(name: str, spec: object, allowed: Collection[str]) -> None:
    """One tensor's entry, every field of the JSON type it must have (a list where a string belongs made
    ``dtype not in allowed`` raise TypeError: a 500), before any reader looks at its values."""
    if not isinstance(spec, dict):
        raise HeaderError(f"tensor {name!r}: its entry is a JSON {_json_type(spec)}, not an object")
    dtype = spec.get("dtype")
    if not isinstance(dtype, str) or dtype not in allowed:
        shown = dtype if isinstance(dtype, str) else f"a JSON {_json_type(dtype)}"
        raise HeaderError(f"tensor {name!r}: unsupported or missing dtype ({shown!s:.40}); accepted: "
                          f"{', '.join(sorted(allowed))}")
    shape = spec.get("shape")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise HeaderError(f"tensor {name!r} has no valid shape (a list of non-negative integers)")
    offsets = spec.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)):
        raise HeaderError(f"tensor {name!r} has no valid data_offsets [begin, end]")


def _json_type(value: object) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)


def check_data_offsets(header: dict[str, Any]) -> int:
    """Tensors' byte ranges must tile the data section exactly: each ``data_offsets`` matching its dtype and shape
    (their types already checked by :func:`read_header`), contiguous and non-overlapping from 0. Returns the data
    section's size."""
    ranges = []
    for name, spec in header.items():
        if name == METADATA:
            continue
        offsets, shape = spec["data_offsets"], spec["shape"]
        begin, end = offsets
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= begin <= end or end - begin != numel * itemsize(spec["dtype"]):
            raise HeaderError(f"tensor {name!r} has data_offsets {offsets} that do not match its dtype "
                              f"{spec['dtype']} and shape {shape}")
        ranges.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(ranges):
        if begin != position:
            raise HeaderError(f"tensor {name!r} starts at byte {begin}, expected {position} (tensors must be "
                              "contiguous and must not overlap)")
        position = end
    return position
