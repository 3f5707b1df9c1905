"""Building rollout groups for hub tests."""

import torch

from shared.protocol.records import RolloutGroup, SamplingParams


def make_group(version=0, group_size=4, prompt=(1, 2, 3), lengths=(3, 1, 4, 2), rewards=None, seed=0,
               temperature=1.0, generator_id="gen-test") -> RolloutGroup:
    gen = torch.Generator().manual_seed(seed)
    lengths = list(lengths)[:group_size]
    width = max(lengths)
    completion_ids = torch.randint(4, 40, (group_size, width), generator=gen)
    behaviour = -torch.rand(group_size, width, generator=gen)
    rewards = rewards if rewards is not None else [float(i % 2) for i in range(group_size)]
    return RolloutGroup.from_samples(
        prompt_ids=prompt, completion_ids=[completion_ids[i, :n].tolist() for i, n in enumerate(lengths)],
        behaviour_logprobs=[behaviour[i, :n].tolist() for i, n in enumerate(lengths)], rewards=rewards,
        finish_reasons=["stop"] * (group_size - 1) + ["length"], policy_version=version, generator_id=generator_id,
        sampling=SamplingParams(temperature=temperature, max_tokens=width),
        reward_components={"correct": rewards}, task={"answer": "7"},
    )
