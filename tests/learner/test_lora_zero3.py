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
from shared.weight_sync.params import gathered

from .batches import advantages_of, batch_of, sampled_groups

CPU = torch.device("cpu")


def one_lora_step(model_dir, batch, zero_stage):
    """One GRPO step of a rank-4 LoRA on all seven projections; the adapters, frozen weights and the policy's
    logprobs of the batch afterwards (full tensors, gathered under ZeRO-3)."""
    cfg = LearnerConfig(model=str(model_dir), tensorboard_dir=None, metrics_jsonl=None, lr=1e-2, grad_clip=0.0,
                        groups_per_step=2, zero_stage=zero_stage, lora=LoraConfig(r=4, alpha=8.0))
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
    return params, names, logprobs


@pytest.mark.slow
def test_a_zero3_lora_step_trains_only_the_adapters_and_matches_zero2(distributed, tiny_model_dir):
    groups = sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]], seed=1)
    batch = batch_of(groups)
    base = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).named_parameters())
    params3, adapters3, logprobs3 = one_lora_step(tiny_model_dir, batch, 3)
    params2, adapters2, logprobs2 = one_lora_step(tiny_model_dir, batch, 2)
    assert adapters3 == adapters2 and len(adapters3) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    for name, value in params3.items():
        if name in adapters3:
            continue
        assert torch.equal(value, base[name.replace(".base_layer.", ".")].detach()), name  # frozen: bitwise
    moved = [n for n in adapters3 if ".lora_B." in n and params3[n].abs().max() > 0]
    assert moved  # B starts at zero: the step moved the adapters
    assert max((params3[n] - params2[n]).abs().max().item() for n in adapters3) <= 1e-5
    mask = torch.arange(logprobs3.shape[1]) < batch.completion_lengths.unsqueeze(1)
    assert (logprobs3 - logprobs2)[mask].abs().max() <= 1e-5
