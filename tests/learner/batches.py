"""Train batches whose completions were actually sampled from the tiny model (so behaviour ~= policy)."""

import torch

from generator.engines.hf import TransformersEngine
from learner.advantages import batch_advantages
from shared.config.schema import AdvantageConfig
from shared.protocol.records import RolloutGroup, SamplingParams, TrainBatch


def sampled_groups(model_dir, rewards_per_group, *, seed=0, temperature=1.0, max_tokens=6, version=0):
    engine = TransformersEngine(model_dir)
    prompts = [[5 + i, 6 + i, 7 + i] for i in range(len(rewards_per_group))]
    sampling = SamplingParams(temperature=temperature, max_tokens=max_tokens)
    samples = engine.generate(prompts, sampling, n=len(rewards_per_group[0]), seed=seed)
    groups = []
    for prompt, group_samples, rewards in zip(prompts, samples, rewards_per_group):
        groups.append(RolloutGroup.from_samples(
            prompt_ids=prompt, completion_ids=[s.token_ids for s in group_samples],
            behaviour_logprobs=[s.logprobs for s in group_samples], rewards=rewards,
            finish_reasons=[s.finish_reason for s in group_samples], policy_version=version, generator_id="test",
            sampling=sampling))
    return groups


def batch_of(groups, with_ref=False):
    refs = None
    if with_ref:
        refs = [g.behaviour_logprobs - 0.1 * torch.arange(g.behaviour_logprobs.shape[1]) for g in groups]
    return TrainBatch.from_groups(groups, refs)


def advantages_of(batch, **advantage):
    """The learner's advantages of ``batch`` (GRPO, group std, eps 1e-4 unless overridden)."""
    return batch_advantages(batch, AdvantageConfig(**{"eps": 1e-4, **advantage}))
