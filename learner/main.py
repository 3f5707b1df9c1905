"""``grpo learner``: pull batches, apply the GRPO step with DeepSpeed, publish weights, checkpoint, log metrics.

One process per rank (``grpo learner`` alone is a world of one; ``torchrun -m deploy.cli learner`` or
``deepspeed --module deploy.cli learner`` start several). Ranks stay in lockstep: a stop request (SIGTERM/SIGINT on
any rank) and "I have a batch" are agreed on with an all-reduce before each step, so no rank is left waiting in a
collective that the others have abandoned.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from learner.checkpoint import load_latest, save_checkpoint
from learner.engine import (
    LearnerSetupError,
    create_engine,
    ensure_single_process_env,
    init_distributed,
    resolve_device,
    uses_bf16,
)
from learner.metrics import MetricsLogger
from learner.publish import export_hf_folder, publish
from learner.step import all_reduce, batch_metrics, grpo_step, recompute_old_logprobs, split_micro_batches
from shared.client import HubClient, HubUnavailable, service_client, stop_on_signals
from shared.protocol import TrainBatch
from shared.schema import GRPOConfig

log = logging.getLogger("grpo.learner")


class NonFiniteLossError(RuntimeError):
    """Too many NaN/inf losses in a row (learner.max_nonfinite_steps)."""


@dataclass
class LearnerResult:
    steps: int
    version: int
    skipped_nonfinite: int
    stopped_by_signal: bool


def _agree(flag: bool, device: torch.device, op=dist.ReduceOp.MAX) -> bool:
    return bool(all_reduce(torch.tensor([1.0 if flag else 0.0], device=device), op).item() > 0.5)


def wait_for_batch(client: HubClient, num_groups: int, wait_s: float, stop: threading.Event,
                   metrics: MetricsLogger) -> TrainBatch | None:
    """Long-poll the hub until a batch arrives (progress message every wait) or a stop is requested.

    An unreachable hub raises HubUnavailable (after the client's retries): never an endless 'waiting for batch'."""
    started = time.monotonic()
    while not stop.is_set():
        try:
            batch = client.get_batch(num_groups, wait_s=wait_s)
            if batch is not None:
                return batch
            stats = client.hub_stats()
        except HubUnavailable:
            if stop.is_set():  # shutting down and the hub is gone too: nothing left to wait for
                return None
            raise
        metrics.message(f"waiting for {num_groups} groups: hub holds {stats['ready']} ready of "
                        f"{stats['queue_depth']} queued, waited {time.monotonic() - started:.0f}s")
    return None


def run_learner(config: GRPOConfig, *, resume: bool = False, stop: threading.Event | None = None) -> LearnerResult:
    from transformers import AutoModelForCausalLM

    cfg = config.learner
    if cfg.model is None:
        raise ValueError("learner.model is not set (pass --model or set it in the config)")
    stop = stop or threading.Event()
    client = service_client(cfg.hub_url, config.ref_server.token, cfg.retry_max_s)
    stop_on_signals(stop, client, "finishing this step, checkpointing, exiting")
    ensure_single_process_env()
    device = resolve_device(cfg.device)
    init_distributed(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(config.seed + rank)
    dtype = torch.bfloat16 if uses_bf16(cfg, device) else torch.float32
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype)
    engine = create_engine(cfg, model, device)
    step = version = 0
    if resume and (state := load_latest(engine, cfg.checkpoint_dir)) is not None:
        step, version = state["step"], state["version"]
    metrics = MetricsLogger(jsonl=cfg.metrics_jsonl, tensorboard_dir=cfg.tensorboard_dir,
                            wandb_project=cfg.wandb_project, enabled=rank == 0, total_steps=cfg.max_steps,
                            run_config=config.model_dump(mode="json"))
    hub_version = client.weights_version() or 0
    if hub_version > version and not resume:
        raise LearnerSetupError(
            f"the hub already holds weights version {hub_version} from an earlier run; a fresh learner would train "
            f"against them. Start the ref server with empty ref_server.weights_dir and spool_dir, or pass --resume")
    if rank == 0:
        client.report_version(max(version, hub_version))
        log.info("learner: %d rank(s) on %s, ZeRO-%d, %s, step %d, version %d", world, device.type,
                 cfg.zero_stage, dtype, step, version)
    nonfinite_in_row = skipped = 0
    staging = os.path.join(cfg.checkpoint_dir, "..", "publish")
    try:
        while cfg.max_steps is None or step < cfg.max_steps:
            if _agree(stop.is_set(), device):
                stop.set()
                break
            started = time.perf_counter()
            batch = wait_for_batch(client, cfg.groups_per_step, cfg.batch_wait_s, stop, metrics)
            if _agree(batch is None, device):  # a rank stopped while waiting: everyone stops
                stop.set()
                break
            waited = time.perf_counter() - started
            micro = split_micro_batches(batch, cfg.micro_batches, cfg.mask_truncated, device)
            if cfg.old_logprobs == "recompute":
                recompute_old_logprobs(engine.module, micro, batch.temperature, cfg.logprob_chunk_tokens)
            rollout_metrics = batch_metrics(batch, version)
            tokens = float(all_reduce(torch.tensor([float((batch.prompt_lengths + batch.completion_lengths).sum())],
                                                   device=device)).item())
            for _ in range(cfg.updates_per_batch):
                lr = float(engine.get_lr()[0])  # the rate this step uses (the scheduler advances in step())
                compute_started = time.perf_counter()
                outcome = grpo_step(engine, micro, config.algorithm.loss, temperature=batch.temperature,
                                    old_mode=cfg.old_logprobs, world_size=world, log_entropy=cfg.log_entropy,
                                    chunk_tokens=cfg.logprob_chunk_tokens)
                compute_s = time.perf_counter() - compute_started
                if not outcome.finite:
                    skipped += 1
                    nonfinite_in_row += 1
                    log.warning("non-finite loss at step %d: step skipped (%d in a row)", step + 1, nonfinite_in_row)
                    if nonfinite_in_row >= cfg.max_nonfinite_steps:
                        raise NonFiniteLossError(f"{nonfinite_in_row} non-finite losses in a row; stopping")
                    continue
                nonfinite_in_row = 0
                step += 1
                publish_s = 0.0
                if step % cfg.publish_every == 0:
                    publish_started = time.perf_counter()
                    # version = step; after resuming behind a hub that already published newer weights (a crash
                    # between publishing and checkpointing), versions continue after the hub's so they stay
                    # monotonic for the generators
                    version = max(step, hub_version + 1)
                    publish(engine, client, version, staging, rank=rank)
                    hub_version = version
                    if rank == 0:
                        client.report_version(version)
                    publish_s = time.perf_counter() - publish_started
                metrics.log(step, {
                    **rollout_metrics, **outcome.metrics, "loss": outcome.loss, "version": version,
                    "lr": lr, "time_wait_s": waited, "time_compute_s": compute_s,
                    "time_publish_s": publish_s, "tokens_per_s": tokens / max(compute_s, 1e-9),
                    "skipped_nonfinite": skipped})
                waited = 0.0
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    save_checkpoint(engine, cfg.checkpoint_dir, step=step, version=version,
                                    keep=cfg.keep_checkpoints, rank=rank)
                if cfg.max_steps is not None and step >= cfg.max_steps:
                    break
        if stop.is_set() or not cfg.checkpoint_every or step % cfg.checkpoint_every:
            save_checkpoint(engine, cfg.checkpoint_dir, step=step, version=version, keep=cfg.keep_checkpoints,
                            rank=rank)
        export_hf_folder(engine, cfg.model, cfg.output_dir, rank=rank)
    finally:
        metrics.close()
        client.close()
    return LearnerResult(step, version, skipped, stop.is_set())
