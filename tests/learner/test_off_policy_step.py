"""The learner's step with each off-policy correction, on a real tiny model and real DeepSpeed: the drift metrics
against a hand computation from the same logprobs, masked tokens leaving the normaliser, bypass."""

import math

import pytest
import torch

from learner.step import apply_off_policy, grpo_step, recompute_old_logprobs, split_micro_batches
from shared.config.schema import LossConfig, OffPolicyConfig
from shared.grpo.off_policy import MASKING_MODES, OFF_POLICY_CORRECTIONS

from .batches import advantages_of, batch_of, sampled_groups
from .test_step import CPU, make_engine

pytestmark = pytest.mark.slow


def drifted_batch(model_dir):
    """Four groups sampled by the tiny model (behaviour = the policy's logprobs), then drifted: rows of groups 1-3
    were 'sampled' 1, 2 and 3 versions ago, and their behaviour logprobs are shifted by -0.4 per version of lag on
    every other token (as if an older policy or a lower precision had computed them)."""
    groups = sampled_groups(model_dir, [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0],
                                        [0.0, 0.0, 0.0, 1.0]], seed=3)
    for lag, group in enumerate(groups):
        group.policy_version = 3 - lag
        shift = torch.zeros_like(group.behaviour_logprobs)
        shift[:, ::2] = -0.4 * lag
        group.behaviour_logprobs = group.behaviour_logprobs + shift
    return batch_of(groups)


def hand_drift(old, batch):
    """mismatch_kl, |d|, per-lag kl and the token ESS by hand from the recomputed logprobs (Python floats, row by
    row)."""
    kl, diff, count, by_lag, ratios = 0.0, 0.0, 0, {}, []
    for i in range(batch.batch_size):
        lag = 3 - int(batch.policy_versions[i])
        for t in range(int(batch.completion_lengths[i])):
            d = float(old[i, t]) - float(batch.behaviour_logprobs[i, t])
            k3 = math.exp(d) - 1 - d
            kl, diff, count = kl + k3, diff + abs(d), count + 1
            ratios.append(math.exp(d))
            total, n = by_lag.get(lag, (0.0, 0))
            by_lag[lag] = (total + k3, n + 1)
    ess = sum(ratios) ** 2 / (count * sum(r * r for r in ratios))
    return kl / count, diff / count, {lag: total / n for lag, (total, n) in by_lag.items()}, ess


@pytest.mark.parametrize("mode", OFF_POLICY_CORRECTIONS.names())
def test_each_mode_trains_and_reports_the_drift(distributed, tiny_model_dir, mode):
    batch = drifted_batch(tiny_model_dir)
    engine = make_engine(tiny_model_dir, lr=1e-3, micro_batches=2, groups_per_step=4)
    micro = split_micro_batches(batch, advantages_of(batch), 2, False, CPU, learner_version=3)
    recompute_old_logprobs(engine.module, micro, 1.0, None)
    old = torch.zeros_like(batch.behaviour_logprobs)
    row = 0
    for mb in micro:  # the micro-batches are contiguous runs of whole groups, in batch order
        old[row:row + mb.old_logprobs.shape[0], :mb.old_logprobs.shape[1]] = mb.old_logprobs
        row += mb.old_logprobs.shape[0]
    apply_off_policy(micro, OffPolicyConfig(mode=mode, low=0.7, high=1.3))
    kept = sum(int(mb.correction[1].sum()) for mb in micro)
    before = [p.detach().clone() for p in engine.module.parameters()]
    outcome = grpo_step(engine, micro, LossConfig(beta=0.0), temperature=1.0, old_mode="recompute", world_size=1,
                        log_entropy=False, chunk_tokens=None, lag_buckets=4)
    assert outcome.finite and math.isfinite(outcome.loss)
    kl, diff, by_lag, ess = hand_drift(old, batch)
    metrics = outcome.metrics
    assert metrics["mismatch_ess"] == pytest.approx(ess, rel=1e-5) and 0 < ess < 1   # the lags' shift costs samples
    assert metrics["mismatch_kl"] == pytest.approx(kl, rel=1e-5)
    assert metrics["mismatch_abs_logprob_diff"] == pytest.approx(diff, rel=1e-5)
    for lag, value in by_lag.items():
        assert metrics[f"mismatch_kl/lag_{lag}"] == pytest.approx(value, rel=1e-5, abs=1e-9)
    assert by_lag[3] > by_lag[1] > by_lag[0] * 0  # more lag, more drift (the shift grows with it)
    total = int(batch.completion_lengths.sum())
    assert metrics["loss_tokens"] == (kept if mode in MASKING_MODES else total)
    assert metrics["off_policy_masked_token_frac"] == pytest.approx(1 - kept / total)
    if mode in MASKING_MODES:
        assert 0 < kept < total  # the shifted tokens of lags 1-3 fall outside [0.7, 1.3], the rest inside
    changed = any(not torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    assert changed


def test_bypass_trusts_the_behaviour_logprobs_and_measures_from_the_update(distributed, tiny_model_dir):
    """old_mode 'behaviour': no recompute, the ratio is pi_theta / pi_behaviour (so the shifted tokens show up as
    ratios far from 1 and get clipped), and the drift comes from the update's own forward."""
    batch = drifted_batch(tiny_model_dir)
    engine = make_engine(tiny_model_dir, lr=1e-3, micro_batches=1, groups_per_step=4)
    micro = split_micro_batches(batch, advantages_of(batch), 1, False, CPU, learner_version=3)
    with torch.no_grad():
        reference = micro[0].behaviour_logprobs.clone()
    recompute_old_logprobs(engine.module, micro, 1.0, None)
    old = micro[0].old_logprobs
    micro[0].old_logprobs = None
    outcome = grpo_step(engine, micro, LossConfig(beta=0.0), temperature=1.0, old_mode="behaviour", world_size=1,
                        log_entropy=False, chunk_tokens=None, lag_buckets=4)
    kl, _, _, _ = hand_drift(old, batch)
    assert outcome.metrics["mismatch_kl"] == pytest.approx(kl, rel=1e-5)
    assert outcome.metrics["ratio_max"] > 2.0 and outcome.metrics["off_policy_masked_token_frac"] == 0.0
    assert torch.equal(micro[0].behaviour_logprobs, reference)
