"""The learner's step over a multi-turn batch: only the model's tokens count (learner/step.py)."""

import torch
from transformers import AutoModelForCausalLM

from learner.step import micro_batch_loss, split_micro_batches
from shared.config.schema import LossConfig
from shared.protocol.records import TrainBatch

from .batches import advantages_of, sampled_groups

CPU = torch.device("cpu")


def _loss(model, batch, cfg, parts=1):
    micro = split_micro_batches(batch, advantages_of(batch), parts, False, CPU)
    num_tokens, num_seqs = (sum(mb.normalizers[i] for mb in micro) for i in (0, 1))
    model.zero_grad()
    total, metrics = torch.zeros(()), []
    for mb in micro:
        result, _ = micro_batch_loss(model, mb, cfg, temperature=1.0, old_mode="behaviour", num_tokens=num_tokens,
                                     num_seqs=num_seqs)
        result.loss.backward()
        total = total + result.loss.detach()
        metrics.append(result.metrics)
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}, metrics, (num_tokens, num_seqs)


def test_all_ones_mask_is_bitwise_todays_step_and_a_mask_counts_model_tokens_only(tiny_model_dir):
    groups = sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.5], [0.0, 2.0, 1.0]], seed=3, max_tokens=8)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = LossConfig(beta=0.05, aggregation="seq-mean-token-mean")
    # reference logprobs that differ from the policy's by a different amount at each position: the KL term then
    # varies along a row, so leaving tokens out of the mean changes the loss (a constant offset would not, whatever
    # the mask: the test would hinge on rounding noise in the policy's logprobs)
    batch = TrainBatch.from_groups(groups, [g.behaviour_logprobs - torch.linspace(0.05, 0.4, g.behaviour_logprobs.shape[-1])
                                            for g in groups])
    plain = _loss(model, batch, cfg)
    batch.completion_mask = torch.ones_like(batch.behaviour_logprobs, dtype=torch.bool)
    ones = _loss(model, batch, cfg)
    assert torch.equal(plain[0], ones[0]) and plain[3] == ones[3]
    assert all(torch.equal(plain[1][n], ones[1][n]) for n in plain[1])

    # environment tokens in the middle of every row: the loss equals the loss over model tokens, computed as a
    # batch whose behaviour logprobs at environment positions are garbage (they must not matter)
    lengths = batch.completion_lengths
    mask = torch.ones_like(batch.completion_mask)
    mask[:, 2:4] = False
    batch.completion_mask = mask
    masked = _loss(model, batch, cfg)
    model_tokens = int((mask & (torch.arange(mask.shape[1]) < lengths.unsqueeze(1))).sum())
    assert masked[3][0] == model_tokens < int(lengths.sum())
    assert masked[2][0]["num_tokens"] == model_tokens
    batch.behaviour_logprobs = batch.behaviour_logprobs.masked_fill(~mask, -50.0)
    batch.ref_logprobs = batch.ref_logprobs.masked_fill(~mask, -80.0)
    garbage = _loss(model, batch, cfg)
    assert torch.equal(masked[0], garbage[0])
    assert not torch.equal(masked[0], plain[0])
