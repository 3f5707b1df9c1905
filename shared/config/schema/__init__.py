"""The config schema, one module per section; ``GRPOConfig`` is the whole file."""

from __future__ import annotations

from pydantic import Field, model_validator

from shared.config.schema.algorithm import (
    AdvantageConfig,
    AlgorithmConfig,
    DistillConfig,
    KLConfig,
    LossConfig,
    OffPolicyConfig,
)
from shared.config.schema.base import StrictModel
from shared.config.schema.demo import DemoConfig
from shared.config.schema.evaluate import EvalConfig
from shared.config.schema.generator import DatasetConfig, GeneratorConfig, RewardSpec, SamplingConfig
from shared.config.schema.learner import LearnerConfig
from shared.config.schema.paths import STATE_PATHS, under_run_dir
from shared.config.schema.ref_server import RefServerConfig
from shared.config.schema.run import PlacementConfig, RunConfig
from shared.config.schema.weight_sync import WeightSyncConfig

__all__ = ["AdvantageConfig", "AlgorithmConfig", "DatasetConfig", "DistillConfig", "DemoConfig", "EvalConfig", "GRPOConfig", "GeneratorConfig", "KLConfig", "LearnerConfig", "LossConfig", "OffPolicyConfig",
           "PlacementConfig", "RunConfig",
           "RefServerConfig", "RewardSpec", "SamplingConfig", "StrictModel", "WeightSyncConfig"]


