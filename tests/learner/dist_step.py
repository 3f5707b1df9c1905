"""Learner steps under torchrun (or alone), one per case, in one launch: used by test_distributed.py.

    torchrun --nproc_per_node W tests/learner/dist_step.py MODEL_DIR CASES_JSON

CASES_JSON is a list of cases, each ``{"groups": DIR, "out": DIR, "micro": N, "scale": S, "token_budget": T or
null, "packing": P}``. For each case every rank loads the model afresh, rank r takes its share of the case's groups
(in order), one GRPO step runs, and rank 0 writes the loss, metrics and parameters after it to the case's ``out``.
With scale ``batch`` the advantages divide by the std of every rank's rewards (all-reduced), so W ranks must give
what one rank with all the groups gives. With a token budget the micro-batches are cut by tokens
(learner.micro_batch_tokens) and laid out by the packing; rank 0 writes how many micro-batches each rank ran.

The cases share one launch because a launch is most of the cost (each rank imports torch, transformers and
DeepSpeed: ~10 s of CPU)."""

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


def run_case(model_dir: str, case: dict, rank: int, world: int) -> None:
    groups = [RolloutGroup.from_bytes(p.read_bytes()) for p in sorted(Path(case["groups"]).glob("*.group"))]
    share = len(groups) // world
    mine = groups[rank * share:(rank + 1) * share]
    refs = [g.behaviour_logprobs - 0.1 * torch.arange(g.behaviour_logprobs.shape[1]) for g in mine]
    batch = TrainBatch.from_groups(mine, refs)
    advantages = batch_advantages(batch, AdvantageConfig(eps=1e-4, scale=case["scale"]))
    # adam_eps 1 makes the first AdamW update ~ lr * g: smooth in g, so two runs can be compared closely
    cfg = LearnerConfig(model=model_dir, groups_per_step=share, micro_batches=case["micro"], lr=1e-2,
                        adam_eps=1.0, grad_clip=1.0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine = create_engine(cfg, model, torch.device("cpu"))
    pieces = split_micro_batches(batch, advantages, case["micro"], False, torch.device("cpu"),
                                 token_budget=case["token_budget"], packing=case["packing"])
    outcome = grpo_step(engine, pieces,
                        LossConfig(beta=0.04, aggregation="token-mean"), temperature=1.0, old_mode="behaviour",
                        world_size=world, log_entropy=False, chunk_tokens=None)
    counts = [None] * world
    dist.all_gather_object(counts, len(pieces))
    if rank == 0:
        out_dir = Path(case["out"])
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "result.json").write_text(json.dumps({"loss": outcome.loss, "micro_batches_per_rank": counts,
                                                         **outcome.metrics}))
        save_file({n: p.detach().contiguous() for n, p in engine.module.named_parameters()},
                  str(out_dir / "params.safetensors"))
    dist.barrier()


def main() -> None:
    model_dir, cases = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
    ensure_single_process_env()
    init_distributed(torch.device("cpu"))
    rank, world = dist.get_rank(), dist.get_world_size()
    for case in cases:
        run_case(model_dir, case, rank, world)


if __name__ == "__main__":
    main()
