"""algorithm.off_policy: defaults, the old knobs (loss.tis_cap, learner.old_logprobs) mapped onto it, and the
combinations refused with the key named."""

import pytest
from pydantic import ValidationError

from learner.metrics import progress_line
from shared.config.schema import GRPOConfig


def load(data: dict) -> GRPOConfig:
    return GRPOConfig.model_validate(data)


def test_defaults_bypass_with_one_update_and_recompute_with_token_tis_with_more():
    off_policy = GRPOConfig().algorithm.off_policy
    assert (off_policy.mode, off_policy.low, off_policy.high, GRPOConfig().off_policy_bypass) == \
        ("token_tis", 0.5, 2.0, True)
    assert load({"learner": {"updates_per_batch": 2}}).off_policy_bypass is False
    explicit = load({"algorithm": {"off_policy": {"bypass": False}}})
    assert explicit.off_policy_bypass is False
    for config in (GRPOConfig(), explicit, load({"learner": {"updates_per_batch": 3}})):
        for dump in (config.model_dump(mode="json"), config.model_dump(mode="json", exclude_defaults=True)):
            assert load(dump).algorithm.off_policy == config.algorithm.off_policy
            assert load(dump).off_policy_bypass is config.off_policy_bypass
    # a config written back with the default, then given more updates per batch, recomputes (it is not pinned)
    written = GRPOConfig().model_dump(mode="json", exclude_defaults=True)
    assert load({**written, "learner": {**written.get("learner", {}), "updates_per_batch": 2}}).off_policy_bypass is False


@pytest.mark.parametrize("cap, mode, high", [(3.0, "token_tis", 3.0), (None, "none", 2.0), (0.2, "token_tis", 0.2)])
def test_tis_cap_becomes_token_tis(cap, mode, high):
    config = load({"algorithm": {"loss": {"tis_cap": cap}}})
    assert (config.algorithm.off_policy.mode, config.algorithm.off_policy.high) == (mode, high)
    assert config.algorithm.loss.tis_cap is None  # one meaning: only off_policy says it now
    # the dumped config (what grpo run writes for its services, every field or only the set ones) loads the same
    assert load(config.model_dump(mode="json", exclude_defaults=True)).algorithm == config.algorithm
    assert load(config.model_dump(mode="json")).algorithm == config.algorithm


@pytest.mark.parametrize("old, bypass", [("behaviour", True), ("recompute", False)])
def test_learner_old_logprobs_becomes_bypass(old, bypass):
    config = load({"learner": {"old_logprobs": old}})
    assert config.algorithm.off_policy.bypass is bypass and config.learner.old_logprobs is None
    assert config.off_policy_bypass is bypass
    assert load(config.model_dump(mode="json", exclude_defaults=True)).off_policy_bypass is bypass
    assert load(config.model_dump(mode="json")).off_policy_bypass is bypass


@pytest.mark.parametrize("data, words", [
    ({"algorithm": {"off_policy": {"mode": "icepop"}}}, "unknown off-policy correction 'icepop'; known: none, "
                                                         "seq_geo_mask, seq_mask, seq_tis, token_is_mask, token_mask"),
    ({"algorithm": {"off_policy": {"low": 2.5}}}, "low 2.5 is above high 2.0"),
    ({"algorithm": {"off_policy": {"high": float("inf")}}}, "off_policy.high"),
    ({"algorithm": {"off_policy": {"bypass": True}}, "learner": {"updates_per_batch": 2}}, "updates_per_batch 1"),
    ({"learner": {"old_logprobs": "behaviour", "updates_per_batch": 3}}, "updates_per_batch 1"),
    ({"algorithm": {"off_policy": {"bypass": False}}, "learner": {"old_logprobs": "behaviour"}}, "contradicts"),
    ({"algorithm": {"loss": {"tis_cap": 2.0}, "off_policy": {"mode": "token_mask"}}}, "set one of them"),
    ({"algorithm": {"off_policy": {"mode": "token_tis", "cap": 2}}}, "off_policy.cap"),
])
def test_refused_with_the_key_named(data, words):
    with pytest.raises(ValidationError) as info:
        load(data)
    assert words in str(info.value)


def test_progress_line_warns_when_the_drift_crosses_the_threshold():
    metrics = {"reward_mean": 0.5, "mismatch_kl": 0.034}
    assert progress_line(3, None, metrics, None, 0.01).endswith(
        "| WARNING mismatch_kl 0.034 > 0.01 (rollouts drift from the learner: docs/off-policy.md)")
    assert "WARNING" not in progress_line(3, None, {**metrics, "mismatch_kl": 0.005}, None, 0.01)
    assert "WARNING" not in progress_line(3, None, metrics, None, None)


def test_the_drift_warning_names_the_generators_numerics_when_lag_0_rows_drift_alone():
    stale = {"mismatch_kl": 0.05, "mismatch_kl/lag_0": 0.002, "mismatch_kl/lag_1": 0.09}
    assert progress_line(3, None, stale, None, 0.01).endswith(
        "| WARNING mismatch_kl 0.05 > 0.01 (rollouts drift from the learner: docs/off-policy.md)")
    fresh = {"mismatch_kl": 0.05, "mismatch_kl/lag_0": 0.046}
    assert progress_line(3, None, fresh, None, 0.01).endswith(
        "| WARNING mismatch_kl 0.05 > 0.01 (lag 0 alone 0.046: the generator's precision or kernels, not "
        "staleness: docs/off-policy.md#precision)")
