"""The GRPO algorithm section: advantages and the policy loss (shared/grpo/advantages.py, shared/grpo/losses.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from shared.config.schema.base import StrictModel, check_registered


class AdvantageConfig(StrictModel):
    """How rewards become advantages (shared/grpo/advantages.py)."""

    estimator: str = Field(
        "grpo",
        description="Advantage estimator: 'grpo' (group baseline) or 'rloo' (leave-one-out baseline).",
    )
    scale: Literal["group", "batch", "none"] = Field(
        "group",
        description="Divide by the group's std ('group', GRPO), the batch's std ('batch'), or not at all "
        "('none', Dr. GRPO).",
    )
    eps: float = Field(1e-4, gt=0, description="Added to the std before dividing, so tiny stds stay finite.")

    @field_validator("estimator")
    @classmethod
    def _known_estimator(cls, value: str) -> str:
        return check_registered("shared.grpo.advantages", "ADVANTAGE_ESTIMATORS", value)


class LossConfig(StrictModel):
    """The policy loss (shared/grpo/losses.py): surrogate, clipping, importance weights, KL and aggregation."""

    policy_loss: str = Field(
        "grpo",
        description="Surrogate: 'grpo' (one importance ratio per token) or 'gspo' (one per sequence, the "
        "geometric mean of its token ratios).",
    )
    eps_low: float = Field(0.2, ge=0, lt=1, description="Lower clip range: the ratio is clipped at 1 - eps_low.")
    eps_high: float = Field(
        0.2, gt=0, description="Upper clip range: the ratio is clipped at 1 + eps_high (DAPO's clip-higher: 0.28)."
    )
    dual_clip: float | None = Field(
        None, gt=1, description="Dual-clip constant c > 1: caps a negative-advantage token's loss at -c*A. Off when null."
    )
    beta: float = Field(
        0.04, ge=0, description="Weight of the KL(pi_theta || pi_ref) penalty. 0 disables it and the reference model."
    )
    kl_estimator: str = Field("k3", description="Per-token KL estimator: 'k1', 'k2' or 'k3' (GRPO uses k3).")
    kl_log_ratio_clamp: float | None = Field(
        None, gt=0, description="Clamp log(pi_ref/pi_theta) to [-c, c] before the KL estimator. Off when null."
    )
    kl_value_clamp: float | None = Field(
        None, gt=0, description="Clamp each token's KL estimate to [-v, v]. Off when null."
    )
    tis_cap: float | None = Field(
        2.0,
        gt=0,
        description="Truncated importance sampling: weight each token by min(pi_old/pi_behaviour, cap) when the "
        "old logprobs are recomputed by the trainer and differ from the sampler's. Off when null.",
    )
    aggregation: str = Field(
        "token-mean",
        description="How token losses become one number: 'token-mean' (DAPO), 'seq-mean-token-mean' (original "
        "GRPO) or 'seq-mean-token-sum-norm' (Dr. GRPO, needs norm_len).",
    )
    norm_len: int | None = Field(
        None, ge=1, description="The constant length L of 'seq-mean-token-sum-norm' (use the max completion length)."
    )

    @field_validator("policy_loss")
    @classmethod
    def _known_policy_loss(cls, value: str) -> str:
        return check_registered("shared.grpo.losses", "POLICY_LOSSES", value)

    @field_validator("aggregation")
    @classmethod
    def _known_aggregation(cls, value: str) -> str:
        return check_registered("shared.grpo.losses", "AGGREGATIONS", value)

    @field_validator("kl_estimator")
    @classmethod
    def _known_kl(cls, value: str) -> str:
        return check_registered("shared.grpo.kl", "KL_ESTIMATORS", value)

    @model_validator(mode="after")
    def _norm_len_when_needed(self) -> LossConfig:
        if self.aggregation == "seq-mean-token-sum-norm" and self.norm_len is None:
            raise ValueError("aggregation 'seq-mean-token-sum-norm' needs norm_len (the max completion length)")
        return self


class AlgorithmConfig(StrictModel):
    """The GRPO algorithm: advantages and loss."""

    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig, description="Advantage estimation.")
    loss: LossConfig = Field(default_factory=LossConfig, description="Policy loss.")
