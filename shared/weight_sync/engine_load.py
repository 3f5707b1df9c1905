"""Loading one downloaded weights version into an engine: the step the generator's receiver and the evaluator share.

A version file is checked for NaN/inf before anything is loaded (a poisoned version never reaches an engine), then
loaded as what it is: a LoRA adapter (``learner.lora.publish: adapter``; the engine holds the base model) or full
weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from shared.errors import ServiceError
from shared.weight_sync.adapter import file_kind
from shared.weight_sync.layout import KIND_ADAPTER


class WeightSyncError(ServiceError):
    """The generator cannot load or get back to whole, consistent weights (an adapter its engine cannot apply,
    nothing on the relay after a failed receive)."""


class NonFiniteWeights(ValueError):
    """A version file holds NaN/inf: nothing was loaded."""

    def __init__(self, version: int, tensor: str) -> None:
        super().__init__(f"weights version {version} holds NaN/inf (tensor {tensor})")
        self.version, self.tensor = version, tensor


def nonfinite_tensor(path: str | Path) -> str | None:
    """The first tensor of a safetensors file holding NaN/inf (one tensor in memory at a time), or None."""
    with safe_open(str(path), framework="pt") as fh:
        for name in fh.keys():
            tensor = fh.get_tensor(name)
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                return name
    return None


def load_version_file(engine, path: str | Path, version: int) -> bool:
    """Check ``path`` for NaN/inf, then load it into ``engine``; True when it was a LoRA adapter.

    Raises :class:`NonFiniteWeights` (the engine keeps its weights) or :class:`WeightSyncError` for an adapter
    version and an engine that cannot apply adapters."""
    bad = nonfinite_tensor(path)
    if bad is not None:
        raise NonFiniteWeights(version, bad)
    if file_kind(path) != KIND_ADAPTER:
        engine.load_weights(path)
        return False
    if not hasattr(engine, "apply_adapter"):
        raise WeightSyncError(f"weights version {version} is a LoRA adapter (learner.lora.publish: adapter) and the "
                              f"{engine.name} engine cannot apply adapters: set learner.lora.publish: merged")
    engine.apply_adapter(path)
    return True
