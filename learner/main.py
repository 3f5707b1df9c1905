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

from learner.advantages import AdvantageLog, batch_advantages, distill_metrics, learner_logprobs
from learner.checkpoint import load_latest, save_checkpoint
from learner.delivery import DeliveryLedger
from learner.engine import (
    collective_errors,
    ensure_single_process_env,
    init_distributed,
    load_engine,
    uses_bf16,
)
from learner.entropy_control import EntropyControl
from learner.metrics import LappedEngine, MetricsLogger, StepClock, accuracy_judge, batch_metrics
from learner.prefetch import BatchPrefetcher, HubCalls
from learner.session import SessionRefusedError, check_hub, end_session, register_session
from learner.step import (
    apply_off_policy,
    batch_tokens,
    grpo_step,
    ranks_agree,
    recompute_old_logprobs,
    split_micro_batches,
)
from shared.config.schema import GRPOConfig
from shared.devices import resolve_device
from shared.errors import ServiceError, UsageError
from shared.progress import startup_phase
from shared.protocol.client import HubClient, LearnerSession, service_client, stop_on_signals
from shared.protocol.numbers import batch_problem
from shared.protocol.records import TrainBatch
from shared.weight_sync.export import export_hf_folder
from shared.weight_sync.publisher import WeightPublisher

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


AGREE_EVERY_S = 2.0  # ranks waiting for their batches agree this often whether all have one (or one stopped)


def require_state_folders(cfg) -> None:
    """The learner writes its model and checkpoints somewhere named: no run folder and no path of their own is an
    error (shared/config/schema/paths.py), never a default folder another run may share."""
    for key in ("output_dir", "checkpoint_dir"):
        if getattr(cfg, key) is None:
            raise UsageError(f"learner.{key} is not set: set run.run_dir (every state folder goes under it) or "
                             f"learner.{key}")


