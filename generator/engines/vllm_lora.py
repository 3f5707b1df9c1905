"""LoRA adapter versions served by the vLLM engine (``learner.lora.publish: adapter``), as vLLM ``LoRARequest``s.

vLLM enables LoRA when the ``LLM`` is built (``enable_lora``, ``max_lora_rank``, ``max_loras``), so the engine must
know at start that the run publishes adapters: it reads ``learner.lora`` from the same config
(:func:`lora_serving`); a generator whose config lacks that section refuses the first adapter with an error saying
so, never restarts the ``LLM``.

vLLM 0.32 loads an adapter from a path only (``LoRARequest.lora_path`` is required; the worker reads it with
``LoRAModel.from_local_checkpoint``; tensors do not cross into V1's engine process). Each relay version (a
safetensors file: ``<layer>.lora_A.weight`` / ``.lora_B.weight`` and the scaling in its metadata, see
shared/weight_sync/params.py) is therefore checked here against the model folder (layers, shapes, rank, the
learner's base fingerprint) and rewritten as a peft adapter folder (:func:`write_peft_folder`): a few MiB, the base
weights never leave the model folder.

This module imports no vLLM: the checks run, and are tested, in either environment.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shared.weight_sync.adapter import AdapterError, adapter_file_header
from shared.weight_sync.layout import ADAPTER_SUFFIXES, BASE_SAMPLES_KEY
from shared.weight_sync.params import base_samples

# vLLM's LoRAConfig.max_lora_rank takes only these values (vllm/config/lora.py: MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
PEFT_PREFIX = "base_model.model."  # peft's saved names: base_model.model.<layer>.lora_A.weight


@dataclass(frozen=True)
class LoraServing:
    """What the ``LLM`` is built with for a LoRA run."""

    max_lora_rank: int   # one of VLLM_LORA_RANKS, >= learner.lora.r
    max_loras: int       # adapters one batch may mix: the versions a rollout may still be sampled on

    def llm_kwargs(self) -> dict:
        # one spare cache slot: vLLM's LRU cache evicts its oldest adapter when an add would overflow it, before the
        # add is known to succeed; the engine removes versions itself once the new one is in (vllm_engine.py)
        return dict(enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras=self.max_loras,
                    max_cpu_loras=self.max_loras + 1)


def vllm_max_lora_rank(r: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds rank ``r``."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise ValueError(f"learner.lora.r: {r} is above the largest rank the vllm engine serves "
                     f"({VLLM_LORA_RANKS[-1]}); lower it or set learner.lora.publish: merged")


def lora_serving(config) -> LoraServing | None:
    """For a :class:`~shared.config.schema.GRPOConfig` whose learner publishes adapters: ``max_lora_rank`` from
    ``learner.lora.r``, ``max_loras = ref_server.max_staleness + 1`` (a rollout sampled that many versions back is
    still trained on, so its version may still be in flight when newer ones arrive). None otherwise."""
    lora = config.learner.lora
    if lora is None or lora.publish != "adapter":
        return None
    return LoraServing(max_lora_rank=vllm_max_lora_rank(lora.r), max_loras=config.ref_server.max_staleness + 1)


class ModelFolder:
    """The base model's weight shapes and fingerprints, read from its safetensors files (headers, and each adapted
    layer's weight once): the vLLM engine's model is in other processes, its folder is what the base is."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.shapes: dict[str, list[int]] = {}
        self._files: dict[str, Path] = {}
        for path in sorted(self.model_dir.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as fh:
                for name in fh.keys():
                    self.shapes[name] = list(fh.get_slice(name).get_shape())
                    self._files[name] = path
        if not self.shapes:
            raise AdapterError(f"{self.model_dir}: no safetensors weights (the base LoRA adapters apply to)")
        self._samples: dict[str, list[float]] = {}

    def samples(self, weight_name: str) -> list[float]:
        if weight_name not in self._samples:
            with safe_open(str(self._files[weight_name]), framework="pt") as fh:
                self._samples[weight_name] = base_samples(fh.get_tensor(weight_name))
        return self._samples[weight_name]


def read_adapter(path: str | Path, base: ModelFolder, max_rank: int) -> tuple[dict[str, torch.Tensor], float, int]:
    """The relay file's tensors, scaling and rank, every layer checked against ``base`` before anything is served:
    an :class:`AdapterError` names the layer (unknown, not a 2-D weight, shapes that do not fit it, one half
    missing, a rank other than the others' or above ``max_rank``) or the metadata (kind, scaling, base
    fingerprint)."""
    with safe_open(str(path), framework="pt") as fh:
        metadata, scaling = adapter_file_header(fh, path)
        tensors = {name: fh.get_tensor(name) for name in fh.keys()}
    if not tensors:
        raise AdapterError(f"{path}: the adapter holds no layers")
    ranks: dict[int, str] = {}
    layers = []
    for name in tensors:
        if not name.endswith(ADAPTER_SUFFIXES):
            raise AdapterError(f"tensor {name!r} is not a LoRA matrix (<layer>.lora_A.weight / .lora_B.weight)")
        layer = name[: -len(ADAPTER_SUFFIXES[0])]
        if layer in layers:
            continue
        layers.append(layer)
        a_key, b_key = layer + ADAPTER_SUFFIXES[0], layer + ADAPTER_SUFFIXES[1]
        if a_key not in tensors or b_key not in tensors:
            raise AdapterError(f"layer {layer!r}: the adapter holds only one of lora_A / lora_B")
        weight = base.shapes.get(layer + ".weight")
        if weight is None or len(weight) != 2:
            raise AdapterError(f"layer {layer!r} is not a linear layer of the model in {base.model_dir}")
        a_shape, b_shape = list(tensors[a_key].shape), list(tensors[b_key].shape)
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[1] != weight[1] or b_shape[0] != weight[0] \
                or a_shape[0] != b_shape[1]:
            raise AdapterError(f"layer {layer!r}: lora_A {a_shape} / lora_B {b_shape} do not fit its weight {weight}")
        ranks.setdefault(a_shape[0], layer)
    if len(ranks) != 1:
        raise AdapterError(f"layers of different ranks ({', '.join(f'{v!r}: {k}' for k, v in ranks.items())}): "
                           "the vllm engine serves one rank per adapter")
    rank = next(iter(ranks))
    if rank > max_rank:
        raise AdapterError(f"layer {ranks[rank]!r}: rank {rank} is above the engine's max_lora_rank {max_rank} "
                           "(set from learner.lora.r at start: the generator's learner.lora.r must be the learner's)")
    _check_base(layers, metadata.get(BASE_SAMPLES_KEY), base)
    return tensors, scaling, rank


def _check_base(layers: list[str], expected: str | None, base: ModelFolder) -> None:
    """The learner's base fingerprint against the model folder (as shared/weight_sync/adapter.py does in place)."""
    if expected is None:
        return
    try:
        samples = {str(k): [float(v) for v in values] for k, values in json.loads(expected).items()}
    except (ValueError, TypeError, AttributeError):
        raise AdapterError(f"{BASE_SAMPLES_KEY} metadata is not a JSON object of number lists") from None
    for layer in layers:
        ours = torch.tensor(base.samples(layer + ".weight"), dtype=torch.float64)
        theirs = torch.tensor(samples.get(layer, []), dtype=torch.float64)
        if ours.shape != theirs.shape or not torch.allclose(ours, theirs, rtol=1e-2, atol=1e-6):
            raise AdapterError(f"the adapter was trained on another base model: layer {layer!r} of the learner's "
                               f"base holds {theirs.tolist()} where this generator's ({base.model_dir}) holds "
                               f"{ours.tolist()}; generator.model must be the folder of learner.model")


def write_peft_folder(tensors: dict[str, torch.Tensor], scaling: float, rank: int, out_dir: str | Path,
                      base_model: str | Path) -> Path:
    """A peft adapter folder vLLM loads: ``adapter_config.json`` (r, ``lora_alpha = scaling * r`` so that vLLM's
    ``lora_alpha / r`` is the learner's scaling, the adapted module names) and ``adapter_model.safetensors``
    (peft's names: ``base_model.model.<layer>.lora_A.weight``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    modules = sorted({name[: -len(ADAPTER_SUFFIXES[0])].rsplit(".", 1)[-1] for name in tensors})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": scaling * rank,
              "target_modules": modules, "bias": "none", "lora_dropout": 0.0, "use_rslora": False,
              "use_dora": False, "base_model_name_or_path": str(base_model)}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
    save_file({PEFT_PREFIX + name: t.contiguous() for name, t in tensors.items()},
              str(out / "adapter_model.safetensors"))
    return out
