"""The learner with batches that carry step rewards (issue 23 item 1): it reads outcome rewards only for now, so a
batch with step fields trains exactly like the same batch without them."""

from dataclasses import replace

import pytest
import torch

from learner.advantages import batch_advantages
from learner.step import split_micro_batches
from shared.config.schema import AdvantageConfig
from shared.protocol.records import RolloutGroup, TrainBatch


def group(seed: int, steps) -> RolloutGroup:
    gen = torch.Generator().manual_seed(seed)
    lengths = [3, 1, 4, 2]
    return RolloutGroup.from_samples(
        prompt_ids=[1, 2, 3], completion_ids=[torch.randint(4, 40, (n,), generator=gen).tolist() for n in lengths],
        behaviour_logprobs=[(-torch.rand(n, generator=gen)).tolist() for n in lengths],
        rewards=torch.rand(4, generator=gen).tolist(), finish_reasons=["stop"] * 4, policy_version=0,
        generator_id="gen", group_id=f"g{seed}", steps=steps)


@pytest.mark.parametrize("scale", ["group", "none"])
def test_step_fields_change_nothing_the_learner_computes_yet(scale):
    with_steps = TrainBatch.from_bytes(TrainBatch.from_groups(
        [group(0, [[(0, 1.0), (2, 0.5)], [], [(3, -1.0)], [(1, 0.25)]]), group(1, None)], None).to_bytes())
    without = replace(with_steps, step_rewards=None, step_index=None, step_end=None)
    assert with_steps.step_rewards is not None and with_steps.step_index.tolist() == [0, 0, 2, 3]
    cfg = AdvantageConfig(scale=scale, eps=1e-4)
    advantages = batch_advantages(with_steps, cfg)
    assert torch.equal(advantages, batch_advantages(without, cfg))
    cpu = torch.device("cpu")
    for a, b in zip(split_micro_batches(with_steps, advantages, 2, False, cpu),
                    split_micro_batches(without, advantages, 2, False, cpu), strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.advantages, b.advantages)
        assert torch.equal(a.behaviour_logprobs, b.behaviour_logprobs)
