"""DeepSpeed set-up: the distributed environment, the DeepSpeed config generated from ours, the engine."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from learner import schedule
from shared.config.schema import LearnerConfig
from shared.errors import ServiceError, UsageError
from shared.forward.logit_transform import final_logit_transform

log = logging.getLogger("grpo.learner")


class LearnerSetupError(UsageError):
    """The learner cannot start; the message names the setting or file."""


class CollectiveFailed(ServiceError):
    """A collective between learner ranks failed: a peer rank died, hung or is cut off (the message names
    learner.collective_timeout_s)."""


def ensure_single_process_env() -> None:
    """DeepSpeed needs a process group even for one process; without a launcher, describe a world of one."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def uses_bf16(cfg: LearnerConfig, device: torch.device) -> bool:
    return cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")


def lr_multiplier(cfg: LearnerConfig, step: int) -> float:
    """Fraction of ``cfg.lr`` used by optimizer step ``step`` (0-based): ``cfg.lr_schedule`` after
    ``cfg.warmup_steps`` of linear warm-up (:func:`learner.schedule.lr_multiplier`)."""
    return schedule.lr_multiplier(step, schedule=cfg.lr_schedule, warmup_steps=cfg.warmup_steps,
                                  max_steps=cfg.max_steps, min_lr_ratio=cfg.min_lr_ratio)


def deepspeed_config(cfg: LearnerConfig, world_size: int, device: torch.device) -> dict[str, Any]:
    """The DeepSpeed JSON for this learner config (or the user's raw file, with our batch bookkeeping)."""
    if cfg.deepspeed_config is not None:
        path = Path(cfg.deepspeed_config)
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise LearnerSetupError(f"cannot read learner.deepspeed_config {path}: {exc}") from None
    else:
        zero: dict[str, Any] = {"stage": cfg.zero_stage}
        if cfg.offload_optimizer:
            if cfg.zero_stage == 0:
                raise LearnerSetupError("learner.offload_optimizer needs zero_stage >= 1")
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
        adamw = {"lr": cfg.lr, "betas": list(cfg.adam_betas), "eps": cfg.adam_eps, "weight_decay": cfg.weight_decay,
                 # torch_adam: torch.optim.AdamW. Without it DeepSpeed JIT-compiles FusedAdam (or CPU Adam) with
                 # nvcc/g++ at start-up: minutes, and a crash on images that set TORCH_CUDA_ARCH_LIST=9.0a
                 "torch_adam": True}
        if device.type == "cuda" and not cfg.offload_optimizer:
            adamw["fused"] = True  # torch's own fused CUDA kernel (shipped compiled; one launch per step)
        config = {
            "optimizer": {"type": "AdamW", "params": adamw},
            "gradient_clipping": cfg.grad_clip,
            "zero_optimization": zero,
            "bf16": {"enabled": uses_bf16(cfg, device)},
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
    # One "sample" = one group. The learner owns accumulation: every backward only accumulates, and step() is
    # called once per optimizer step (so a NaN micro-batch can drop the whole step's gradients).
    config.update({
        "train_micro_batch_size_per_gpu": max(1, cfg.groups_per_step // cfg.micro_batches),
        "gradient_accumulation_steps": cfg.micro_batches,
        "managed_gradient_accumulation": False,
    })
    config.pop("train_batch_size", None)
    return config


def load_engine(cfg: LearnerConfig, dtype: torch.dtype, device: torch.device, say: Callable[[str], object]):
    """``cfg.model`` loaded in ``dtype`` and wrapped by DeepSpeed (:func:`create_engine`); ``say``: each phase, for
    the start-up lines of `grpo run` (shared/progress.py)."""
    from transformers import AutoModelForCausalLM

    say(f"loading the model {cfg.model}")
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype)
    final_logit_transform(model)  # probed before DeepSpeed: a model whose logits cannot be reproduced fails the start
    say(f"setting up DeepSpeed (ZeRO-{cfg.zero_stage}, {device.type})")
    return create_engine(cfg, model, device)


def create_engine(cfg: LearnerConfig, model: torch.nn.Module, device: torch.device):
    """``deepspeed.initialize`` on ``model`` with the generated config; returns the engine."""
    import deepspeed

    match_accelerator(device)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.attn_implementation is not None:
        try:
            model.set_attn_implementation(cfg.attn_implementation)
        except (ImportError, ValueError) as exc:
            raise LearnerSetupError(f"learner.attn_implementation {cfg.attn_implementation!r}: {exc}") from None
        log.info("learner: %s attention", model.config._attn_implementation)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    config = deepspeed_config(cfg, world_size, device)
    if cfg.lora is not None:  # before DeepSpeed: its optimizer gets the parameters that require grad, the adapters
        from learner.lora import apply_lora

        model = apply_lora(model, cfg.lora)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        log.info("learner: LoRA rank %d on %s: %d trainable parameters of %d", cfg.lora.r, cfg.lora.target_modules,
                 trainable, sum(p.numel() for p in model.parameters()))

    def scheduler(optimizer):  # DeepSpeed calls this with the optimizer it built, and checkpoints its state
        return schedule.lr_schedule(optimizer, schedule=cfg.lr_schedule, warmup_steps=cfg.warmup_steps,
                                    max_steps=cfg.max_steps, min_lr_ratio=cfg.min_lr_ratio)

    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                     if p.requires_grad],
                                      config=config, lr_scheduler=scheduler if "scheduler" not in config else None)
    return engine


