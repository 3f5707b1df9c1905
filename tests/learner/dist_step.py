"""One learner step under torchrun (or alone): used by test_distributed.py.

    torchrun --nproc_per_node W tests/learner/dist_step.py MODEL_DIR GROUPS_DIR OUT_DIR MICRO_BATCHES SCALE \
        [TOKEN_BUDGET PACKING]

Rank r takes its share of the groups (in order); rank 0 writes the loss, metrics and parameters after the step.
With SCALE ``batch`` the advantages divide by the std of every rank's rewards (all-reduced), so W ranks must give
what one rank with all the groups gives. With TOKEN_BUDGET the micro-batches are cut by tokens (learner.micro_batch_tokens)
and laid out by PACKING; rank 0 writes how many micro-batches it ran."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from learner.advantages import batch_advantages
from learner.engine import create_engine, ensure_single_process_env, init_distributed
from learner.step import grpo_step, split_micro_batches
from shared.config.schema import AdvantageConfig, LearnerConfig, LossConfig
from shared.protocol.records import RolloutGroup, TrainBatch


def main() -> None:
    model_dir, groups_dir, out_dir, micro = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    scale = sys.argv[5]
    token_budget = int(sys.argv[6]) if len(sys.argv) > 6 else None
    packing = sys.argv[7] if len(sys.argv) > 7 else "padded"
    ensure_single_process_env()
    init_distributed(torch.device("cpu"))
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [RolloutGroup.from_bytes(p.read_bytes()) for p in sorted(groups_dir.glob("*.group"))]
    share = len(groups) // world
    mine = groups[rank * share:(rank + 1) * share]
    refs = [g.behaviour_logprobs - 0.1 * torch.arange(g.behaviour_logprobs.shape[1]) for g in mine]
    batch = TrainBatch.from_groups(mine, refs)
    advantages = batch_advantages(batch, AdvantageConfig(eps=1e-4, scale=scale))
    # adam_eps 1 makes the first AdamW update ~ lr * g: smooth in g, so two runs can be compared closely
    cfg = LearnerConfig(model=model_dir, groups_per_step=share, micro_batches=micro, lr=1e-2, adam_eps=1.0,
                        grad_clip=1.0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine = create_engine(cfg, model, torch.device("cpu"))
    pieces = split_micro_batches(batch, advantages, micro, False, torch.device("cpu"), token_budget=token_budget,
                                 packing=packing)
    outcome = grpo_step(engine, pieces,
                        LossConfig(beta=0.04, aggregation="token-mean"), temperature=1.0, old_mode="behaviour",
                        world_size=world, log_entropy=False, chunk_tokens=None)
    counts = [None] * world
    dist.all_gather_object(counts, len(pieces))
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "result.json").write_text(json.dumps({"loss": outcome.loss, "micro_batches_per_rank": counts,
                                                         **outcome.metrics}))
        save_file({n: p.detach().contiguous() for n, p in engine.module.named_parameters()},
                  str(out_dir / "params.safetensors"))
    dist.barrier()


if __name__ == "__main__":
    main()
