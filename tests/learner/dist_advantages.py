"""The learner's advantages under torchrun (gloo): used by test_token_advantages_distributed.py.

    torchrun --nproc_per_node W tests/learner/dist_advantages.py OUT_JSON

Rank r takes its share of :func:`step_groups` (in order) and computes the advantages of every case of
:data:`CASES` with ``scale: batch``; rank 0 writes every row's token advantages (rank 0's rows first) as JSON."""

import json
import sys

import torch
import torch.distributed as dist

from learner.advantages import batch_advantages
from shared.config.schema import AdvantageConfig, KLConfig
from shared.protocol.records import RolloutGroup, TrainBatch

# (supervision, KL in the reward)
CASES = [("process", False), ("outcome", True), ("process", True)]


def step_groups() -> tuple[list[RolloutGroup], list[torch.Tensor]]:
    """Four groups with step rewards of different spreads (so each rank's own std differs from the global one),
    a row without steps, and reference logprobs."""
    gen = torch.Generator().manual_seed(11)
    groups, refs = [], []
    spreads = [1.0, 0.2, 3.0, 0.5]
    for g, spread in enumerate(spreads):
        lengths = [4, 3, 5]
        steps = [[(1, spread * (g + 1)), (3, 0.0)], [(2, spread)], [] if g == 1 else [(4, -spread)]]
        group = RolloutGroup.from_samples(
            prompt_ids=[1, 2, 3], completion_ids=[[5 + i for i in range(n)] for n in lengths],
            behaviour_logprobs=[(-torch.rand(n, generator=gen)).tolist() for n in lengths],
            rewards=[spread * x for x in (1.0, 0.0, 0.5)], finish_reasons=["stop"] * 3, policy_version=0,
            generator_id="gen", group_id=f"g{g}", steps=steps)
        groups.append(group)
        refs.append(group.behaviour_logprobs - 0.3 * torch.rand(group.behaviour_logprobs.shape, generator=gen))
    return groups, refs


def advantages_by_case(groups: list[RolloutGroup], refs: list[torch.Tensor]) -> dict[str, list[list[float]]]:
    """Each case's advantages of the batch of ``groups``, per row, trimmed to the row's length."""
    batch = TrainBatch.from_groups(groups, refs)
    out = {}
    for supervision, in_reward in CASES:
        advantages = batch_advantages(batch, AdvantageConfig(supervision=supervision, scale="batch", eps=1e-6),
                                      KLConfig(in_reward=in_reward, beta=0.1))
        out[f"{supervision}-{in_reward}"] = [row[:n] for row, n in zip(advantages.tolist(),
                                                                       batch.completion_lengths.tolist())]
    return out


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups, refs = step_groups()
    share = len(groups) // world
    mine = advantages_by_case(groups[rank * share:(rank + 1) * share], refs[rank * share:(rank + 1) * share])
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({case: [row for part in gathered for row in part[case]] for case in mine}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