def match_accelerator(device: torch.device) -> None:
    """Make DeepSpeed's accelerator the learner's device type.

    DeepSpeed picks CUDA whenever a GPU is visible and then moves the model there, whatever ``learner.device``
    says; ``device: cpu`` on a GPU machine (and the CPU tests run there) would get a model on the GPU and
    batches on the CPU. A CPU device therefore selects DeepSpeed's CPU accelerator (a no-op where it already is)."""
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if device.type == "cpu" and get_accelerator().device_name() != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        log.info("learner device cpu: DeepSpeed's CPU accelerator instead of %s", get_accelerator().device_name())
        set_accelerator(CPU_Accelerator())


def skip_shared_memory_allreduce() -> None:
    """No JIT compilation at learner start on a CPU.

    The first DeepSpeed process group on a CPU probes every DeepSpeed op with compiler subprocesses and JIT-builds
    its shared-memory all-reduce with g++ (measured 90 s on 2 busy cores; seconds even when cached, since ninja
    re-checks the build). The learner needs neither: its optimizer is torch's AdamW (``torch_adam``) and gloo
    all-reduces a world of one or a few CPU ranks. ``deepspeed.ops.__compatible_ops__`` is the table DeepSpeed
    consults (computed on first access); filled in beforehand, it names the op as not available, and DeepSpeed's
    communication backend falls back to ``torch.distributed``."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__ = {"deepspeed_shm_comm": False}


def check_rendezvous(timeout_s: float, poll_s: float = 0.5) -> None:
    """Several ranks: fail with the address instead of hanging where the ranks cannot meet (the most common
    multi-node hang). Rank 0 hosts the rendezvous, so MASTER_ADDR must be one of its own addresses; every other rank
    waits up to ``timeout_s`` for MASTER_ADDR:MASTER_PORT to accept a connection (rank 0 may still be loading)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    address, port, rank = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"), os.environ.get("RANK")
    if not address or not port or not port.isdigit():
        raise LearnerSetupError(f"WORLD_SIZE is {os.environ['WORLD_SIZE']} but MASTER_ADDR/MASTER_PORT are "
                                f"{address!r}/{port!r}: the launcher must set the first rank's address and a port")
    if rank == "0":
        try:
            with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as sock:
                sock.bind((address, 0))
        except OSError as exc:
            raise LearnerSetupError(f"rank 0 hosts the rendezvous at MASTER_ADDR {address}, which is not an "
                                    f"address of this node ({exc.strerror}): set MASTER_ADDR to the first learner "
                                    "node's address") from None
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((address, int(port)), timeout=min(5.0, timeout_s)):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise LearnerSetupError(
                    f"rank {rank}: no learner rendezvous at MASTER_ADDR:MASTER_PORT {address}:{port} after "
                    f"{timeout_s:g}s (learner.rendezvous_timeout_s; last error: {exc.strerror or exc}): is rank 0 "
                    "running there, and is the port open between the nodes?") from None
            time.sleep(poll_s)


def init_distributed(device: torch.device, rendezvous_timeout_s: float = 300.0,
                     collective_timeout_s: float = 300.0) -> None:
    """The ranks' process group. ``collective_timeout_s`` bounds every collective after start-up (gloo and NCCL
    alike; DeepSpeed's own default is 10 minutes, torch's 30): a rank whose peer died or hangs fails after it
    instead of waiting that long (:func:`collective_errors`)."""
    import deepspeed

    match_accelerator(device)
    check_rendezvous(rendezvous_timeout_s)
    if device.type == "cpu":
        skip_shared_memory_allreduce()
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo",
                               timeout=timedelta(seconds=collective_timeout_s))


@contextmanager
def collective_errors(collective_timeout_s: float) -> Iterator[None]:
    """A collective that fails inside (a peer rank gone or hung past ``collective_timeout_s``: torch raises its
    backend's error) becomes :class:`CollectiveFailed`, one line naming the setting, and the rank exits 1."""
    try:
        yield
    except torch.distributed.DistError as exc:
        raise CollectiveFailed(_collective_message(exc, collective_timeout_s)) from exc
    except RuntimeError as exc:  # older backends raise plain RuntimeErrors from a collective
        text = str(exc)
        if not any(mark in text for mark in ("gloo", "Gloo", "NCCL", "Timed out", "timed out", "Connection closed")):
            raise
        raise CollectiveFailed(_collective_message(exc, collective_timeout_s)) from exc


def _collective_message(exc: BaseException, timeout_s: float) -> str:
    rank = os.environ.get("RANK", "?")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (f"learner rank {rank}: a collective with the other ranks failed ({type(exc).__name__}: {first[:300]}); "
            f"a peer rank died, hangs, or is cut off. learner.collective_timeout_s is {timeout_s:g}s: a rank waits "
            "that long for its peers in any collective (raise it if a step or checkpoint legitimately takes longer)")
