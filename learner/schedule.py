"""Learning-rate schedules (the learner's ``learner.lr_schedule``, and the demo's warm-up): a linear warm-up that
reaches the full rate at step ``warmup_steps - 1``, then constant, cosine decay to ``min_lr_ratio`` at
``max_steps`` (held there after it), or linear decay to 0 at ``max_steps``.

Built from transformers' schedule functions (the ``lr_lambda`` behind ``get_constant_schedule_with_warmup``,
``get_cosine_with_min_lr_schedule_with_warmup`` and ``get_polynomial_decay_schedule_with_warmup``), composed
rather than called as ready-made schedulers, because none of those reproduces this schedule exactly:

* their warm-up starts at lr 0 (``step / warmup_steps``); ours at ``1 / warmup_steps`` (a first step at lr 0 would
  be a wasted step): their warm-up, one step ahead;
* their cosine rises again past ``num_training_steps`` (the cosine of a progress above 1); ours holds the floor, as
  a phase that runs past its planned length to an accuracy target needs: their decay with its step held at the end.

The values equal the closed forms below bit for bit (tests/learner/test_schedule.py).
"""

from __future__ import annotations

from typing import Literal

import torch
from transformers.optimization import (
    _get_constant_schedule_with_warmup_lr_lambda,
    _get_cosine_schedule_with_warmup_lr_lambda,
    _get_polynomial_decay_schedule_with_warmup_lr_lambda,
)

Schedule = Literal["constant", "cosine", "linear"]


def lr_multiplier(step: int, *, schedule: Schedule, warmup_steps: int, max_steps: int | None,
                  min_lr_ratio: float = 0.0) -> float:
    """Fraction of the peak learning rate used by optimizer step ``step`` (0-based).

    With W = ``warmup_steps``, D = max(``max_steps`` - W, 1), p = min((step - W) / D, 1) and r = ``min_lr_ratio``:
    ``(step + 1) / W`` while step < W, then 1 (constant), ``r + (1 - r) * (1 + cos(pi * p)) / 2`` (cosine) or
    ``1 - p`` (linear). Cosine and linear need ``max_steps``.
    """
    if step < warmup_steps:
        return _get_constant_schedule_with_warmup_lr_lambda(step + 1, num_warmup_steps=warmup_steps)
    if schedule == "constant":
        return 1.0
    if max_steps is None:
        raise ValueError(f"a {schedule} schedule needs max_steps")
    decay_steps = max(max_steps - warmup_steps, 1)
    into_decay = min(step - warmup_steps, decay_steps)  # held at the end: the floor past max_steps
    if schedule == "cosine":
        return _get_cosine_schedule_with_warmup_lr_lambda(
            into_decay, num_warmup_steps=0, num_training_steps=decay_steps, num_cycles=0.5, min_lr_rate=min_lr_ratio)
    if schedule == "linear":  # polynomial decay of power 1 from 1 to 0 is exactly 1 - p
        return _get_polynomial_decay_schedule_with_warmup_lr_lambda(
            into_decay, num_warmup_steps=0, num_training_steps=decay_steps, lr_end=0.0, power=1.0, lr_init=1.0)
    raise ValueError(f"unknown lr schedule {schedule!r}")


def lr_schedule(optimizer: torch.optim.Optimizer, *, schedule: Schedule, warmup_steps: int, max_steps: int | None,
                min_lr_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` of :func:`lr_multiplier` over the optimizer's learning rate (the peak)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(
        step, schedule=schedule, warmup_steps=warmup_steps, max_steps=max_steps, min_lr_ratio=min_lr_ratio))
