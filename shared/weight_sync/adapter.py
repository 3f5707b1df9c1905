"""The generator's side of an adapter-only publish (``learner.lora.publish: adapter``): apply a LoRA adapter file
onto a plain Hugging Face model in place.

Each adapter version is whole (every layer's ``lora_A``/``lora_B``, not a difference to the previous version), so
an adapted layer's weight is always computed from the base: ``W = W_base + scaling * B @ A`` (fp32 product, one
rounding to the weight's dtype, exactly as the learner merges, shared/weight_sync/params.py). The base weights of
the adapted layers are kept in :class:`AdapterApplier` the first time a layer is adapted; never added onto an
already merged ``W``. A layer adapted by an earlier version and absent from this one goes back to its base.

Adapters arrive as a file from the HTTP relay (:meth:`AdapterApplier.apply`) or as tensors received through a
process group or CUDA IPC (:meth:`AdapterApplier.apply_tensors`, the scaling from the version header): both go
through the same checks and the same merge.

Where the base comes from: the model's own weights while they are still the model folder's (the generator starts
from ``learner.model``); after a full weights load they are some other policy's, so the base of a layer not kept
yet is read from the model folder's safetensors files.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from shared.weight_sync.layout import (
    ADAPTER_SUFFIXES,
    BASE_SAMPLES_KEY,
    KIND_ADAPTER,
    KIND_FULL,
    KIND_KEY,
    SCALING_KEY,
)
from shared.weight_sync.params import base_samples


class AdapterError(ValueError):
    """An adapter file that does not fit the model (unknown layer, wrong shapes, a missing half, no scaling)."""


def file_kind(path: str | Path) -> str:
    """``lora_adapter`` or ``full``: what a published weights file holds (its safetensors metadata)."""
    with safe_open(str(path), framework="pt") as fh:
        return (fh.metadata() or {}).get(KIND_KEY, KIND_FULL)



def adapter_file_header(fh, path: str | Path) -> tuple[dict[str, str], float]:
    """The metadata and scaling of an open adapter file (``safe_open``); an :class:`AdapterError` when the file is
    not a LoRA adapter or its scaling is missing, not a number, not finite or zero."""
    metadata = fh.metadata() or {}
    if metadata.get(KIND_KEY) != KIND_ADAPTER:
        raise AdapterError(f"{path} is not a LoRA adapter ({KIND_KEY} metadata: {metadata.get(KIND_KEY)!r})")
    try:
        scaling = float(metadata[SCALING_KEY])
    except (KeyError, ValueError):
        raise AdapterError(f"{path}: no valid {SCALING_KEY} metadata") from None
    if not math.isfinite(scaling) or scaling == 0.0:
        raise AdapterError(f"{path}: {SCALING_KEY} {scaling} is not a finite, non-zero number")
    return metadata, scaling

class AdapterApplier:
    """Applies adapters (files or received tensors) to ``model``; ``model_dir`` is where its base weights can be
    read again."""

    def __init__(self, model: torch.nn.Module, model_dir: str | Path) -> None:
        self.model, self.model_dir = model, Path(model_dir)
        self.base: dict[str, torch.Tensor] = {}   # adapted layer -> its base weight (same device and dtype)
        self.weights_are_base = True              # the model still holds the model folder's weights

    def full_weights_loaded(self) -> None:
        """The model's weights were replaced whole (a full version): the kept bases stay the base; layers not kept
        yet must be read from the model folder from now on."""
        self.weights_are_base = False

    def _layers(self, names: Iterable[str], shape_of: Callable[[str], list[int]]
                ) -> dict[str, tuple[torch.nn.Linear, str, str]]:
        """layer name -> (the linear layer, its A key, its B key), every pair checked before anything changes."""
        names = list(names)
        known = set(names)
        layers: dict[str, tuple[torch.nn.Linear, str, str]] = {}
        for name in names:
            if not name.endswith(ADAPTER_SUFFIXES):
                raise AdapterError(f"tensor {name!r} is not a LoRA matrix (<layer>.lora_A.weight / .lora_B.weight)")
            layer_name = name[: -len(ADAPTER_SUFFIXES[0])]
            if layer_name in layers:
                continue
            a_key, b_key = layer_name + ADAPTER_SUFFIXES[0], layer_name + ADAPTER_SUFFIXES[1]
            if a_key not in known or b_key not in known:
                raise AdapterError(f"layer {layer_name!r}: the adapter holds only one of lora_A / lora_B")
            try:
                layer = self.model.get_submodule(layer_name)
            except AttributeError:
                raise AdapterError(f"layer {layer_name!r} is not in the model") from None
            if not isinstance(layer, torch.nn.Linear):
                raise AdapterError(f"layer {layer_name!r} is not a linear layer")
            out_features, in_features = layer.weight.shape
            a_shape, b_shape = list(shape_of(a_key)), list(shape_of(b_key))
            if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[1] != in_features or b_shape[0] != out_features \
                    or a_shape[0] != b_shape[1]:
                raise AdapterError(f"layer {layer_name!r}: lora_A {a_shape} / lora_B {b_shape} do not fit its weight "
                                   f"{[out_features, in_features]}")
            layers[layer_name] = (layer, a_key, b_key)
        return layers

    def layout_problem(self, layout) -> str | None:
        """Why an adapter ``layout`` (:class:`shared.weight_sync.layout.Layout`, offered by the learner's group)
        cannot be applied to this model, or None: checked when a generator joins, before any version arrives."""
        shapes = {t.name: list(t.shape) for t in layout.tensors}
        try:
            self._layers(shapes, shapes.__getitem__)
        except AdapterError as exc:
            return str(exc)
        return None

    def _base_of(self, layer_name: str, layer: torch.nn.Linear) -> torch.Tensor:
        if layer_name not in self.base:
            if self.weights_are_base:
                self.base[layer_name] = layer.weight.detach().clone()
            else:
                self.base[layer_name] = self._read_base(layer_name + ".weight").to(layer.weight)
        return self.base[layer_name]

    def _read_base(self, name: str) -> torch.Tensor:
        for path in sorted(self.model_dir.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as fh:
                if name in fh.keys():
                    return fh.get_tensor(name)
        raise AdapterError(f"{name}: not in the model folder {self.model_dir} (the base the adapter applies to)")

    def _check_base(self, layers: dict, expected: str | None) -> None:
        """The learner's base fingerprint (``BASE_SAMPLES_KEY``: a few values per adapted layer) against our kept
        bases: an adapter trained on another base (``generator.model`` is not ``learner.model``) would serve a
        policy nobody trained. The tolerance covers either end holding the base in bf16."""
        if expected is None:
            return
        try:
            samples = json.loads(expected)
            samples = {str(name): [float(v) for v in values] for name, values in samples.items()}
        except (ValueError, TypeError, AttributeError):
            raise AdapterError(f"{BASE_SAMPLES_KEY} metadata is not a JSON object of number lists") from None
        for name, (layer, _, _) in layers.items():
            ours = torch.tensor(base_samples(self._base_of(name, layer)), dtype=torch.float64)
            theirs = torch.tensor(samples.get(name, []), dtype=torch.float64)
            if ours.shape != theirs.shape or not torch.allclose(ours, theirs, rtol=1e-2, atol=1e-6):
                raise AdapterError(f"the adapter was trained on another base model: layer {name!r} of the learner's "
                                   f"base holds {theirs.tolist()} where this generator's ({self.model_dir}) holds "
                                   f"{ours.tolist()}; generator.model must be the folder of learner.model")

    @torch.no_grad()
    def apply(self, path: str | Path) -> int:
        """Apply the adapter file ``path``; returns the number of adapted layers. Nothing changes when it does not
        fit (:class:`AdapterError`)."""
        with safe_open(str(path), framework="pt") as fh:
            metadata, scaling = adapter_file_header(fh, path)
            layers = self._layers(fh.keys(), lambda key: fh.get_slice(key).get_shape())
            return self._merge(layers, fh.get_tensor, scaling, metadata.get(BASE_SAMPLES_KEY), str(path))

    @torch.no_grad()
    def apply_tensors(self, tensors: Mapping[str, torch.Tensor], scaling: float, base_samples_json: str | None) -> int:
        """Apply an adapter received as tensors (``<layer>.lora_A.weight`` / ``.lora_B.weight``, the layout of
        :func:`shared.weight_sync.params.adapter_tensors`) with its ``scaling`` and the learner's base fingerprint
        (``BASE_SAMPLES_KEY`` metadata, None: unchecked); returns the number of adapted layers. Nothing changes
        when it does not fit (:class:`AdapterError`)."""
        layers = self._layers(tensors, lambda key: list(tensors[key].shape))
        return self._merge(layers, tensors.__getitem__, scaling, base_samples_json, "the received adapter")

    def _merge(self, layers: dict, get: Callable[[str], torch.Tensor], scaling: float, expected: str | None,
               what: str) -> int:
        if not math.isfinite(scaling):
            raise AdapterError(f"{what}: {SCALING_KEY} {scaling} is not finite")
        self._check_base(layers, expected)
        for layer_name, (layer, a_key, b_key) in layers.items():
            base = self._base_of(layer_name, layer)
            a = get(a_key).to(device=base.device, dtype=torch.float32)
            b = get(b_key).to(device=base.device, dtype=torch.float32)
            layer.weight.copy_((base.float() + (b @ a) * scaling).to(layer.weight.dtype))
        for layer_name, base in self.base.items():  # adapted before, not by this version: back to the base
            if layer_name not in layers:
                self.model.get_submodule(layer_name).weight.copy_(base)
        return len(layers)
