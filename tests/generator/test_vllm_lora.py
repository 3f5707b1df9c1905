"""The vLLM engine's LoRA side that needs no vLLM (generator/engines/vllm_lora.py): how the engine is sized from the
config, the checks of a relay adapter against the model folder, and the peft folder vLLM loads (checked here with
peft itself: the folder gives the learner's merged-weights logprobs). The vLLM half: tests/vllm/test_lora_vllm.py."""

import json

import pytest
import torch
from peft import PeftModel
from pydantic import ValidationError
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from generator.engines.hf import TransformersEngine
from generator.engines.vllm_lora import (
    PEFT_PREFIX,
    LoraServing,
    ModelFolder,
    lora_serving,
    read_adapter,
    vllm_max_lora_rank,
    write_peft_folder,
)
from learner.lora import adapter_parameters, apply_lora
from shared.config.schema import GRPOConfig
from shared.config.schema.learner import LoraConfig
from shared.forward.logprobs import naive_sequence_logprobs
from shared.weight_sync.adapter import AdapterError
from shared.weight_sync.params import adapted_base_weights, adapter_metadata, adapter_tensors

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def relay_adapter(model_dir, path, seed: int, r: int = 8, alpha: float = 24.0, targets=TARGETS) -> None:
    """What the learner publishes for a random non-zero adapter (peft starts B at zero)."""
    model = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                       LoraConfig(r=r, alpha=alpha, target_modules=targets))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in adapter_parameters(model):
            param.normal_(0.0, 0.05, generator=generator)
    tensors, scaling = adapter_tensors(model)
    save_file({t.name: t.compute().contiguous() for t in tensors}, str(path),
              metadata=adapter_metadata(scaling, adapted_base_weights(model)))


def logprobs(model) -> torch.Tensor:
    ids = torch.randint(3, 40, (3, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return naive_sequence_logprobs(model, ids, torch.tensor([5, 8, 3]), torch.tensor([19, 16, 21]))


def test_the_engine_is_sized_from_the_learner_section_of_the_same_config():
    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 32, 33, 300, 512)] == [1, 8, 8, 16, 32, 64, 320, 512]
    with pytest.raises(ValueError, match=r"learner\.lora\.r: 513 is above the largest rank"):
        vllm_max_lora_rank(513)
    config = GRPOConfig.model_validate({"learner": {"lora": {"r": 24}}, "generator": {"engine": "vllm"},
                                        "ref_server": {"max_staleness": 3}})
    serving = lora_serving(config)
    assert serving == LoraServing(max_lora_rank=32, max_loras=4)
    assert serving.llm_kwargs() == dict(enable_lora=True, max_lora_rank=32, max_loras=4, max_cpu_loras=5)
    assert lora_serving(GRPOConfig.model_validate({"learner": {"lora": {"publish": "merged"}}})) is None
    assert lora_serving(GRPOConfig()) is None
    with pytest.raises(ValidationError, match=r"learner\.lora\.r: 1024 is above the largest rank the vllm engine"):
        GRPOConfig.model_validate({"learner": {"lora": {"r": 1024}}, "generator": {"engine": "vllm"}})


def test_the_peft_folder_gives_the_learners_merged_weights(tiny_model_dir, tmp_path):
    relay_adapter(tiny_model_dir, tmp_path / "v1.safetensors", seed=1, targets=["q_proj", "v_proj", "down_proj"])
    tensors, scaling, rank = read_adapter(tmp_path / "v1.safetensors", ModelFolder(tiny_model_dir), max_rank=8)
    assert (scaling, rank, len(tensors)) == (3.0, 8, 2 * 3 * 2)  # 24 / 8; 3 targets x 2 layers, A and B each
    folder = write_peft_folder(tensors, scaling, rank, tmp_path / "peft", tiny_model_dir)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"] / config["r"]) == (8, 3.0)
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as fh:
        assert sorted(fh.keys()) == sorted(PEFT_PREFIX + name for name in tensors)
    # peft reads the folder back as the learner's adapter: its logprobs are the merged weights' (both fp32)
    served = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                       str(folder)).eval()
    merged = TransformersEngine(tiny_model_dir)
    merged.apply_adapter(tmp_path / "v1.safetensors")
    base = logprobs(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    assert (logprobs(served) - base).abs().max() > 1e-3  # the adapter changes the policy
    torch.testing.assert_close(logprobs(served), logprobs(merged.model), atol=1e-5, rtol=0)


def test_an_adapter_that_does_not_fit_the_model_folder_is_refused_naming_the_layer(tiny_model_dir, tmp_path):
    base = ModelFolder(tiny_model_dir)
    relay_adapter(tiny_model_dir, tmp_path / "good.safetensors", seed=1)
    with safe_open(str(tmp_path / "good.safetensors"), framework="pt") as fh:
        metadata, good = fh.metadata(), {name: fh.get_tensor(name) for name in fh.keys()}
    layer = "model.layers.1.mlp.up_proj"

    def refused(state, pattern, meta=metadata, max_rank=8):
        save_file(state, str(tmp_path / "bad.safetensors"), metadata=meta)
        with pytest.raises(AdapterError, match=pattern):
            read_adapter(tmp_path / "bad.safetensors", base, max_rank=max_rank)

    refused({**good, f"{layer}.lora_A.weight": good[f"{layer}.lora_A.weight"][:, :-1].contiguous()},
            rf"layer '{layer}': lora_A \[8, \d+\] / lora_B \[\d+, 8\] do not fit its weight")
    refused({k: v for k, v in good.items() if k != f"{layer}.lora_B.weight"},
            rf"layer '{layer}': the adapter holds only one of lora_A / lora_B")
    refused({**good, "model.layers.1.mlp.gate.lora_A.weight": good[f"{layer}.lora_A.weight"].clone(),
             "model.layers.1.mlp.gate.lora_B.weight": good[f"{layer}.lora_B.weight"].clone()},
            r"layer 'model.layers.1.mlp.gate' is not a linear layer of the model")
    refused(good, r"rank 8 is above the engine's max_lora_rank 1", max_rank=1)
    refused(good, r"no valid grpo_lora_scaling", meta={k: v for k, v in metadata.items() if k != "grpo_lora_scaling"})
    refused(good, r"is not a LoRA adapter", meta={"grpo_weights": "full"})
    samples = json.loads(metadata["grpo_lora_base_samples"])
    samples[layer] = [v + 1.0 for v in samples[layer]]
    refused(good, rf"trained on another base model: layer '{layer}'",
            meta={**metadata, "grpo_lora_base_samples": json.dumps(samples)})
    relay_adapter(tiny_model_dir, tmp_path / "r4.safetensors", seed=2, r=4, targets=["q_proj"])
    with safe_open(str(tmp_path / "r4.safetensors"), framework="pt") as fh:
        mixed = {**good, **{name: fh.get_tensor(name) for name in fh.keys()}}
    refused(mixed, r"layers of different ranks")
