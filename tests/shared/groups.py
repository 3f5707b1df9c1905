"""Rollout groups of random token ids and logprobs for the record tests."""

import torch

from shared.protocol.records import RolloutGroup, SamplingParams


def random_group(lengths, seed=0, *, temperature=1.0, policy_version=0, **optional) -> RolloutGroup:
    """``len(lengths)`` completions of random ids and logprobs through ``from_samples`` (rewards 0, 1, 0, ...; all
    "stop"); ``optional``: its optional fields (``masks``, ``versions``, ``group_id``...)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 40, (len(lengths), max(lengths)), generator=gen)
    logprobs = -torch.rand(len(lengths), max(lengths), generator=gen)
    return RolloutGroup.from_samples(
        prompt_ids=[1, 2, 3], completion_ids=[ids[i, :n].tolist() for i, n in enumerate(lengths)],
        behaviour_logprobs=[logprobs[i, :n].tolist() for i, n in enumerate(lengths)],
        rewards=[float(i % 2) for i in range(len(lengths))], finish_reasons=["stop"] * len(lengths),
        policy_version=policy_version, generator_id="gen", sampling=SamplingParams(temperature=temperature, max_tokens=8),
        **optional)
