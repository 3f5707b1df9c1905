"""LoRA on the learner's policy (``learner.lora``): peft adapter layers injected into the Hugging Face model.

The model keeps its own class (``LlamaForCausalLM`` stays one): peft's :func:`inject_adapter_in_model` replaces
each targeted linear layer by a LoRA layer holding the frozen base layer and the trainable ``lora_A``/``lora_B``.
So the forward code, gradient checkpointing and attention settings work unchanged; only the adapter parameters
require gradients, and the DeepSpeed optimizer is built from those alone (learner/engine.py). Publishes carry only
the adapters (``learner.lora.publish: adapter``, :func:`shared.weight_sync.params.adapter_tensors`) or the merged
policy (``merged``); the final folder is always merged (:func:`shared.weight_sync.params.policy_tensors`).

The adapter is also saved in peft's own format (``adapter_model.safetensors`` + ``adapter_config.json``) in
each checkpoint, which ``grpo export --merge`` (and ``PeftModel.from_pretrained``) read.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from shared.config.schema.learner import LoraConfig
from shared.errors import UsageError
from shared.weight_sync.params import ADAPTER, gathered, is_adapter_parameter

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


class LoraSetupError(UsageError):
    """The LoRA settings do not fit the model; the message names the key."""


def _linear_names(model: torch.nn.Module) -> list[str]:
    head = model.get_output_embeddings()
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not head]


def check_target_modules(model: torch.nn.Module, cfg: LoraConfig) -> None:
    """Every name in ``learner.lora.target_modules`` must be the last part(s) of a linear layer's name (not the LM
    head, whose weight the chunked logprob code reads directly)."""
    if cfg.target_modules == "all-linear":
        return
    linear = _linear_names(model)
    all_modules = {name for name, _ in model.named_modules()}
    head = model.get_output_embeddings()
    head_names = {name for name, module in model.named_modules() if module is head}
    for target in cfg.target_modules:
        def matches(name: str, target: str = target) -> bool:
            return name == target or name.endswith("." + target)
        if any(matches(name) for name in linear):
            continue
        if any(matches(name) for name in head_names):
            raise LoraSetupError(f"learner.lora.target_modules: {target!r} is the LM head; LoRA on the head is not "
                                 "supported (adapt the decoder's linear layers)")
        kind = "is not a linear layer" if any(matches(name) for name in all_modules) else "matches no module"
        suffixes = sorted({name.rsplit(".", 1)[-1] for name in linear})
        raise LoraSetupError(f"learner.lora.target_modules: {target!r} {kind} of {type(model).__name__}; its "
                             f"linear layers are named {suffixes}")


def peft_config(cfg: LoraConfig, base_model: str | None = None):
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, bias="none",
                          target_modules=cfg.target_modules, task_type="CAUSAL_LM",
                          base_model_name_or_path=base_model)


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """Inject LoRA layers into ``model`` (in place) and freeze everything else; returns ``model``."""
    from peft import inject_adapter_in_model

    check_target_modules(model, cfg)
    model = inject_adapter_in_model(peft_config(cfg), model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_parameter(name))
    if not any(p.requires_grad for p in model.parameters()):
        raise LoraSetupError("learner.lora.target_modules: no adapter was created")
    return model


def adapter_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, param) for name, param in model.named_parameters() if is_adapter_parameter(name)]


def _lora_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from peft.tuners.lora import LoraLayer

    return [module for module in model.modules() if isinstance(module, LoraLayer)]


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base model: every LoRA layer bypassed (the reference policy). Only the flag the layers' forward reads is
    switched (peft's ``enable_adapters`` would also flip ``requires_grad``, which DeepSpeed's gradient hooks were
    set up for); callers run under ``torch.no_grad``."""
    layers = _lora_layers(model)
    before = [layer._disable_adapters for layer in layers]  # noqa: SLF001 -- the flag peft's forward reads
    for layer in layers:
        layer._disable_adapters = True  # noqa: SLF001
    try:
        yield
    finally:
        for layer, flag in zip(layers, before):
            layer._disable_adapters = flag  # noqa: SLF001


@contextlib.contextmanager
def trainable_state_only(engine) -> Iterator[None]:
    """While a LoRA checkpoint is written, the DeepSpeed engine's module state holds no frozen parameter at all.

    DeepSpeed's ``exclude_frozen_parameters`` drops the frozen names ``named_parameters()`` yields, and that names a
    tied weight once: the tied copy (``lm_head.weight`` of ``model.embed_tokens.weight``) stayed, most of a small
    model's checkpoint (113 of 152 MB for SmolLM2). Buffers stay; a resume takes the frozen weights from the base
    model (:func:`learner.checkpoint.load_latest` loads non-strict)."""
    full = engine.module_state_dict
    frozen = {name for name, p in engine.module.named_parameters(remove_duplicate=False) if not p.requires_grad}

    def trainable(destination=None, prefix="", keep_vars=False, exclude_frozen_parameters=False):
        state = full(destination=destination, prefix=prefix, keep_vars=keep_vars,
                     exclude_frozen_parameters=exclude_frozen_parameters)
        if exclude_frozen_parameters:
            for name in frozen:
                state.pop(prefix + name, None)
        return state

    engine.module_state_dict = trainable
    try:
        yield
    finally:
        del engine.module_state_dict  # the class's method again


