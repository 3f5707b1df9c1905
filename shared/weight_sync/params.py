"""The policy's tensors one at a time, whole: under ZeRO-3 each is gathered from its partitions on every rank
(a collective, so every rank walks the tensors in the same order) and released again before the next.

"The policy's tensors" are what a generator or a Hugging Face folder holds, under the Hugging Face model's names.
For a plain model they are its parameters. For a model with LoRA adapters (peft layers injected into it, see
learner/lora.py) an adapted linear layer's weight is the merged ``W + scale * B @ A`` under the layer's own name
(``...q_proj.weight``, not ``...q_proj.base_layer.weight``), and the adapter matrices themselves are not listed:
generators serve the merged policy without knowing about peft.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from shared.weight_sync.layout import ADAPTER_SUFFIXES, BASE_SAMPLES_KEY, KIND_ADAPTER, KIND_KEY, SCALING_KEY

ADAPTER = "default"  # peft's adapter name; the learner injects one adapter
_BASE = ".base_layer."
_ADAPTER_PARTS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector.")


def full_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    """The parameter's unpartitioned shape (ZeRO-3 keeps it in ``ds_shape``)."""
    return tuple(getattr(param, "ds_shape", param.shape))


def gathered(params: torch.nn.Parameter | Sequence[torch.nn.Parameter]):
    """A context in which ``params`` hold their full tensors on every rank (a no-op unless ZeRO-3 partitioned
    them)."""
    params = [params] if isinstance(params, torch.nn.Parameter) else list(params)
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if partitioned:  # partitioned by ZeRO-3: gather the full tensors on every rank
        import deepspeed

        return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)
    return contextlib.nullcontext()


@dataclass(frozen=True)
class PolicyTensor:
    """One tensor of the policy as generators see it: its Hugging Face name, its full shape, the parameters to
    gather for it, and how to compute it from them (inside the gather)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    params: tuple[torch.nn.Parameter, ...]
    compute: Callable[[], torch.Tensor]


def is_adapter_parameter(name: str) -> bool:
    return any(part in name for part in _ADAPTER_PARTS)


def policy_tensors(model: torch.nn.Module) -> list[PolicyTensor]:
    """The policy's tensors in ``named_parameters`` order (see the module docstring for adapted layers)."""
    tensors = []
    for name, param in model.named_parameters():
        if is_adapter_parameter(name):
            continue
        if _BASE not in name:
            tensors.append(PolicyTensor(name, full_shape(param), param.dtype, (param,), param.detach))
            continue
        layer_name, leaf = name.split(_BASE, 1)
        if leaf != "weight":  # a bias is not adapted
            tensors.append(PolicyTensor(f"{layer_name}.{leaf}", full_shape(param), param.dtype, (param,),
                                        param.detach))
            continue
        layer = model.get_submodule(layer_name)
        if getattr(layer, "fan_in_fan_out", False) or getattr(layer, "use_dora", {}).get(ADAPTER, False):
            raise ValueError(f"{layer_name}: only plain LoRA on linear layers is merged (no DoRA, no fan_in_fan_out)")
        lora_a, lora_b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
        scale = float(layer.scaling[ADAPTER])

        def merged(base=param, a=lora_a, b=lora_b, scale=scale) -> torch.Tensor:
            # fp32 for the product: on CPU bf16 matmuls are slow, and the sum rounds once to the base's dtype
            delta = (b.detach().float() @ a.detach().float()) * scale
            return (base.detach().float() + delta).to(base.dtype)

        tensors.append(PolicyTensor(f"{layer_name}.weight", full_shape(param), param.dtype,
                                    (param, lora_a, lora_b), merged))
    return tensors


def iter_parameters(model: torch.nn.Module, dtype: torch.dtype | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor on CPU)`` per policy tensor, gathering ZeRO-3 partitions one tensor at a time
    (collective)."""
    for tensor in policy_tensors(model):
        with gathered(tensor.params):
            value = tensor.compute()
            yield tensor.name, value.to(dtype=dtype or value.dtype, device="cpu").contiguous()


# -- adapter-only publishing (learner.lora.publish: adapter) -------------------------------------------------------
# The safetensors metadata of a publish says what it holds: absent or "full" is the whole policy, "lora_adapter" is
# only the adapters (``<layer>.lora_A.weight`` [r, in] and ``<layer>.lora_B.weight`` [out, r] per adapted layer) and
# their scaling (alpha / r, exact as a decimal string: a bf16 tensor would round it). The receiver computes
# ``W = W_base + scaling * B @ A`` from the base weights it already holds (shared/weight_sync/adapter.py).


def adapter_tensors(model: torch.nn.Module) -> tuple[list[PolicyTensor], float]:
    """The adapter matrices of every LoRA layer (``named_parameters`` order, peft's adapter name dropped:
    ``...q_proj.lora_A.weight``) and the one scaling they share. Raises ``ValueError`` for a model without
    adapters, for DoRA / fan_in_fan_out layers and for per-layer scalings (none of which the learner creates)."""
    tensors, scalings = [], set()
    for name, _ in model.named_parameters():
        if _BASE not in name or not name.endswith(".weight"):
            continue
        layer_name = name.split(_BASE, 1)[0]
        layer = model.get_submodule(layer_name)
        if getattr(layer, "fan_in_fan_out", False) or getattr(layer, "use_dora", {}).get(ADAPTER, False):
            raise ValueError(f"{layer_name}: only plain LoRA on linear layers is published as an adapter")
        scalings.add(float(layer.scaling[ADAPTER]))
        for part, suffix in (("lora_A", ADAPTER_SUFFIXES[0]), ("lora_B", ADAPTER_SUFFIXES[1])):
            weight = getattr(layer, part)[ADAPTER].weight
            tensors.append(PolicyTensor(layer_name + suffix, full_shape(weight), weight.dtype, (weight,),
                                        weight.detach))
    if not tensors:
        raise ValueError("the model has no LoRA adapters to publish")
    if len(scalings) != 1:
        raise ValueError(f"adapters with different scalings {sorted(scalings)} are not published as one adapter")
    return tensors, scalings.pop()


def base_samples(weight: torch.Tensor) -> list[float]:
    """Four values of a base weight (first, at 1/3, at 2/3, last of its flat order): a fingerprint of the base an
    adapter applies to, compared with a bf16-sized tolerance (either end may hold the base in another dtype)."""
    flat = weight.detach().reshape(-1)
    n = flat.numel()
    return [float(flat[i]) for i in sorted({0, n // 3, 2 * n // 3, n - 1})] if n else []


def adapted_base_weights(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Adapted layer name -> its frozen base weight."""
    return {name.split(_BASE, 1)[0]: param for name, param in model.named_parameters()
            if name.endswith(_BASE + "weight")}


def adapter_metadata(scaling: float, bases: dict[str, torch.Tensor] | None = None) -> dict[str, str]:
    """The metadata of an adapter publish; ``bases`` (:func:`adapted_base_weights`) adds their fingerprint."""
    metadata = {KIND_KEY: KIND_ADAPTER, SCALING_KEY: repr(float(scaling))}
    if bases is not None:
        samples = {}
        for name, weight in bases.items():
            with gathered(weight):  # a ZeRO-3 partition holds none of it (collective: the publisher is on every rank)
                samples[name] = base_samples(weight)
        metadata[BASE_SAMPLES_KEY] = json.dumps(samples)
    return metadata
