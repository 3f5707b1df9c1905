"""The policy as one flat byte range, and its bounded buckets.

The learner copies every parameter, in ``named_parameters`` order and in one dtype, into a flat ``uint8`` send
buffer whose layout is the data section of a safetensors file (contiguous tensors, offsets from 0). The same
layout serves every transport: the HTTP relay gets the safetensors header + the buffer, the collective sends the
buffer in buckets of at most ``bucket_bytes`` (one broadcast per bucket, never one per tensor), and CUDA IPC maps
the buffer itself. A tensor larger than a bucket spans several buckets; the receiver assembles only that tensor.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from shared.protocol.safetensors_header import DTYPES, METADATA, NAMES, encode_header

# what a published file holds (its safetensors metadata; shared/weight_sync/params.py builds adapter publishes)
KIND_KEY = "grpo_weights"
KIND_FULL = "full"
KIND_ADAPTER = "lora_adapter"
SCALING_KEY = "grpo_lora_scaling"
BASE_SAMPLES_KEY = "grpo_lora_base_samples"  # a few base values per adapted layer: the generator's must match
ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")

# the weights' allow-list: floats only (names of the one table in shared/protocol/safetensors_header.py)
WEIGHT_DTYPES = frozenset({"F32", "F16", "BF16", "F64"})


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str              # safetensors code: F32, BF16, F16, F64
    shape: tuple[int, ...]
    begin: int              # byte offsets in the flat buffer
    end: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class Layout:
    """Names, dtypes, shapes and byte offsets of the published tensors."""

    tensors: tuple[TensorSpec, ...]

    @property
    def total_bytes(self) -> int:
        return self.tensors[-1].end if self.tensors else 0

    @classmethod
    def build(cls, shapes: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype) -> Layout:
        code = NAMES.get(dtype)
        if code not in WEIGHT_DTYPES:
            raise ValueError(f"weights are published as float32, bfloat16, float16 or float64, not {dtype}")
        specs, offset = [], 0
        for name, shape in shapes:
            size = torch.Size(shape).numel() * dtype.itemsize
            specs.append(TensorSpec(name, code, tuple(int(d) for d in shape), offset, offset + size))
            offset += size
        return cls(tuple(specs))

    def to_json(self) -> list[list]:
        return [[t.name, t.dtype, list(t.shape)] for t in self.tensors]

    @classmethod
    def from_json(cls, rows: list[list]) -> Layout:
        """The layout from ``[[name, dtype code, shape], ...]`` (offsets follow from the order)."""
        specs, offset = [], 0
        for name, code, shape in rows:
            if code not in WEIGHT_DTYPES:
                raise ValueError(f"tensor {_short(name)}: unknown dtype {_short(code)}")
            dims = tuple(int(d) for d in shape)
            if any(d < 0 for d in dims):
                raise ValueError(f"tensor {_short(name)}: negative dimension")
            # math.prod on Python ints: a registered layout comes from the network, and torch.Size overflows
            size = math.prod(dims) * DTYPES[code].itemsize
            specs.append(TensorSpec(str(name), code, dims, offset, offset + size))
            offset += size
        return cls(tuple(specs))

    def fingerprint(self) -> int:
        """A 31-bit checksum of the layout, sent with every version so both ends know they agree."""
        return zlib.crc32(json.dumps(self.to_json(), separators=(",", ":")).encode()) & 0x7FFFFFFF

    @property
    def kind(self) -> str:
        """What a version of this layout holds: ``lora_adapter`` (LoRA matrices only, ``learner.lora.publish:
        adapter``) or ``full`` (every weight of the policy). See shared/weight_sync/params.py."""
        adapter = any(t.name.endswith(ADAPTER_SUFFIXES) for t in self.tensors)
        return KIND_ADAPTER if adapter else KIND_FULL

    def mismatch(self, header: dict) -> str | None:
        """The first way a safetensors ``header`` (parsed JSON) differs from this layout, in layout order, or None:
        a tensor missing, of another dtype or shape, or one the layout does not have, or a file whose metadata
        says it holds another kind (an adapter for a full layout, full weights for an adapter layout, an adapter
        without a valid scaling). The relay refuses weights that would not load into the learner's model
        (ref_server/relay/routes.py)."""
        problem = self._kind_mismatch(header.get(METADATA))
        if problem is not None:
            return problem
        tensors = {name: spec for name, spec in header.items() if name != METADATA}
        for t in self.tensors:
            spec = tensors.get(t.name)
            if spec is None:
                return f"tensor {t.name!r} is missing"
            if spec.get("dtype") != t.dtype:
                return f"tensor {t.name!r} is {_short(spec.get('dtype'))}, the model's is {t.dtype}"
            if spec.get("shape") != list(t.shape):
                return f"tensor {t.name!r} has shape {_short(spec.get('shape'))}, the model's is {list(t.shape)}"
        extra = sorted(set(tensors) - {t.name for t in self.tensors})
        return f"tensor {_short(extra[0])} is not in the model ({len(extra)} such)" if extra else None

    def _kind_mismatch(self, metadata: object) -> str | None:
        metadata = metadata if isinstance(metadata, dict) else {}
        kind = metadata.get(KIND_KEY, KIND_FULL)
        if kind != self.kind:
            return f"the file holds {_short(kind)} weights ({KIND_KEY} metadata), the learner publishes {self.kind}"
        if kind == KIND_ADAPTER:
            try:
                scaling = float(metadata.get(SCALING_KEY))
            except (TypeError, ValueError):
                return f"a LoRA adapter needs its scaling ({SCALING_KEY} metadata), got {_short(metadata.get(SCALING_KEY))}"
            if not math.isfinite(scaling):
                return f"a LoRA adapter's scaling must be finite, got {_short(metadata.get(SCALING_KEY))}"
        return None

    def safetensors_header(self, metadata: dict[str, str] | None = None) -> bytes:
        """The 8-byte length + JSON header that, followed by the flat buffer, is a safetensors file."""
        return encode_header(((t.name, t.dtype, t.shape, t.begin, t.end) for t in self.tensors), metadata)


def _short(value: object, limit: int = 80) -> str:
    """A value from an untrusted header, quoted and cut short for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def bucket_ranges(total_bytes: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """``[begin, end)`` byte ranges of at most ``bucket_bytes`` covering ``[0, total_bytes)``."""
    if bucket_bytes < 8 or bucket_bytes % 8:
        raise ValueError(f"bucket size must be a positive multiple of 8 bytes, got {bucket_bytes}")
    return [(b, min(b + bucket_bytes, total_bytes)) for b in range(0, total_bytes, bucket_bytes)]


def typed_view(raw: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """``raw`` (uint8, exactly the tensor's bytes) seen as the tensor; copied first if misaligned for the dtype."""
    itemsize = spec.torch_dtype.itemsize
    if raw.storage_offset() % itemsize:
        raw = raw.clone()
    return raw.view(spec.torch_dtype).view(spec.shape)


class BucketUnpacker:
    """Turns buckets, received in order, into ``(name, tensor)`` pairs as soon as each tensor is complete.

    A tensor inside one bucket is a view of that bucket (valid until the next bucket overwrites the receive
    buffer: consume it before asking for the next); a tensor spanning buckets is assembled in a staging tensor of
    its own size, the only extra memory the receiver ever holds."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self._next = 0
        self._staging: torch.Tensor | None = None

    @property
    def done(self) -> bool:
        return self._next == len(self.layout.tensors)

    def feed(self, begin: int, chunk: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        end = begin + chunk.numel()
        tensors = self.layout.tensors
        while self._next < len(tensors) and tensors[self._next].begin < end:
            spec = tensors[self._next]
            if spec.begin >= begin and spec.end <= end and self._staging is None:
                yield spec.name, typed_view(chunk[spec.begin - begin:spec.end - begin], spec)
                self._next += 1
                continue
            if self._staging is None:
                self._staging = torch.empty(spec.end - spec.begin, dtype=torch.uint8, device=chunk.device)
            low, high = max(spec.begin, begin), min(spec.end, end)
            self._staging[low - spec.begin:high - spec.begin].copy_(chunk[low - begin:high - begin])
            if high < spec.end:
                break  # the rest comes with the next bucket
            staged, self._staging = self._staging, None
            yield spec.name, typed_view(staged, spec)
            self._next += 1
        # an empty tensor at the very end has begin == end == total: complete it once the last byte arrived
        while self._next < len(tensors) and tensors[self._next].begin == tensors[self._next].end <= end:
            spec = tensors[self._next]
            yield spec.name, torch.empty(spec.shape, dtype=spec.torch_dtype, device=chunk.device)
            self._next += 1
