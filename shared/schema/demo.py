"""The demo section: how `grpo demo` builds its tiny local starting model (nothing is downloaded)."""

from __future__ import annotations

from pydantic import Field

from shared.schema.base import StrictModel


class DemoConfig(StrictModel):
    """`grpo demo`: the warm-up that makes the tiny model the RL starting point. The model is built once into
    `generator.model` (delete that folder to rebuild); the task is `generator.dataset.arithmetic`."""

    warmup_steps: int = Field(1000, ge=0, description="Supervised steps on correct demonstrations (batch 128).")
    flawed_steps: int = Field(100, ge=0, description="Then supervised steps on a flawed teacher's demonstrations "
                              "(0: none). The teacher forgets carries, borrows and minus signs; see flawed_slip.")
    flawed_slip: float = Field(0.8, ge=0, le=1, description="Fraction of the flawed teacher's answers that drop "
                               "their carries, borrows and minus signs (58+67 -> 115, 38-41 -> 13); the rest are "
                               "correct.")
    flawed_lr: float = Field(3e-4, gt=0, description="Constant learning rate of the flawed-teacher phase.")
