"""Per-step metrics to the console, a JSONL file, TensorBoard and (optionally) Weights & Biases. Rank 0 only."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

from learner.advantages import advantage_metrics, algorithm_metrics
from shared.config.schema import AlgorithmConfig, GRPOConfig
from shared.progress import PROGRESS_MARK, eta_seconds, format_duration
from shared.protocol.records import TrainBatch
from shared.tensors.masks import completion_mask

log = logging.getLogger("grpo.learner")

# What the terminal's progress bar shows, in order (the JSONL/TensorBoard get everything).
CONSOLE_KEYS = ("loss", "reward_mean", "kl_mean", "distill_reverse_kl", "distill_forward_kl", "entropy",
                "clip_frac_high", "mismatch_kl", "tokens_per_s")

# Where a learner step's wall time goes, in the order the training thread spends it. ``metrics`` is writing the
# previous step's record (it cannot time its own write). Compute is what a faster control plane cannot remove.
STEP_PARTS = ("metrics", "wait", "advantages", "host_to_device", "old_logprobs", "forward_backward", "optimizer",
              "step_reduce", "publish", "version_report", "ledger", "checkpoint")
COMPUTE_PARTS = ("old_logprobs", "forward_backward", "optimizer", "step_reduce")


class StepClock:
    """Contiguous laps of the training thread between two logged steps.

    :meth:`lap` charges the time since the previous lap to one part, so every moment between two records lands in
    exactly one part and the parts sum to the step's wall time (``time_step_s``). On a GPU a part ends when the host
    gets there, not when its kernels finish: queued work is charged to the part that next waits for the device
    (the one host sync per step, in ``step_reduce``), which is why the compute parts are reported together too."""

    def __init__(self) -> None:
        self._mark = time.perf_counter()
        self._parts: dict[str, float] = {}

    def lap(self, part: str) -> float:
        if part not in STEP_PARTS:
            raise KeyError(f"unknown step part {part!r} (known: {', '.join(STEP_PARTS)})")
        now = time.perf_counter()
        spent = now - self._mark
        self._parts[part] = self._parts.get(part, 0.0) + spent
        self._mark = now
        return spent

    def take(self) -> dict[str, float]:
        """``time_<part>_s`` for every part, ``time_step_s`` (their sum), ``time_compute_s`` and
        ``time_overhead_s`` (step minus compute); the parts start again from zero."""
        parts = {name: self._parts.get(name, 0.0) for name in STEP_PARTS}
        self._parts = {}
        compute = sum(parts[name] for name in COMPUTE_PARTS)
        total = sum(parts.values())
        record: dict[str, Any] = {f"time_{name}_s": value for name, value in parts.items()}
        record.update(time_step_s=total, time_compute_s=compute, time_overhead_s=total - compute)
        return record


def progress_line(step: int, total: int | None, metrics: dict[str, float], eta_s: float | None,
                  warn_mismatch_kl: float | None = None) -> str:
    """The learner's per-step line: ``progress: step 12/150 (8%) | reward 0.531 | batch accuracy 53.1% | loss
    0.0123 | 2,345 tokens/s | ETA 3m05s``; a field the metrics lack (accuracy without a judging reward) or that is
    not known yet (the ETA at the first step, any ETA without ``learner.max_steps``) is left out. When the step's
    ``mismatch_kl`` is above ``warn_mismatch_kl`` (``algorithm.off_policy.warn_mismatch_kl``) the line ends with
    ``WARNING mismatch_kl 0.0312 > 0.01 (rollouts drift from the learner: docs/off-policy.md)``."""
    fields = [f"step {step}/{total} ({100 * step / total:.0f}%)" if total else f"step {step}"]
    if "reward_mean" in metrics:
        fields.append(f"reward {metrics['reward_mean']:.3f}")
    if "accuracy" in metrics:
        fields.append(f"batch accuracy {metrics['accuracy']:.1%}")
    if "loss" in metrics:
        fields.append(f"loss {metrics['loss']:.4g}")
    if "tokens_per_s" in metrics:
        fields.append(f"{metrics['tokens_per_s']:,.0f} tokens/s")
    if eta_s is not None and total:
        fields.append(f"ETA {format_duration(eta_s)}")
    warning = drift_warning(metrics, warn_mismatch_kl)
    if warning is not None:
        fields.append(warning)
    return PROGRESS_MARK + " | ".join(fields)


def drift_warning(metrics: dict[str, float], threshold: float | None) -> str | None:
    """The warning a step whose ``mismatch_kl`` is above ``threshold`` gets on the console (None: below, or off),
    with where the drift comes from when the metrics tell: rows sampled by the learner's current version
    (``mismatch_kl/lag_0``) above the threshold on their own drift through the generator's numerics, not staleness
    (typically a bfloat16 generator against a float32 learner, which rounds most of a small update away:
    docs/off-policy.md "Precision")."""
    drift = metrics.get("mismatch_kl")
    if threshold is None or drift is None or not drift > threshold:
        return None
    lag0 = metrics.get("mismatch_kl/lag_0")
    if lag0 is not None and lag0 > threshold:
        cause = (f"lag 0 alone {lag0:.3g}: the generator's precision or kernels, not staleness: "
                 "docs/off-policy.md#precision")
    else:
        cause = "rollouts drift from the learner: docs/off-policy.md"
    return f"WARNING mismatch_kl {drift:.3g} > {threshold:g} ({cause})"


class MetricsLogger:
    def __init__(self, *, jsonl: str | None, tensorboard_dir: str | None, wandb_project: str | None,
                 enabled: bool, total_steps: int | None, run_config: dict | None = None,
                 warn_mismatch_kl: float | None = None) -> None:
        self.enabled = enabled
        self.warn_mismatch_kl = warn_mismatch_kl
        self._jsonl = None
        self._tb = None
        self._wandb = None
        self._bar = None
        self.total_steps = total_steps
        self._first: tuple[int, float] | None = None  # (step, time) of the first step logged: the ETA's rate
        if not enabled:
            return
        if jsonl:
            Path(jsonl).parent.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(jsonl, "a", buffering=1)
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                log.warning("tensorboard is not installed; TensorBoard logging is off (pip install tensorboard)")
            else:
                self._tb = SummaryWriter(tensorboard_dir)
        if wandb_project:
            import wandb  # a configured project without wandb installed is an error, not a silent no-op

            self._wandb = wandb.init(project=wandb_project, config=run_config or {})
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, unit="step", desc="learner", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, "time": time.time(), **metrics}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix({k: round(metrics[k], 4) for k in CONSOLE_KEYS if k in metrics}, refresh=True)
            warning = drift_warning(metrics, self.warn_mismatch_kl)
            if warning is not None:
                self._bar.write(f"step {step}: {warning}")
        else:
            log.info("%s", progress_line(step, self.total_steps, metrics, self._eta(step), self.warn_mismatch_kl))

    def _eta(self, step: int) -> float | None:
        """Seconds to ``total_steps`` at this process's pace since its first logged step (a resumed run's pace
        starts at its first new step)."""
        now = time.monotonic()
        if self._first is None:
            self._first = (step, now)
            return None
        first_step, first_time = self._first
        if self.total_steps is None:
            return None
        return eta_seconds(step - first_step, self.total_steps - first_step, now - first_time)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_description_str(text)
        else:
            log.info("%s", text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


class LappedEngine:
    """The DeepSpeed engine as the GRPO step sees it, with a lap on each side of ``step()``: the time before it is
    forward and backward, the time inside it the optimizer. Everything else goes to the engine itself."""

    def __init__(self, engine, clock: StepClock) -> None:
        self._engine = engine
        self._clock = clock

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def step(self, *args, **kwargs):
        self._clock.lap("forward_backward")
        result = self._engine.step(*args, **kwargs)
        self._clock.lap("optimizer")
        return result


def accuracy_judge(config: GRPOConfig) -> tuple[str, float] | None:
    """(reward name, threshold) that decides whether a completion is correct, as held-out evaluation decides it
    (``eval.accuracy_reward``, default the first generator reward; ``eval.threshold``); None without rewards."""
    names = [spec.label or spec.name for spec in config.generator.rewards]
    name = config.eval.accuracy_reward or (names[0] if names else None)
    return None if name is None else (name, config.eval.threshold)


def batch_metrics(batch: TrainBatch, advantages: torch.Tensor, current_version: int,
                  algorithm: AlgorithmConfig | None = None,
                  judge: tuple[str, float] | None = None) -> dict[str, float]:
    """What the pulled batch says about the rollouts (before any update). The advantage metrics are over the
    completions (``[B]``) or their real tokens (``[B, L]``); with ``algorithm`` also the step-reward and
    KL-in-reward metrics (:func:`learner.advantages.algorithm_metrics`). With ``judge`` (:func:`accuracy_judge`)
    and that reward in the batch, ``accuracy``: the fraction of the batch's sampled completions it scores at or
    above the threshold (training samples, after any dropping of constant groups: not held-out accuracy)."""
    rewards = batch.rewards.float()
    lengths = batch.completion_lengths.float()
    groups = int(batch.group_index.max()) + 1
    # a group is constant when its highest and lowest rewards are equal (two scatter ops, not one op per group)
    highest = rewards.new_full((groups,), float("-inf")).scatter_reduce(0, batch.group_index, rewards, "amax")
    lowest = rewards.new_full((groups,), float("inf")).scatter_reduce(0, batch.group_index, rewards, "amin")
    constant = int((highest == lowest).sum())
    staleness = (current_version - batch.policy_versions).float()
    metrics = {
        "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        **(advantage_metrics(batch, advantages) if algorithm is None
           else algorithm_metrics(batch, advantages, algorithm)),
        "completion_len_mean": float(lengths.mean()), "completion_len_min": float(lengths.min()),
        "completion_len_max": float(lengths.max()), "truncated_frac": float(batch.truncated.float().mean()),
        "zero_variance_group_frac": constant / groups,
        "staleness_mean": float(staleness.mean()), "staleness_max": float(staleness.max()),
    }
    if batch.completion_mask is not None:  # multi-turn: the share of completion tokens an environment wrote
        valid = completion_mask(batch.completion_lengths, batch.completion_mask.shape[1])
        metrics["env_token_frac"] = float((valid & ~batch.completion_mask.bool()).sum()) / max(float(lengths.sum()), 1.0)
    for name, values in batch.reward_components.items():
        valid = values[~torch.isnan(values)]
        if valid.numel():
            metrics[f"reward/{name}"] = float(valid.mean())
            if judge is not None and name == judge[0]:
                metrics["accuracy"] = float((valid >= judge[1]).float().mean())
    return metrics
