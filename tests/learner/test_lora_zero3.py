"""LoRA under ZeRO-3: the partitioned frozen LM head no longer breaks the chunked logprob's backward, only the
adapters train, and one step gives ZeRO-2's policy."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from learner.engine import create_engine
from learner.lora import adapter_parameters
from learner.step import grpo_step, split_micro_batches
from shared.config.schema import LearnerConfig, LossConfig
from shared.config.schema.learner import LoraConfig
from shared.forward.logprobs import sequence_logprobs
from shared.weight_sync.params import adapted_base_weights, adapter_metadata, adapter_tensors, gathered

from .batches import advantages_of, batch_of, sampled_groups

CPU = torch.device("cpu")


def one_lora_step(model_dir, batch, zero_stage):
    """One GRPO step of a rank-4 LoRA on all seven projections; the adapters, frozen weights and the policy's
    logprobs of the batch afterwards (full tensors, gathered under ZeRO-3)."""
    cfg = LearnerConfig(model=str(model_dir), tensorboard_dir=None, metrics_jsonl=None, lr=1e-2, grad_clip=0.0,
                        groups_per_step=2, zero_stage=zero_stage, lora=LoraConfig(r=4, alpha=8.0))
    torch.manual_seed(0)  # peft draws lora_A from the global generator: the same adapters in both runs
    engine = create_engine(cfg, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), CPU)
    micro = split_micro_batches(batch, advantages_of(batch), 1, False, CPU)
    outcome = grpo_step(engine, micro, LossConfig(beta=0.0), temperature=1.0, old_mode="behaviour", world_size=1,
                        log_entropy=True, chunk_tokens=None)
    assert outcome.finite
    model = engine.module
    with gathered(list(model.parameters())):
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        logprobs = sequence_logprobs(model, batch.input_ids, batch.prompt_lengths, batch.completion_lengths,
                                     temperature=1.0).logprobs
    names = {name for name, _ in adapter_parameters(model)}
    tensors, scaling = adapter_tensors(model)  # what an adapter publish sends (gathered under ZeRO-3)
    published = {}
    for tensor in tensors:
        with gathered(tensor.params):
            published[tensor.name] = tensor.compute().clone()
    metadata = adapter_metadata(scaling, adapted_base_weights(model))
    return params, names, logprobs, published, metadata


@pytest.mark.slow
def test_a_zero3_lora_step_trains_only_the_adapters_and_matches_zero2(distributed, tiny_model_dir):
    groups = sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]], seed=1)
    batch = batch_of(groups)
    base = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).named_parameters())
    params3, adapters3, logprobs3, published3, metadata3 = one_lora_step(tiny_model_dir, batch, 3)
    params2, adapters2, logprobs2, published2, metadata2 = one_lora_step(tiny_model_dir, batch, 2)
    assert adapters3 == adapters2 and len(adapters3) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    for name, value in params3.items():
        if name in adapters3:
            continue
        assert torch.equal(value, base[name.replace(".base_layer.", ".")].detach()), name  # frozen: bitwise
    moved = [n for n in adapters3 if ".lora_B." in n and params3[n].abs().max() > 0]
    assert moved  # B starts at zero: the step moved the adapters
    assert max((params3[n] - params2[n]).abs().max().item() for n in adapters3) <= 1e-5
    mask = torch.arange(logprobs3.shape[1]) < batch.completion_lengths.unsqueeze(1)
    assert ((logprobs3 - logprobs2).abs() * mask).max() <= 1e-5
    # an adapter publish under ZeRO-3: full tensors equal to ZeRO-2's and the base's fingerprint, not an empty shard
    assert published3.keys() == published2.keys() and len(published3) == 2 * 7 * 2
    assert max((published3[k] - published2[k]).abs().max().item() for k in published3) <= 1e-5
    assert metadata3 == metadata2 and '[]' not in metadata3["grpo_lora_base_samples"]


def adapters_of(engine) -> dict[str, torch.Tensor]:
    params = adapter_parameters(engine.module)
    with gathered([p for _, p in params]):
        return {name: p.detach().clone() for name, p in params}


@pytest.mark.slow
def test_a_zero3_lora_checkpoint_resumes_the_adapters_and_exports_them(distributed, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from deploy.cli import main as grpo
    from learner.checkpoint import load_latest, save_checkpoint
    from learner.lora import ADAPTER_WEIGHTS

    batch = batch_of(sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]], seed=2))
    cfg = LearnerConfig(model=str(tiny_model_dir), tensorboard_dir=None, metrics_jsonl=None, lr=1e-2, grad_clip=0.0,
                        groups_per_step=2, zero_stage=3, lora=LoraConfig(r=4, alpha=8.0))
    engine = create_engine(cfg, AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), CPU)
    micro = split_micro_batches(batch, advantages_of(batch), 1, False, CPU)
    assert grpo_step(engine, micro, LossConfig(beta=0.0), temperature=1.0, old_mode="behaviour", world_size=1,
                     log_entropy=False, chunk_tokens=None).finite
    tag = save_checkpoint(engine, tmp_path / "ckpt", step=1, version=1, keep=2, rank=0, consumed=["g1"],
                          lora=cfg.lora, base_model=cfg.model)
    trained = adapters_of(engine)
    saved = load_file(tmp_path / "ckpt" / tag / ADAPTER_WEIGHTS)  # peft's file: full tensors, not shards
    assert len(saved) == len(trained) and all(t.numel() > 0 for t in saved.values())
    resumed = create_engine(cfg, AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), CPU)
    assert load_latest(resumed, tmp_path / "ckpt")["step"] == 1
    again = adapters_of(resumed)
    assert again.keys() == trained.keys() and all(torch.equal(again[n], trained[n]) for n in trained)
    out = tmp_path / "merged"
    assert grpo(["export", "--merge", str(tmp_path / "ckpt" / tag), str(out)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        ours = sequence_logprobs(resumed.module, batch.input_ids, batch.prompt_lengths, batch.completion_lengths,
                                 temperature=1.0).logprobs
        theirs = sequence_logprobs(merged, batch.input_ids, batch.prompt_lengths, batch.completion_lengths,
                                   temperature=1.0).logprobs
    mask = torch.arange(ours.shape[1]) < batch.completion_lengths.unsqueeze(1)
    assert ((ours - theirs).abs() * mask).max() <= 1e-5
