"""The demo section: how `grpo demo` builds its tiny local starting model (nothing is downloaded)."""

from __future__ import annotations

from pydantic import Field, model_validator

from shared.config.schema.base import StrictModel


class DemoConfig(StrictModel):
    """`grpo demo`: the warm-up that makes the tiny model the RL starting point. The model is built once into
    `generator.model` (delete that folder to rebuild); the task is `generator.dataset.arithmetic`, or with
    `generator.dataset.kind: chain` the multi-step chain task of `generator.dataset.chain`. Each phase
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
                               "correct. On the chain task the teacher slips so in the intermediate lines only and "
                               "works the last line right from its own previous line.")
    flawed_lr: float = Field(3e-4, gt=0, description="Constant learning rate of the flawed-teacher phase.")
    # The settings below were measured on the default task and TinyModelSpec (docs/demo.md "The tiny local model"): batch
    # 128 learned as much per example as batch 32 at less CPU per example; weight decay 0.1 reached the accuracy
    # jump in roughly half the steps; a peak rate of 6e-3 and above learned slower.
    batch_size: int = Field(128, ge=1, description="Problems per supervised step, in both phases.")
    warmup_lr: float = Field(3e-3, gt=0, description="Peak learning rate of the correct demonstrations (AdamW), "
                             "reached after warmup_lr_ramp_steps and decayed from there.")
    warmup_lr_ramp_steps: int = Field(20, ge=0, description="Steps of linear learning-rate ramp at the start of "
                                      "the correct demonstrations (the first step at warmup_lr / this).")
    warmup_weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay of the correct demonstrations "
                                       "(the flawed teacher's phase uses none).")
    warmup_adam_betas: tuple[float, float] = Field((0.9, 0.98), description="AdamW betas of the correct "
                                                   "demonstrations (the flawed teacher's phase uses AdamW's "
                                                   "defaults).")
    grad_clip: float = Field(1.0, ge=0, description="Gradient-norm clip of every supervised step (0: none).")
    max_sequence_tokens: int = Field(64, ge=1, description="Longest prompt + answer + EOS a supervised batch may "
                                     "hold (longer is an error: truncating would drop the EOS).")
    heldout_examples: int = Field(500, ge=1, description="Test-split problems whose greedy accuracy the built "
                                  "model records before and after each phase.")
    heldout_seed: int = Field(1234, description="Seed that draws the heldout_examples.")
    greedy_max_new_tokens: int = Field(16, ge=1, description="Token budget of each greedy answer (held-out "
                                       "evaluations and validation checks).")
    validation_examples: int = Field(500, ge=1, description="Distinct train-split problems of the validation set "
                                     "the accuracy targets are checked on; no supervised batch contains them.")
    validation_seed: int = Field(4321, description="Seed that draws the validation set.")
    tool_fraction: float = Field(0.0, ge=0, le=1, description="Share of the correct demonstrations that call the "
                                 "calculator (37*45=<calc>37*45</calc><result>1665</result><answer>1665</answer>; "
                                 "the <result> text is the environment's and left out of the loss); the rest answer "
                                 "directly. Above 0 it needs generator.environment.name: calculator, an arithmetic "
                                 "task and flawed_steps 0, and warmup_target_accuracy is checked on the answer turn "
                                 "after the right call and the calculator's result (docs/calculator-demo.md).")

    @model_validator(mode="after")
    def _tool_demonstrations_have_no_flawed_teacher(self) -> DemoConfig:
        # the flawed teacher slips in direct answers of + and - problems; the calculator demo multiplies
        if self.tool_fraction > 0 and self.flawed_steps:
            raise ValueError("demo.tool_fraction > 0 has no flawed-teacher phase: set demo.flawed_steps: 0")
        return self
