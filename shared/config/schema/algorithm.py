"""The GRPO algorithm section: advantages and the policy loss (shared/grpo/advantages.py, shared/grpo/losses.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from shared.config.schema.base import StrictModel, check_registered


class AdvantageConfig(StrictModel):
    """How rewards become advantages (shared/grpo/advantages.py)."""

    supervision: str = Field(
        "outcome",
        description="What the advantages come from. 'outcome': one reward per completion, normalised by "
        "'estimator', the same advantage on every token. 'process' (DeepSeekMath 4.1.3): the step rewards the "
        "rewards attach to each completion; each step reward is normalised over its group's step rewards ('scale', "
        "'eps'; 'scale: batch' = the std of every step reward of the global batch) and a token's advantage is the "
        "sum of the normalised rewards of the steps ending at or after it (shared.grpo.advantages."
        "process_advantages). With 'process' the outcome 'estimator' is not used; a completion without steps gets "
        "advantage 0 (the learner counts them: rows_without_steps_frac, and warns when a whole batch has none). "
        "'none': no task reward at all, every advantage 0 but what algorithm.distill (pure distillation) or "
        "algorithm.kl.in_reward adds.",
    )
    estimator: str = Field(
        "grpo",
        description="Advantage estimator of outcome supervision: 'grpo' (group baseline) or 'rloo' (leave-one-out "
        "baseline). Not used with supervision 'process'.",
    )
    scale: Literal["group", "batch", "none"] = Field(
        "group",
        description="Divide by the group's std ('group', GRPO), the batch's std ('batch'), or not at all "
        "('none', Dr. GRPO). Applies to outcome rewards and, with supervision 'process', to step rewards.",
    )
    eps: float = Field(1e-4, gt=0, description="Added to the std before dividing, so tiny stds stay finite.")

    @field_validator("estimator")
    @classmethod
    def _known_estimator(cls, value: str) -> str:
        return check_registered("shared.grpo.advantages", "ADVANTAGE_ESTIMATORS", value)

    @field_validator("supervision")
    @classmethod
    def _known_supervision(cls, value: str) -> str:
        return check_registered("learner.advantages", "SUPERVISIONS", value)


class LossConfig(StrictModel):
    """The policy loss (shared/grpo/losses.py): surrogate, clipping, importance weights, KL and aggregation."""

    policy_loss: str = Field(
        "grpo",
        description="Surrogate (shared/grpo/policy_losses.py): 'grpo' (PPO's clip, one importance ratio per "
        "token), 'gspo' (one ratio per sequence, the geometric mean of its token ratios), 'cispo' (MiniMax-M1: the "
        "clipped importance weight as a constant on every token's gradient; cispo_eps_low / cispo_eps_high) or "
        "'sapo' (a soft gate instead of the clip; sapo_tau_pos / sapo_tau_neg); 'vanilla' is another name of 'grpo'.",
    )
    eps_low: float = Field(0.2, ge=0, lt=1, description="Lower clip range: the ratio is clipped at 1 - eps_low.")
    eps_high: float = Field(
        0.2, gt=0, description="Upper clip range: the ratio is clipped at 1 + eps_high (DAPO's clip-higher: 0.28)."
    )
    dual_clip: float | None = Field(
        None, gt=1, description="Dual-clip constant c > 1: caps a negative-advantage token's loss at -c*A. Off when null."
    )
    cispo_eps_low: float | None = Field(
        None, ge=0, le=1, description="cispo: the importance weight is at least 1 - cispo_eps_low; null: no lower "
        "bound (MiniMax-M1 tunes only the upper one).")
    cispo_eps_high: float = Field(
        3.0, gt=0, description="cispo: the importance weight is at most 1 + cispo_eps_high (3.0: a cap of 4, which "
        "truncates only the outliers).")
    sapo_tau_pos: float = Field(1.0, gt=0, description="sapo: the gate's temperature on positive-advantage tokens.")
    sapo_tau_neg: float = Field(
        1.05, gt=0, description="sapo: the gate's temperature on negative-advantage tokens (>= sapo_tau_pos: their "
        "gradient fades faster as the ratio moves away from 1).")
    beta: float = Field(
        0.04, ge=0, description="Weight of the KL(pi_theta || pi_ref) penalty in the loss. 0 disables it (and the "
        "reference model, unless algorithm.kl.in_reward needs it). With algorithm.kl.in_reward true, a beta left at "
        "its default becomes 0 (the KL is then in the reward, not also in the loss); a beta > 0 set explicitly "
        "together with algorithm.kl.in_reward is an error."
    )
    kl_estimator: str = Field("k3", description="Per-token KL estimator: 'k1' (also 'kl'), 'k2' (also "
                              "'mse') or 'k3' (also 'low_var_kl'; GRPO uses k3).")
    kl_log_ratio_clamp: float | None = Field(
        None, gt=0, description="Clamp log(pi_ref/pi_theta) to [-c, c] before the KL estimator. Off when null."
    )
    kl_value_clamp: float | None = Field(
        None, gt=0, description="Clamp each token's KL estimate to [-v, v]. Off when null."
    )
    tis_cap: float | None = Field(
        None,
        gt=0,
        description="Deprecated: algorithm.off_policy {mode: token_tis, high: CAP}, which a tis_cap set here becomes "
        "(null: mode none). Setting both is an error.",
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
        return check_registered("shared.grpo.policy_losses", "POLICY_LOSSES", value)

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


class KLConfig(StrictModel):
    """The KL penalty as a per-token reward (shared.grpo.advantages.kl_in_reward_advantages), instead of in the loss."""

    in_reward: bool = Field(
        False,
        description="Put the KL penalty into the per-token reward (OpenRLHF's semantics): r_t = -beta * k(t) + p_t, "
        "where p_t is the completion's normalised outcome advantage at its last token (supervision 'outcome') or "
        "each step's normalised reward at the step's last token (supervision 'process'), and each token's advantage "
        "is the return to go sum_{s >= t} r_s. k is computed from the sampler's (behaviour) logprobs and the "
        "reference logprobs, without gradient, so the ref server must load the reference model. The KL is then not "
        "also in the loss: algorithm.loss.beta left at its default becomes 0; set explicitly > 0 it is an error.",
    )
    beta: float = Field(
        0.04, ge=0,
        description="Weight of the per-token KL estimate in the reward when in_reward is true (the same default "
        "as algorithm.loss.beta; note the return to go sums it over the rest of the completion, so the penalty on "
        "an early token is beta times the KL of the completion's remainder).",
    )
    estimator: Literal["k1", "k3"] = Field(
        "k1",
        description="Per-token KL estimate in the reward: 'k1' = log pi_old - log pi_ref (DeepSeekMath's formula "
        "for the KL in the reward) or 'k3' = r - 1 - log r with log r = log pi_ref - log pi_old.",
    )


class OffPolicyConfig(StrictModel):
    """Off-policy correction (shared/grpo/off_policy.py): rollouts from earlier policy versions and from an engine
    that computes other numbers than the learner, measured every step and corrected per token or per sequence."""

    mode: str = Field(
        "token_tis",
        description="How d = log pi_old - log pi_behaviour (r = exp(d)) of each sampled token corrects the loss: "
        "'none'; 'token_tis' (truncated IS, w = min(r, high)); 'token_mask' (ICEPOP token rejection: tokens "
        "outside low <= r <= high leave the loss); 'token_is_mask' (w = r, tokens outside [low, high] leave the "
        "loss); 'seq_tis' (w = min(exp(sum d), high) on the whole row); 'seq_mask' (a row leaves the loss unless "
        "low <= exp(sum d) <= high); 'seq_geo_mask' (a row leaves the loss unless low <= exp(mean d) <= high). "
        "Tokens that leave the loss leave its normaliser too. docs/off-policy.md says which to pick.",
    )
    low: float = Field(0.5, ge=0, allow_inf_nan=False,
                       description="Lower bound of the kept ratios (the masking modes).")
    high: float = Field(2.0, gt=0, allow_inf_nan=False,
                        description="Upper bound of the kept ratios (masking modes) or the truncation cap (tis modes).")
    bypass: bool | None = Field(
        None,
        description="Trust the generator's behaviour logprobs as pi_old and skip the learner's recompute of the old "
        "logprobs (one forward pass less per batch): the PPO ratio is then pi_theta / pi_behaviour and its clip is "
        "the only correction (no mode applies: d = 0 by definition); the drift is still measured, from the update's "
        "own forward. Only with learner.updates_per_batch 1 (with more, later updates would no longer see pi_old). "
        "Null: true with updates_per_batch 1 (as good as or better than every mode in docs/off-policy.md's "
        "measurements, and cheaper), false with more (pi_old recomputed, 'mode' applied).",
    )
    warn_mismatch_kl: float | None = Field(
        0.01, gt=0, description="The learner's progress line warns when a step's mismatch_kl (mean k3 estimate of "
        "KL(behaviour || learner) per token) exceeds this. Null: never.")

    @field_validator("mode")
    @classmethod
    def _known_mode(cls, value: str) -> str:
        return check_registered("shared.grpo.off_policy", "OFF_POLICY_CORRECTIONS", value)

    @model_validator(mode="after")
    def _ordered_bounds(self) -> OffPolicyConfig:
        if self.low > self.high:
            raise ValueError(f"algorithm.off_policy: low {self.low} is above high {self.high}")
        return self


class EntropyConfig(StrictModel):
    """An entropy bonus in the loss (learner/entropy_control.py): ``-coef * H`` per token in the loss, aggregated like
    the policy loss, with ``H`` the entropy of the policy's (tempered) next-token distribution. A fixed ``coef``, or
    with ``target`` an adaptive one that holds the mean token entropy near it:
    ``coef <- clip(coef + adapt_rate * (target - H_step), min_coef, max_coef)`` after every step."""

    coef: float = Field(0.0, ge=0, description="The bonus's coefficient (the starting one when target is set); 0 "
                        "with no target: no bonus.")
    target: float | None = Field(None, gt=0, description="Target mean token entropy in nats; null: coef stays fixed.")
    adapt_rate: float = Field(1e-3, gt=0, description="How fast coef follows the target: its change per step per "
                              "nat of entropy below (or above) it.")
    min_coef: float = Field(0.0, ge=0, description="The adaptive coefficient's floor.")
    max_coef: float = Field(0.05, gt=0, description="The adaptive coefficient's ceiling.")

    @model_validator(mode="after")
    def _bounds(self) -> EntropyConfig:
        if self.min_coef > self.max_coef:
            raise ValueError(f"min_coef {self.min_coef} > max_coef {self.max_coef}")
        return self

    @property
    def active(self) -> bool:
        return self.coef > 0 or self.target is not None


class DistillConfig(StrictModel):
    """On-policy distillation (docs/distillation.md): a teacher scores the student's own samples and each model
    token gets the reward -coef * (log pi_student - log pi_teacher) (shared.grpo.distill.distill_token_rewards), or
    (mode topk_forward_kl) the loss gets coef * the forward KL from the teacher's top-k to the student per token."""

    coef: float = Field(1.0, ge=0, allow_inf_nan=False, description="c in the per-token reward -c * (log "
                        "pi_student - log pi_teacher), added to each model token's advantage without a return to go "
                        "(discount 0, as slime's --use-opd and Thinking Machines' recipe do).")
    mode: Literal["reverse_kl", "topk_forward_kl"] = Field(
        "reverse_kl", description="The divergence: 'reverse_kl', the per-token k1 estimate of KL(student || teacher) "
        "at the sampled token, as a reward; 'topk_forward_kl', a loss term: at every completion position the "
        "forward KL from the teacher's top_k next tokens (renormalised over them) to the student's logprobs at "
        "those ids, coef times it aggregated like the policy loss (shared.grpo.distill.topk_forward_kl_loss_terms; "
        "the hub sends top_k ids and logprobs per token, docs/distillation.md). baseline does not apply to it.")
    top_k: int = Field(16, ge=1, le=256, description="mode 'topk_forward_kl': how many of the teacher's most likely "
                       "next tokens the hub sends per completion position (k int32 ids and k float32 logprobs per "
                       "token on the wire: 8 k bytes); ignored by 'reverse_kl'.")
    baseline: Literal["none", "mean"] = Field(
        "none", description="Subtracted from the per-token rewards: 'none' (as slime's and Thinking Machines' "
        "recipes do), or 'mean': their mean over the batch's model tokens (shared.grpo.distill."
        "centred_token_rewards), so that with a sharp teacher, who finds most of the student's samples unlikely, an "
        "update does not push every sampled token down (docs/distillation.md).")
    student: Literal["behaviour", "recompute"] = Field(
        "recompute", description="Where log pi_student comes from. 'recompute' (the default): the learner's own "
        "forward with the weights before the batch's update (no gradient), the policy being trained; 'behaviour': "
        "the generator's sampling logprobs as uploaded (Tinker's choice: no extra forward, but they carry the "
        "engine's numerical drift and the staleness of off-policy groups).")