class Learner:
    """One rank of the learner: its engine, its hub client, and where training stands."""

    def __init__(self, config: GRPOConfig, *, resume: bool = False, stop: threading.Event | None = None) -> None:
        self.config, self.cfg = config, config.learner
        cfg = self.cfg
        if cfg.model is None:
            raise UsageError("learner.model is not set (pass --model or set it in the config)")
        require_state_folders(cfg)
        self.stop = stop or threading.Event()
        # the hub takes version reports and weights only from this learner's session (registered below)
        self.session = LearnerSession()
        self.client = self._client()
        stop_on_signals(self.stop, self.client, "finishing this step, checkpointing, exiting")
        ensure_single_process_env()
        self.device = resolve_device(cfg.device, local_rank=int(os.environ.get("LOCAL_RANK", "0")))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        init_distributed(self.device, cfg.rendezvous_timeout_s, cfg.collective_timeout_s)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(config.seed + self.rank)
        dtype = torch.bfloat16 if uses_bf16(cfg, self.device) else torch.float32
        self.engine = load_engine(cfg, dtype, self.device, say=self._startup)
        consumed, unacked = self._restore(resume)
        self.advantage_log = (AdvantageLog(cfg.advantages_jsonl, self.rank, config.algorithm,
                                           mask_truncated=cfg.mask_truncated) if cfg.advantages_jsonl else None)
        self.metrics = MetricsLogger(jsonl=cfg.metrics_jsonl, tensorboard_dir=cfg.tensorboard_dir,
                                     wandb_project=cfg.wandb_project, enabled=self.rank == 0,
                                     total_steps=cfg.max_steps, run_config=config.model_dump(mode="json"),
                                     warn_mismatch_kl=config.algorithm.off_policy.warn_mismatch_kl)
        # acknowledgements and lease renewals leave from a background thread (its own client)
        self.hub_calls = HubCalls(self._client())
        self._startup(f"registering with the hub at {cfg.hub_url}")
        hub_stats = self.client.hub_stats()
        self.ledger = DeliveryLedger(self.client, ack_on_checkpoint=cfg.checkpoint_every is not None,
                                     lease_timeout_s=hub_stats["lease_timeout_s"], consumed=consumed,
                                     calls=self.hub_calls.submit,  # its timer also keeps rank 0's session live
                                     heartbeat=HubClient.renew_learner_session if self.rank == 0 else None,
                                     session_ttl_s=hub_stats.get("learner_session_ttl_s")).start()
        self.hub_version = self._check_hub(resume, dtype)
        # weight sync: a send buffer on rank 0 and background transfers (its threads get their own clients)
        self.publisher = WeightPublisher(
            self.engine.module, self._client, config.weight_sync, rank=self.rank, world=self.world,
            device=self.device, relay_version=self.relay_at_start, adapter_only=cfg.publishes_adapter)
        self._register(resume, unacked)
        # the next batch is leased and decoded while this one trains (its own client: sessions are per thread)
        self.prefetcher = BatchPrefetcher(service_client(cfg.hub_url, config.ref_server.token, cfg.retry_max_s),
                                          cfg.groups_per_step, cfg.batch_wait_s, self.stop, self.ledger,
                                          progress=self.metrics.message, max_batches=self._batches_left(),
                                          # the hub's bound (its config is the one that counts)
                                          max_staleness=hub_stats["max_staleness"], start_version=self.version,
                                          version_after_batch=self.version_after_batch)
        self.lag_buckets = int(hub_stats["max_staleness"]) + 1  # drift by version lag 0..max_staleness, every rank
        self.fetched, self.clock = None, StepClock()   # fetched: how the batch in training came (background times)
        self.timed_engine = LappedEngine(self.engine, self.clock)
        self.skipped = self.nonfinite_in_row = 0
        self._said_prefix = False

    def _restore(self, resume: bool) -> tuple[list[str], list[str]]:
        """Step, version and controls from the newest checkpoint (``resume``), else from scratch; returns the groups
        it trained on and the batches it holds whose acknowledgement may not have arrived."""
        self.step = self.version = 0
        state = None
        if resume:
            self._startup(f"loading the newest checkpoint of {self.cfg.checkpoint_dir}")
            state = load_latest(self.engine, self.cfg.checkpoint_dir)
        self.entropy = EntropyControl(self.config.algorithm.entropy, (state or {}).get("controls", {}).get("entropy"))
        if state is None:
            return [], []
        self.step, self.version = state["step"], state["version"]
        return state["consumed"], state["unacknowledged"]

    def _startup(self, phase: str) -> None:
        """What this learner does now while it starts (`grpo run` shows it until the first step: rank 0's)."""
        if self.rank == 0:
            startup_phase(log, phase)

    def _batches_left(self) -> int | None:
        """The batches still to train (None: no max_steps): none is leased past them, so nothing is left to hand
        back at the end."""
        return None if self.cfg.max_steps is None else self.cfg.max_steps - self.step

    def _register(self, resume: bool, unacked: list[str]) -> None:
        """Rank 0 registers the learner's session (learner/session.py); a refusal stops every rank."""
        refused = None
        if self.rank == 0:
            refused = register_session(self.client, self.cfg.checkpoint_dir, max(self.version, self.hub_version),
                                       self.cfg.groups_per_step * self.world, self.publisher.layout.to_json(),
                                       resume=resume, unacked=unacked, submit=self.hub_calls.submit)
        if ranks_agree(refused is not None, self.device):
            raise SessionRefusedError(f"the hub at {self.cfg.hub_url} refused this learner: {refused}"
                                      if refused else "the hub refused rank 0's registration (its log says why)")
        # resumed ahead of the relay: joining generators need these weights (older ones sample only stale groups)
        if ranks_agree(resume and self.step > 0 and (self.relay_at_start or 0) < self.version, self.device):
            self.publisher.publish(self.version)

    def _client(self) -> HubClient:
        """A client of this learner's (one per thread: a requests session is not meant to be shared)."""
        client = service_client(self.cfg.hub_url, self.config.ref_server.token, self.cfg.retry_max_s)
        client.learner = self.session
        return client

    def _check_hub(self, resume: bool, dtype: torch.dtype) -> int:
        """:func:`learner.session.check_hub` (what the relay holds is kept: offers name it to generators); returns
        the hub's newest weights version."""
        self.relay_at_start, hub_version = check_hub(self.client, self.config, resume=resume, version=self.version)
        if self.rank == 0:
            log.info("learner: %d rank(s) on %s, ZeRO-%d, %s, step %d, version %d", self.world, self.device.type,
                     self.cfg.zero_stage, dtype, self.step, self.version)
        return hub_version

    # -- the loop -----------------------------------------------------------------------------------------
    def run(self) -> LearnerResult:
        cfg = self.cfg
        try:
            self.clock = StepClock()  # the first step's wall time starts here, after set-up
            self.timed_engine = LappedEngine(self.engine, self.clock)
            first = self.step + 1
            self._startup(f"waiting for the first batch ({cfg.groups_per_step * self.world} groups from the "
                          "generators)")
            while cfg.max_steps is None or self.step < cfg.max_steps:
                batch = self.next_batch()
                self.clock.lap("wait")
                if batch is None:
                    break
                if self.step < first:
                    self._startup(f"training step {first}")
                self.train_on(batch)
            self.prefetcher.close()
            self.finish()
            self.hub_calls.flush()  # every acknowledgement reached the hub before the learner reports success
        finally:
            self.ledger.close()
            self.hub_calls.close()
            self.publisher.close()
            self.prefetcher.close()
            if self.rank == 0:
                end_session(self.client)
            self.metrics.close()
            if self.advantage_log is not None:
                self.advantage_log.close()
            self.client.close()
        return LearnerResult(self.step, self.version, self.skipped, self.stop.is_set(), self.ledger.duplicates)

    def next_batch(self) -> TrainBatch | None:
        """The next batch of untrained groups, or None once any rank was asked to stop (all ranks agree).

        Each rank waits for its own batch in slices of ``AGREE_EVERY_S`` and the ranks agree after each slice, so
        no rank sits in a collective while another waits for groups (learner.collective_timeout_s bounds the
        collectives, not the hub's supply)."""
        held = None   # this rank's batch, kept while another rank still waits for its own
        while True:
            if ranks_agree(self.stop.is_set(), self.device):
                self.stop.set()
                if held is not None and held[0] is not None:
                    self.prefetcher.give_back(held[0])   # leased, never trained: back to the hub at once
                return None
            if held is None:
                held = self.prefetcher.next(wait_s=AGREE_EVERY_S)
            if ranks_agree(held is None, self.device):   # a rank still waits for its batch: ask again
                continue
            batch, fetched = held
            held = None
            if ranks_agree(batch is None, self.device):  # a rank stopped while waiting: everyone stops
                self.stop.set()
                if batch is not None:
                    self.prefetcher.give_back(batch)
                return None
            problem = batch_problem(batch, getattr(self.engine.module.get_input_embeddings(), "num_embeddings", None))
            if not ranks_agree(problem is not None, self.device):
                self.fetched = fetched
                return batch
            self._set_aside(batch, problem)

    def _set_aside(self, batch: TrainBatch, problem: str | None) -> None:
        """A batch (this rank's or another's) that cannot be trained: the bad one is left unacknowledged, so that
        its lease expires as a failed delivery and the hub isolates and quarantines the culprit
        (ref_server.max_deliveries); a good one is handed back for a later step."""
        # a ledger that renews leased-untrained batches on a timer must stop renewing this one (else it never expires)
        self.ledger.forget(batch.batch_id)  # not renewed any more: its lease expires and the hub counts the failure
        self.prefetcher.set_aside()         # it does not count against max_steps: another batch is wanted
        if problem is None:
            self.hub_calls.submit(lambda client, ids=[batch.batch_id]: client.release_batches(ids))
            return
        log.error("batch %s cannot be trained (%s): left unacknowledged; the hub quarantines the group after "
                  "ref_server.max_deliveries failed deliveries", batch.batch_id, problem)

    def train_on(self, batch: TrainBatch) -> None:
        """``updates_per_batch`` GRPO steps on one batch, each followed by publishing and logging; then the batch
        counts as trained (before any checkpoint, so that a checkpoint holding its update also holds its ids)."""
        cfg, algorithm, clock = self.cfg, self.config.algorithm, self.clock
        student = learner_logprobs(self.engine.module, batch, self.device, self.config, clock)
        topk_coef = algorithm.distill.coef if algorithm.distill_top_k else 0.0  # top-k distillation: a loss term
        advantages = batch_advantages(batch, algorithm.advantage, algorithm.kl, algorithm.distill, student)
        rollout_metrics = {**batch_metrics(batch, advantages, self.version, algorithm, accuracy_judge(self.config)),
                           **distill_metrics(batch, student)}
        if self.advantage_log is not None:
            self.advantage_log.write(self.step + 1, batch, advantages)
        # host numbers from host tensors (the batch is still on the CPU here): no device round trip for them
        tokens = batch_tokens(batch, self.world, self.device)
        clock.lap("advantages")
        micro = split_micro_batches(batch, advantages, cfg.micro_batches, cfg.mask_truncated, self.device,
                                    token_budget=cfg.micro_batch_tokens, packing=cfg.packing,
                                    prefix_sharing="off" if cfg.gradient_checkpointing else cfg.prefix_sharing,
                                    learner_version=self.version)
        if micro[0].prefix is not None and not self._said_prefix:
            self._said_prefix = True
            log.info("prefix sharing: %d prompt passes for %d rows in the first micro-batch (learner.prefix_sharing "
                     "%s)", micro[0].prefix.num_prompts, len(micro[0].prompt_lengths), cfg.prefix_sharing)
        clock.lap("host_to_device")
        old_mode = self.old_logprobs(micro, batch.temperature)
        fetched, self.fetched = self.fetched, None
        first_step = self.step
        for _ in range(cfg.updates_per_batch):
            lr = float(self.engine.get_lr()[0])  # the rate this step uses (the scheduler advances in step())
            outcome = grpo_step(self.timed_engine, micro, algorithm.loss, temperature=batch.temperature,
                                old_mode=old_mode, world_size=self.world, log_entropy=cfg.log_entropy,
                                chunk_tokens=cfg.logprob_chunk_tokens, lag_buckets=self.lag_buckets,
                                entropy_coef=self.entropy.coef, distill_coef=topk_coef)
            clock.lap("step_reduce")
            if not outcome.finite:
                self._skip_nonfinite()
                continue
            self.nonfinite_in_row = 0
            self.entropy.after_step(outcome.metrics)
            self.step += 1
            self.publish_if_due()
            clock.lap("version_report")
            times = clock.take()
            background = {"time_fetch_background_s": fetched.fetch_s,
                          "time_decode_background_s": fetched.decode_s} if fetched is not None else {}
            fetched = None
            self.metrics.log(self.step, {
                **rollout_metrics, **outcome.metrics, "loss": outcome.loss, "version": self.version, "lr": lr,
                **times, **background, "tokens_per_s": tokens / max(times["time_compute_s"], 1e-9),
                "skipped_nonfinite": self.skipped, "duplicate_groups": self.ledger.duplicates,
                **self.publisher.metrics()})
            clock.lap("metrics")
            if cfg.max_steps is not None and self.step >= cfg.max_steps:
                break
        self.ledger.trained(batch)
        clock.lap("ledger")
        if cfg.checkpoint_every and self.step // cfg.checkpoint_every > first_step // cfg.checkpoint_every:
            self.checkpoint()
            clock.lap("checkpoint")

    def old_logprobs(self, micro: list, temperature: float) -> str:
        """grpo_step's ``old_mode``: 'recompute' (pi_old recomputed, the off-policy correction applied against the
        behaviour logprobs) or, with ``GRPOConfig.off_policy_bypass``, 'behaviour' (no forward pass)."""
        if self.config.off_policy_bypass:
            return "behaviour"
        recompute_old_logprobs(self.engine.module, micro, temperature, self.cfg.logprob_chunk_tokens)
        apply_off_policy(micro, self.config.algorithm.off_policy)
        self.clock.lap("old_logprobs")
        return "recompute"

    def version_after_batch(self) -> int:
        """The version this learner will hold once the batch it is about to train is applied: the last step of the
        batch's ``updates_per_batch`` that publishes (``publish_every``). Non-finite steps make it lower, which only
        makes the next lease's staleness bound stricter."""
        end = self.step + self.cfg.updates_per_batch
        last_publish = end - end % self.cfg.publish_every
        return max(self.version, last_publish) if last_publish > self.step else self.version

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
        # the copy into the send buffer; the transfer runs in the background (shared/weight_sync/sender.py)
        self.publisher.publish(self.version)
        self.hub_version = self.version
        self.clock.lap("publish")
        if self.rank == 0:
            # in order with the acknowledgements, from the background thread: the hub hears of the version a few
            # milliseconds later (it only sets which queued groups count as stale), the step does not wait for it
            version, groups = self.version, self.cfg.groups_per_step * self.world
            self.hub_calls.submit(lambda client: client.report_version(version, groups))
        return time.perf_counter() - started

    def checkpoint(self) -> None:
        save_checkpoint(self.engine, self.cfg.checkpoint_dir, step=self.step, version=self.version,
                        keep=self.cfg.keep_checkpoints, rank=self.rank, consumed=self.ledger.consumed_ids(),
                        unacknowledged=self.ledger.unacknowledged(), lora=self.cfg.lora, base_model=self.cfg.model,
                        controls={"entropy": self.entropy.state()})
        self.ledger.checkpointed()

    def finish(self) -> None:
        """A last checkpoint where one is due, and the Hugging Face folder; neither before a first step (nothing to
        resume or export). Stopped by a signal: always. Finished: with checkpoint_every set, unless the newest step has
        one (a checkpoint acknowledges its batches); with it null, none (the model folder alone)."""
        cfg = self.cfg
        if self.step and (self.stop.is_set() or (cfg.checkpoint_every and self.step % cfg.checkpoint_every)):
            self.checkpoint()
        self.publisher.finish(self.version, stopping=self.stop.is_set())  # the last version reaches the relay
        if self.step:
            export_hf_folder(self.engine, cfg.model, cfg.output_dir, rank=self.rank)


def run_learner(config: GRPOConfig, *, resume: bool = False, stop: threading.Event | None = None) -> LearnerResult:
    with collective_errors(config.learner.collective_timeout_s):  # a peer rank gone: one line naming the setting
        return Learner(config, resume=resume, stop=stop).run()
