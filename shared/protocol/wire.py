"""The wire format: safetensors bytes (tensors) plus one JSON string in the safetensors metadata.

Never pickle, never ``torch.load``: safetensors holds only raw arrays and a JSON header, so decoding bytes that came
over the network cannot execute code. Decoding checks the header before anything is allocated and turns every
problem into a :class:`WireError` with a message fit for a 4xx answer.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from shared.protocol import safetensors_header, strict_json
from shared.protocol.safetensors_header import HeaderError

FORMAT_KEY = "grpo_format"
JSON_KEY = "grpo_json"
# the rollout wire's allow-list: bool, integers and floats (names of the one table in safetensors_header.py)
ALLOWED_DTYPES = frozenset({"BOOL", "U8", "I8", "I16", "I32", "I64", "F16", "BF16", "F32", "F64"})


class WireError(ValueError):
    """Bytes that are not a valid grpo-stack message; the message says what is wrong."""


def encode(kind: str, tensors: dict[str, torch.Tensor], fields: dict[str, Any]) -> bytes:
    """Serialise ``tensors`` (made contiguous, moved to CPU) and JSON-able ``fields`` as one safetensors blob."""
    metadata = {FORMAT_KEY: kind, JSON_KEY: json.dumps(fields, separators=(",", ":"), allow_nan=False)}
    return st_save({name: t.detach().cpu().contiguous() for name, t in tensors.items()}, metadata=metadata)


def read_header(data: bytes | memoryview) -> dict[str, Any]:
    """Parse and sanity-check the safetensors header (8-byte little-endian size, then JSON) without the payload."""
    try:
        return safetensors_header.read_header(data, ALLOWED_DTYPES)
    except HeaderError as exc:
        raise WireError(str(exc)) from None


def decode(data: bytes, kind: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Inverse of :func:`encode`; checks that the blob is a ``kind`` message."""
    header = read_header(data)
    metadata = header.get("__metadata__") or {}
    if metadata.get(FORMAT_KEY) != kind:
        raise WireError(f"expected a {kind!r} message, got {metadata.get(FORMAT_KEY)!r}")
    try:  # strict: no NaN/Infinity literals, bounded depth (a deep nesting must be a 4xx, not a RecursionError)
        fields = strict_json.loads(metadata.get(JSON_KEY, "{}"))
    except strict_json.StrictJSONError as exc:
        raise WireError(f"metadata field {JSON_KEY!r}: {exc}") from None
    if not isinstance(fields, dict):
        raise WireError(f"metadata field {JSON_KEY!r} is not a JSON object")
    try:
        tensors = st_load(bytes(data))
    except (SafetensorError, RuntimeError, ValueError) as exc:
        raise WireError(f"malformed safetensors body: {exc}") from None
    return tensors, fields


GROUPS_KIND = "rollout_groups/v1"


def encode_messages(messages: list[bytes]) -> bytes:
    """Several encoded messages (e.g. rollout groups) in one safetensors blob: message i is the U8 tensor
    ``message/i``. One request instead of one per message; each message is decoded and checked on its own."""
    tensors = {f"message/{i}": torch.frombuffer(bytearray(m), dtype=torch.uint8) for i, m in enumerate(messages)}
    return encode(GROUPS_KIND, tensors, {"count": len(messages)})


def decode_messages(data: bytes, max_count: int) -> list[bytes]:
    """Inverse of :func:`encode_messages`: the messages in order. A container with more than ``max_count``, a gap in
    the numbering or a tensor that is not U8 bytes is a WireError."""
    header = read_header(data)
    kind = (header.get("__metadata__") or {}).get(FORMAT_KEY)
    if kind != GROUPS_KIND:
        raise WireError(f"expected a {GROUPS_KIND!r} message, got {kind!r}")
    names = [name for name in header if name != "__metadata__"]
    if len(names) > max_count:
        raise WireError(f"{len(names)} messages in one request; at most {max_count}")
    expected = {f"message/{i}" for i in range(len(names))}
    if set(names) != expected:
        raise WireError("messages must be named message/0 .. message/N-1")
    if any(header[name].get("dtype") != "U8" for name in names):
        raise WireError("every message must be a U8 tensor of its bytes")
    tensors, fields = decode(data, GROUPS_KIND)
    if fields.get("count") != len(names):
        raise WireError(f"the container says {fields.get('count')!r} messages but holds {len(names)}")
    return [tensors[f"message/{i}"].numpy().tobytes() for i in range(len(names))]
