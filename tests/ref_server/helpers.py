"""Building rollout groups for hub tests."""

import torch

from shared.protocol.records import RolloutGroup, SamplingParams
from shared.protocol.wire import encode


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


def group_bytes(field: str, x: float, dtype: torch.dtype, position: int = 1, group_id: str = "g1"
                ) -> tuple[bytes, float]:
    """A valid group's bytes with entry ``position`` of tensor ``field`` (``rewards``, ``reward/correct``,
    ``behaviour_logprobs``...) set to ``x`` sent in ``dtype`` (F64, F16...); also the value as it travels (``x``
    rounded to ``dtype``)."""
    group = make_group()
    tensors = {"prompt_ids": group.prompt_ids, "completion_ids": group.completion_ids,
               "completion_lengths": group.completion_lengths, "behaviour_logprobs": group.behaviour_logprobs,
               "rewards": group.rewards, "reward/correct": group.reward_components["correct"]}
    target = tensors[field].to(dtype).clone()
    target.view(-1)[position] = torch.tensor(x, dtype=torch.float64).to(dtype)  # the cast a sender would do
    tensors[field] = target
    fields = dict(finish_reasons=group.finish_reasons, policy_version=0, generator_id="gen", task={},
                  sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 4}, group_id=group_id)
    return encode("rollout_group/v1", tensors, fields), float(target.view(-1)[position].double())