class GRPOConfig(StrictModel):
    """The whole run. Services read their own sections; all of them share ``algorithm`` and ``seed``."""

    seed: int = Field(0, description="Base random seed; each service and generator derives its own from it.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="The GRPO algorithm.")
    ref_server: RefServerConfig = Field(default_factory=RefServerConfig, description="The reference server.")
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig, description="The generators.")
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="The learner.")
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig, description="How the learner's "
                                          "weights reach the generators.")
    run: RunConfig = Field(default_factory=RunConfig, description="`grpo run`: placement and supervision.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="`grpo eval`: held-out evaluation.")
    demo: DemoConfig = Field(default_factory=DemoConfig, description="`grpo demo`: how the tiny starting model is "
                             "built.")

    @property
    def hub_scores_reference(self) -> bool:
        """The ref server computes the reference logprobs (and so needs ``ref_server.model``): the algorithm needs a
        reference and the learner does not score it itself (``learner.lora.reference: learner``)."""
        return self.algorithm.needs_reference and not self.learner.reference_in_learner

    @property
    def off_policy_bypass(self) -> bool:
        """Whether the learner trusts the behaviour logprobs as pi_old (``algorithm.off_policy.bypass``; left null:
        true with one update per batch, false with more). Derived, not stored, so a config written back and changed
        (say ``learner.updates_per_batch``) resolves it again."""
        bypass = self.algorithm.off_policy.bypass
        return self.learner.updates_per_batch == 1 if bypass is None else bypass

    @model_validator(mode="after")
    def _adapter_publish_over_the_relay(self) -> GRPOConfig:
        lora = self.learner.lora
        # adapters travel over every transport to the transformers engine; vLLM's worker extension takes them from
        # the relay only (no adapter receive over its group) and serves each version as a LoRARequest
        if lora is not None and lora.publish == "adapter" and self.weight_sync.transport in ("collective", "ipc") \
                and self.generator.engine == "vllm":
            raise ValueError(f"learner.lora.publish: 'adapter' reaches generator.engine 'vllm' over the HTTP relay "
                             f"only; weight_sync.transport {self.weight_sync.transport!r} needs "
                             "learner.lora.publish: merged there (or use transport 'auto' / 'http')")
        if lora is not None and lora.publish == "adapter" and self.generator.engine == "vllm" and lora.r > 512:
            # vLLM's largest max_lora_rank (generator/engines/vllm_lora.py: VLLM_LORA_RANKS)
            raise ValueError(f"learner.lora.r: {lora.r} is above the largest rank the vllm engine serves (512); "
                             "lower it or set learner.lora.publish: merged")
        return self

    @model_validator(mode="after")
    def _old_logprobs_in_one_place(self) -> GRPOConfig:
        """``learner.old_logprobs`` (the old name) becomes ``algorithm.off_policy.bypass``; bypass true needs one
        update per batch (with mu > 1 the behaviour logprobs would stand in for a pi_old the later updates no longer
        see). A bypass left null stays null: :attr:`off_policy_bypass` resolves it where it is read."""
        off_policy = self.algorithm.off_policy
        if self.learner.old_logprobs is not None:
            bypass = self.learner.old_logprobs == "behaviour"
            if "bypass" in off_policy.model_fields_set and off_policy.bypass != bypass:
                raise ValueError(f"learner.old_logprobs {self.learner.old_logprobs!r} (the old name of "
                                 f"algorithm.off_policy.bypass) contradicts algorithm.off_policy.bypass "
                                 f"{off_policy.bypass}: set only algorithm.off_policy.bypass")
            # not through validate_assignment (it would run the validators again on a half-updated model)
            off_policy.__dict__["bypass"] = bypass
            off_policy.__pydantic_fields_set__.add("bypass")
            self.learner.__dict__["old_logprobs"] = None
        if off_policy.bypass is True and self.learner.updates_per_batch > 1:
            raise ValueError(f"algorithm.off_policy.bypass uses the behaviour logprobs as pi_old and measures the drift "
                             f"from the update's own forward, which only holds with learner.updates_per_batch 1 (got "
                             f"{self.learner.updates_per_batch}): set bypass false (the learner recomputes pi_old once "
                             "per batch) or updates_per_batch 1")
        return self

    @model_validator(mode="after")
    def _distill_needs_a_teacher(self) -> GRPOConfig:
        if self.algorithm.distill is not None and self.ref_server.teacher_model is None:
            topk = " (algorithm.distill.mode topk_forward_kl: the teacher's top-k next tokens at every position)" \
                if self.algorithm.distill_top_k else ""
            raise ValueError(f"algorithm.distill needs a teacher to score the student's samples{topk}: set "
                             "ref_server.teacher_model (a model folder sharing the student's tokenizer)")
        if self.algorithm.distill is not None and self.generator.drop_constant_groups:
            raise ValueError("generator.drop_constant_groups drops groups whose rewards are all equal, but with "
                             "algorithm.distill every token carries the teacher's signal (under supervision 'none' "
                             "every group's rewards are equal): set generator.drop_constant_groups false")
        return self

    @model_validator(mode="after")
    def _eval_rows_kept_out_of_training(self) -> GRPOConfig:
        """An evaluation of the training dataset's own split would report accuracy on training prompts as held-out
        accuracy: refused here, at load. (eval.path names its rows explicitly, the training file included: its
        result then says so.)"""
        dataset = self.generator.dataset
        if self.eval.path is None and dataset.kind != "jsonl" and self.eval.split == dataset.split:
            raise ValueError(f"eval.split {self.eval.split!r} is generator.dataset.split, the rows training draws "
                             "prompts from: evaluating them is not a held-out evaluation; set eval.split to another "
                             "split of the dataset or eval.path to an evaluation file or dataset")
        return self

    @model_validator(mode="after")
    def _hub_urls_from_the_ref_server(self) -> GRPOConfig:
        """A hub_url the config does not set is the ref server's own address, so that a changed ref_server.port
        (or host) reaches every process that derives its address from it."""
        for section in (self.generator, self.learner):
            if "hub_url" not in section.model_fields_set:
                section.__dict__["hub_url"] = self.ref_server.url   # not through validate_assignment
        return self

    @model_validator(mode="after")
    def _relay_for_the_evaluator(self) -> GRPOConfig:
        """The evaluator follows the relay's versions: a run that evaluates while training puts every
        eval.every_steps-th version (or one every eval.every_minutes) there, whatever the transport."""
        sync = self.weight_sync
        if self.eval.while_training and "relay_every_versions" not in sync.model_fields_set \
                and "relay_every_s" not in sync.model_fields_set:
            sync.__dict__["relay_every_versions"] = self.eval.every_steps   # not through validate_assignment
            sync.__dict__["relay_every_s"] = None if self.eval.every_minutes is None else self.eval.every_minutes * 60
        return self

    @model_validator(mode="after")
    def _state_paths_under_run_dir(self) -> GRPOConfig:
        """Every state path's ``<run_dir>`` replaced here, in one place, so every service agrees on it."""
        for section, key in STATE_PATHS:
            part = getattr(self, section)
            resolved = under_run_dir(getattr(part, key), self.run.run_dir)
            if resolved != getattr(part, key):
                # not through validate_assignment: that would run this validator again for each path
                part.__dict__[key] = resolved
        return self