class AlgorithmConfig(StrictModel):
    """The GRPO algorithm: advantages, loss, and where the KL penalty goes."""

    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig, description="Advantage estimation.")
    loss: LossConfig = Field(default_factory=LossConfig, description="Policy loss.")
    kl: KLConfig = Field(default_factory=KLConfig, description="The KL penalty in the reward (kl.in_reward) "
                         "instead of in the loss (loss.beta).")
    off_policy: OffPolicyConfig = Field(default_factory=OffPolicyConfig, description="Off-policy correction: "
                                        "the drift between the generators' and the learner's logprobs.")
    entropy: EntropyConfig = Field(default_factory=EntropyConfig, description="Entropy bonus in the loss, fixed "
                                   "or adaptive to a target entropy.")
    distill: DistillConfig | None = Field(None, description="On-policy distillation towards ref_server."
                                          "teacher_model (a per-token reward on the student's samples); null: off. "
                                          "With advantage.supervision 'none' it is the only signal.")

    @property
    def needs_reference(self) -> bool:
        """Whether reference logprobs are needed: the one place the ref server, the launcher and the learner ask."""
        return self.loss.beta > 0 or self.kl.in_reward

    @property
    def token_advantages(self) -> bool:
        """Whether the advantages are per token (``[B, T]``) rather than per completion (``[B]``)."""
        return self.advantage.supervision == "process" or self.kl.in_reward or self.distill_reward

    @property
    def distill_reward(self) -> bool:
        """Whether distillation adds a per-token reward (mode reverse_kl) rather than a loss term (topk_forward_kl)."""
        return self.distill is not None and self.distill.mode == "reverse_kl"

    @property
    def distill_top_k(self) -> int:
        """The teacher's top-k the hub sends per completion token: distill.top_k in mode topk_forward_kl, else 0."""
        return self.distill.top_k if self.distill is not None and self.distill.mode == "topk_forward_kl" else 0

    @model_validator(mode="after")
    def _tis_cap_is_token_tis(self) -> AlgorithmConfig:
        """``loss.tis_cap`` (the one knob before algorithm.off_policy) becomes ``off_policy``'s token_tis."""
        if "tis_cap" not in self.loss.model_fields_set:
            return self
        if "off_policy" in self.model_fields_set:
            if self.loss.tis_cap is None:  # a whole config written back (every field, tis_cap null): off_policy rules
                return self
            raise ValueError("algorithm.loss.tis_cap is the old name of algorithm.off_policy {mode: token_tis, high: "
                             "CAP}: set one of them, not both")
        cap = self.loss.tis_cap
        loss = self.loss.model_copy(update={"tis_cap": None})
        loss.__pydantic_fields_set__.discard("tis_cap")
        # not through validate_assignment, which would run this validator again on a half-updated model
        self.__dict__["loss"] = loss
        self.__dict__["off_policy"] = (OffPolicyConfig(mode="none") if cap is None
                                       else OffPolicyConfig(mode="token_tis", high=cap, low=min(0.5, cap)))
        return self

    @model_validator(mode="after")
    def _kl_in_one_place(self) -> AlgorithmConfig:
        if not self.kl.in_reward or self.loss.beta == 0:
            return self
        if "beta" in self.loss.model_fields_set:
            raise ValueError(f"algorithm.kl.in_reward is true and algorithm.loss.beta is {self.loss.beta}: the KL "
                             "penalty goes either in the reward or in the loss; set algorithm.loss.beta to 0 or "
                             "algorithm.kl.in_reward to false")
        # the loss's beta was left at its default: the KL moves into the reward. A copy, so that a LossConfig the
        # caller passed in is not changed under them.
        self.loss = self.loss.model_copy(update={"beta": 0.0})
        return self
