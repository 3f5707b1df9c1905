"""The demo section: how `grpo demo` builds its tiny local starting model (nothing is downloaded)."""

from __future__ import annotations

from pydantic import Field

from shared.config.schema.base import StrictModel


class DemoConfig(StrictModel):
    """`grpo demo`: the warm-up that makes the tiny model the RL starting point. The model is built once into
    `generator.model` (delete that folder to rebuild); the task is `generator.dataset.arithmetic`. Each phase
    runs until its accuracy target on a validation set (train-split problems the warm-up never trains on,
    disjoint from the held-out test split) and fails if its step cap comes first: where the accuracy jumps
    depends on the seed, the thread count and the hardware, so fixed step counts do not reproduce."""

    warmup_steps: int = Field(1000, ge=0, description="Supervised steps on correct demonstrations (batch 128) "
                              "over which the learning rate warms up and decays (cosine, to warmup_min_lr_ratio). With "
                              "warmup_target_accuracy null, exactly this many steps.")
    warmup_min_lr_ratio: float = Field(0.33, gt=0, le=1, description="Where the cosine decay of the correct "
                                       "demonstrations ends, as a fraction of the peak rate (3e-3); it stays there "
                                       "past warmup_steps. A tenth crept: 73% after 2150 steps, against 85% at a "
                                       "third.")
    warmup_max_steps: int = Field(2500, ge=1, description="Cap on the correct demonstrations when "
                                  "warmup_target_accuracy is set; steps past warmup_steps run at the decayed "
                                  "rate.")
    warmup_target_accuracy: float | None = Field(0.8, ge=0, le=1, description="The correct demonstrations stop "
                                                 "at the first check where greedy validation accuracy is >= "
                                                 "this (null: no target).")
    warmup_check_every: int = Field(50, ge=1, description="Steps between validation checks of the correct "
                                    "demonstrations (500 greedy answers each).")
    flawed_steps: int = Field(300, ge=0, description="Cap on the following supervised steps on a flawed "
                              "teacher's demonstrations (0: none). The teacher forgets carries, borrows and minus "
                              "signs; see flawed_slip. With flawed_target_accuracy null, exactly this many steps.")
    flawed_target_accuracy: float | None = Field(0.5, ge=0, le=1, description="The flawed teacher's fine-tuning "
                                                 "stops at the first check where greedy validation accuracy is "
                                                 "<= this (null: no target).")
    flawed_check_every: int = Field(10, ge=1, description="Steps between validation checks of the flawed "
                                    "teacher's fine-tuning.")
    flawed_slip: float = Field(0.8, ge=0, le=1, description="Fraction of the flawed teacher's answers that drop "
                               "their carries, borrows and minus signs (58+67 -> 115, 38-41 -> 13); the rest are "
                               "correct.")
    flawed_lr: float = Field(3e-4, gt=0, description="Constant learning rate of the flawed-teacher phase.")
