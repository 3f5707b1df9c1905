"""Per-step metrics to the console, a JSONL file, TensorBoard and (optionally) Weights & Biases. Rank 0 only."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

log = logging.getLogger("grpo.learner")

# What the console line shows, in order (the JSONL/TensorBoard get everything).
CONSOLE_KEYS = ("loss", "reward_mean", "kl_mean", "entropy", "clip_frac_high", "tokens_per_s")


class MetricsLogger:
    def __init__(self, *, jsonl: str | None, tensorboard_dir: str | None, wandb_project: str | None,
                 enabled: bool, total_steps: int | None, run_config: dict | None = None) -> None:
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        self._wandb = None
        self._bar = None
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
        shown = {k: round(metrics[k], 4) for k in CONSOLE_KEYS if k in metrics}
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix(shown, refresh=True)
        else:
            log.info("step %d | %s", step, " | ".join(f"{k} {v}" for k, v in shown.items()))

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
