"""``grpo learner``: pull batches, apply the GRPO step with DeepSpeed, publish weights, checkpoint, log metrics.

One process per rank (``grpo learner`` alone is a world of one; ``torchrun -m deploy.cli learner`` or
``deepspeed --module deploy.cli learner`` start several). Ranks stay in lockstep: a stop request (SIGTERM/SIGINT on
any rank) and "I have a batch" are agreed on with an all-reduce before each step, so no rank is left waiting in a
collective that the others have abandoned.

The loop, as :meth:`Learner.run` reads: lease a batch from the hub (dropping groups already trained on), compute
advantages over the whole batch, split it into micro-batches, apply ``updates_per_batch`` GRPO steps, publish the
weights, log, checkpoint, acknowledge the batch to the hub.
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
from learner.delivery import DeliveryLedger
from learner.engine import (
    LearnerSetupError,
    create_engine,
    ensure_single_process_env,
    init_distributed,
    uses_bf16,
)
from learner.metrics import MetricsLogger
from learner.publish import export_hf_folder, publish
from learner.step import (
    all_reduce,
    batch_advantages,
    batch_metrics,
    grpo_step,
    recompute_old_logprobs,
    split_micro_batches,
)
from shared.client import HubClient, HubUnavailable, service_client, stop_on_signals
from shared.devices import resolve_device
from shared.errors import ServiceError, UsageError
from shared.protocol import TrainBatch
from shared.schema import GRPOConfig

log = logging.getLogger("grpo.learner")


class NonFiniteLossError(ServiceError):
    """Too many NaN/inf losses in a row (learner.max_nonfinite_steps)."""


@dataclass
class LearnerResult:
    steps: int
    version: int
    skipped_nonfinite: int
    stopped_by_signal: bool
    duplicate_groups: int = 0


def _agree(flag: bool, device: torch.device, op=dist.ReduceOp.MAX) -> bool:
    return bool(all_reduce(torch.tensor([1.0 if flag else 0.0], device=device), op).item() > 0.5)


def wait_for_batch(client: HubClient, num_groups: int, wait_s: float, stop: threading.Event,
                   metrics: MetricsLogger, ledger: DeliveryLedger) -> TrainBatch | None:
    """Long-poll the hub until a batch with untrained groups arrives (progress message every wait) or a stop is
    requested.

    An unreachable hub raises HubUnavailable (after the client's retries): never an endless 'waiting for batch'."""
    started = time.monotonic()
    while not stop.is_set():
        try:
            batch = client.get_batch(num_groups, wait_s=wait_s)
            if batch is not None:
                batch = ledger.fresh_part(batch)
                if batch is not None:
                    return batch
                continue
            stats = client.hub_stats()
        except HubUnavailable:
            if stop.is_set():  # shutting down and the hub is gone too: nothing left to wait for
                return None
            raise
        metrics.message(f"waiting for {num_groups} groups: hub holds {stats['ready']} ready of "
                        f"{stats['queue_depth']} queued, waited {time.monotonic() - started:.0f}s")
    return None


class Learner:
    """One rank of the learner: its engine, its hub client, and where training stands."""

    def __init__(self, config: GRPOConfig, *, resume: bool = False, stop: threading.Event | None = None) -> None:
        from transformers import AutoModelForCausalLM

        self.config, self.cfg = config, config.learner
        cfg = self.cfg
        if cfg.model is None:
            raise UsageError("learner.model is not set (pass --model or set it in the config)")
        self.stop = stop or threading.Event()
        self.client = service_client(cfg.hub_url, config.ref_server.token, cfg.retry_max_s)
        stop_on_signals(self.stop, self.client, "finishing this step, checkpointing, exiting")
        ensure_single_process_env()
        self.device = resolve_device(cfg.device, local_rank=int(os.environ.get("LOCAL_RANK", "0")))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        init_distributed(self.device)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(config.seed + self.rank)
        dtype = torch.bfloat16 if uses_bf16(cfg, self.device) else torch.float32
        self.engine = create_engine(cfg, AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype), self.device)
        self.step = self.version = 0
        consumed: list[str] = []
        if resume and (state := load_latest(self.engine, cfg.checkpoint_dir)) is not None:
            self.step, self.version, consumed = state["step"], state["version"], state["consumed"]
        self.metrics = MetricsLogger(jsonl=cfg.metrics_jsonl, tensorboard_dir=cfg.tensorboard_dir,
                                     wandb_project=cfg.wandb_project, enabled=self.rank == 0,
                                     total_steps=cfg.max_steps, run_config=config.model_dump(mode="json"))
        self.ledger = DeliveryLedger(self.client, ack_on_checkpoint=cfg.checkpoint_every is not None,
                                     lease_timeout_s=self.client.hub_stats()["lease_timeout_s"], consumed=consumed)
        self.hub_version = self._check_hub(resume, dtype)
        self.skipped = self.nonfinite_in_row = 0
        self.staging = os.path.join(cfg.checkpoint_dir, "..", "publish")

    def _check_hub(self, resume: bool, dtype: torch.dtype) -> int:
        """Refuse a hub this run cannot train against (no reference model for beta > 0, an earlier run's weights);
        report the starting version. Returns the hub's newest weights version."""
        if self.config.algorithm.loss.beta > 0 and not self.client.health()["reference_model_loaded"]:
            raise LearnerSetupError(
                f"algorithm.loss.beta is {self.config.algorithm.loss.beta} but the ref server at {self.cfg.hub_url} "
                "has no reference model loaded (its algorithm.loss.beta is 0?): start both with the same config")
        hub_version = self.client.weights_version() or 0
        if hub_version > self.version and not resume:
            raise LearnerSetupError(
                f"the hub already holds weights version {hub_version} from an earlier run; a fresh learner would "
                "train against them. Start the ref server with empty ref_server.weights_dir and spool_dir, or pass "
                "--resume")
        if self.rank == 0:
            self.client.report_version(max(self.version, hub_version))
            log.info("learner: %d rank(s) on %s, ZeRO-%d, %s, step %d, version %d", self.world, self.device.type,
                     self.cfg.zero_stage, dtype, self.step, self.version)
        return hub_version

    # -- the loop -----------------------------------------------------------------------------------------
    def run(self) -> LearnerResult:
        cfg = self.cfg
        try:
            while cfg.max_steps is None or self.step < cfg.max_steps:
                started = time.perf_counter()
                batch = self.next_batch()
                if batch is None:
                    break
                self.train_on(batch, waited=time.perf_counter() - started)
            self.finish()
        finally:
            self.metrics.close()
            self.client.close()
        return LearnerResult(self.step, self.version, self.skipped, self.stop.is_set(), self.ledger.duplicates)

    def next_batch(self) -> TrainBatch | None:
        """The next batch of untrained groups, or None once any rank was asked to stop (all ranks agree)."""
        if _agree(self.stop.is_set(), self.device):
            self.stop.set()
            return None
        batch = wait_for_batch(self.client, self.cfg.groups_per_step, self.cfg.batch_wait_s, self.stop,
                               self.metrics, self.ledger)
        if _agree(batch is None, self.device):  # a rank stopped while waiting: everyone stops
            self.stop.set()
            return None
        return batch

    def train_on(self, batch: TrainBatch, waited: float) -> None:
        """``updates_per_batch`` GRPO steps on one batch, each followed by publishing and logging; then the batch
        counts as trained (before any checkpoint, so that a checkpoint holding its update also holds its ids)."""
        cfg, algorithm = self.cfg, self.config.algorithm
        advantages = batch_advantages(batch, algorithm.advantage)
        micro = split_micro_batches(batch, advantages, cfg.micro_batches, cfg.mask_truncated, self.device)
        if cfg.old_logprobs == "recompute":
            recompute_old_logprobs(self.engine.module, micro, batch.temperature, cfg.logprob_chunk_tokens)
        rollout_metrics = batch_metrics(batch, advantages, self.version)
        tokens = float(all_reduce(torch.tensor([float((batch.prompt_lengths + batch.completion_lengths).sum())],
                                               device=self.device)).item())
        first_step = self.step
        for _ in range(cfg.updates_per_batch):
            lr = float(self.engine.get_lr()[0])  # the rate this step uses (the scheduler advances in step())
            compute_started = time.perf_counter()
            outcome = grpo_step(self.engine, micro, algorithm.loss, temperature=batch.temperature,
                                old_mode=cfg.old_logprobs, world_size=self.world, log_entropy=cfg.log_entropy,
                                chunk_tokens=cfg.logprob_chunk_tokens)
            compute_s = time.perf_counter() - compute_started
            if not outcome.finite:
                self._skip_nonfinite()
                continue
            self.nonfinite_in_row = 0
            self.step += 1
            publish_s = self.publish_if_due()
            self.metrics.log(self.step, {
                **rollout_metrics, **outcome.metrics, "loss": outcome.loss, "version": self.version, "lr": lr,
                "time_wait_s": waited, "time_compute_s": compute_s, "time_publish_s": publish_s,
                "tokens_per_s": tokens / max(compute_s, 1e-9), "skipped_nonfinite": self.skipped,
                "duplicate_groups": self.ledger.duplicates})
            waited = 0.0
            if cfg.max_steps is not None and self.step >= cfg.max_steps:
                break
        self.ledger.trained(batch)
        if cfg.checkpoint_every and self.step // cfg.checkpoint_every > first_step // cfg.checkpoint_every:
            self.checkpoint()

    def _skip_nonfinite(self) -> None:
        self.skipped += 1
        self.nonfinite_in_row += 1
        log.warning("non-finite loss at step %d: step skipped (%d in a row)", self.step + 1, self.nonfinite_in_row)
        if self.nonfinite_in_row >= self.cfg.max_nonfinite_steps:
            raise NonFiniteLossError(f"{self.nonfinite_in_row} non-finite losses in a row; stopping")

    def publish_if_due(self) -> float:
        """Publish the weights every ``publish_every`` steps; returns the seconds it took."""
        if self.step % self.cfg.publish_every:
            return 0.0
        started = time.perf_counter()
        # version = step; after resuming behind a hub that already published newer weights (a crash between
        # publishing and checkpointing), versions continue after the hub's so they stay monotonic for generators
        self.version = max(self.step, self.hub_version + 1)
        publish(self.engine, self.client, self.version, self.staging, rank=self.rank)
        self.hub_version = self.version
        if self.rank == 0:
            self.client.report_version(self.version)
        return time.perf_counter() - started

    def checkpoint(self) -> None:
        save_checkpoint(self.engine, self.cfg.checkpoint_dir, step=self.step, version=self.version,
                        keep=self.cfg.keep_checkpoints, rank=self.rank, consumed=self.ledger.consumed_ids())
        self.ledger.checkpointed()

    def finish(self) -> None:
        """A last checkpoint (unless the newest step has one, which acknowledged its batches), and the Hugging Face
        folder."""
        cfg = self.cfg
        if self.stop.is_set() or not cfg.checkpoint_every or self.step % cfg.checkpoint_every:
            self.checkpoint()
        export_hf_folder(self.engine, cfg.model, cfg.output_dir, rank=self.rank)


def run_learner(config: GRPOConfig, *, resume: bool = False, stop: threading.Event | None = None) -> LearnerResult:
    return Learner(config, resume=resume, stop=stop).run()