def peft_name(name: str) -> str:
    """Our parameter name -> the key peft saves (``base_model.model.`` prefix, no adapter name)."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")


def save_adapter(model: torch.nn.Module, cfg: LoraConfig, base_model: str, directory: str | Path, *,
                 is_writer: bool) -> None:
    """The adapter in peft's format in ``directory`` (collective under ZeRO-3: every rank gathers)."""
    from safetensors.torch import save_file

    tensors = {}
    for name, param in adapter_parameters(model):
        with gathered(param):
            if is_writer:
                tensors[peft_name(name)] = param.detach().to("cpu", copy=True).contiguous()
    if not is_writer:
        return
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    # base_model_name_or_path: the folder grpo export --merge loads the base from
    peft_config(cfg, str(Path(base_model).resolve())).save_pretrained(str(directory))


def merge_checkpoint(checkpoint: str | Path, out: str | Path, base_model: str | None = None) -> dict:
    """``grpo export --merge``: the base model with a checkpoint's adapter merged in, as a plain Hugging Face
    folder in ``out`` (weights, config, tokenizer and generation files). ``checkpoint`` is a checkpoint tag folder
    (``.../checkpoints/step00000042``) or any peft adapter folder; ``base_model`` overrides the base folder the
    adapter records. Returns what was written."""
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    checkpoint = Path(checkpoint)
    config_file = checkpoint / ADAPTER_CONFIG
    if not (config_file.is_file() and (checkpoint / ADAPTER_WEIGHTS).is_file()):
        raise UsageError(f"{checkpoint} holds no LoRA adapter ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}); give a "
                         "checkpoint tag folder of a run with learner.lora, e.g. runs/learner/checkpoints/step00000050")
    try:
        recorded = json.loads(config_file.read_text()).get("base_model_name_or_path")
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read {config_file}: {exc}") from None
    base = Path(base_model or recorded or "")
    if not (base / "config.json").is_file():
        raise UsageError(f"base model folder {str(base)!r} (from {'--base' if base_model else config_file}) has no "
                         "config.json; pass --base DIR")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(checkpoint)).merge_and_unload()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for item in base.iterdir():  # tokenizer, generation config, chat template: as the base has them
        if item.is_file() and not item.name.endswith((".safetensors", ".bin", ".pt", ".index.json", ".gguf")):
            shutil.copy2(item, out / item.name)
    merged.save_pretrained(str(out))
    return {"base_model": str(base.resolve()), "adapter": str(checkpoint.resolve()), "out": str(out.resolve())}


@torch.no_grad()
def reference_logprobs(model: torch.nn.Module, batch, device: torch.device, *, chunk_tokens: int | None = None,
                       row_tokens: int = 16384, base: bool = True) -> torch.Tensor:
    """``learner.lora.reference: learner``: the batch's reference logprobs from the learner's own model with the
    adapters switched off (the base policy), in eval mode, at the batch's temperature; ``[B, L]`` float32 on the
    host like the hub's. Rows go through in chunks of about ``row_tokens`` padded tokens. ``base`` False: the
    policy as it is, adapters on (on-policy distillation's recomputed student, learner.advantages.distill_student)."""
    from shared.forward.logprobs import sequence_logprobs

    rows, width = batch.behaviour_logprobs.shape
    out = torch.zeros(rows, width, dtype=torch.float32)
    step = max(1, row_tokens // max(1, batch.input_ids.shape[1]))
    training = model.training
    model.eval()
    try:
        with adapters_disabled(model) if base else contextlib.nullcontext():
            for start in range(0, rows, step):
                end = min(rows, start + step)
                prompt = batch.prompt_lengths[start:end].tolist()
                completion = batch.completion_lengths[start:end].tolist()
                longest = max(p + c for p, c in zip(prompt, completion))
                result = sequence_logprobs(model, batch.input_ids[start:end, :longest].to(device), prompt,
                                           completion, temperature=batch.temperature, chunk_tokens=chunk_tokens)
                values = result.logprobs.float().cpu()
                out[start:end, :values.shape[1]] = values
    finally:
        model.train(training)
    return out
