"""The step's per-token version metrics (issue 38): ``token_version_lag_mean`` and ``token_version_spread_max`` on a
hand-built batch, from the tokens' versions when the batch has them and from the rows' otherwise."""

from dataclasses import replace

import pytest
import torch

from learner.step import grpo_step, split_micro_batches
from shared.config.schema import LossConfig
from shared.grpo.off_policy import (
    MISMATCH_SUM_PREFIX,
    TOKEN_SPREAD_MAX_KEY,
    mismatch_metrics,
    version_lag_sums,
)
from shared.protocol.records import RolloutGroup, TrainBatch
from shared.tensors.masks import completion_mask

from .batches import advantages_of, batch_of, sampled_groups
from .test_step import CPU, make_engine


def group(lengths, policy_version, versions=None, seed=0) -> RolloutGroup:
    gen = torch.Generator().manual_seed(seed)
    return RolloutGroup.from_samples(
        prompt_ids=[1, 2], completion_ids=[torch.randint(3, 30, (n,), generator=gen).tolist() for n in lengths],
        behaviour_logprobs=[[-0.5] * n for n in lengths], rewards=[float(i % 2) for i in range(len(lengths))],
        finish_reasons=["stop"] * (len(lengths) - 1) + ["length"], policy_version=policy_version,
        generator_id="g", versions=versions).validate()


# learner at version 6. Group 0 (oldest token 4): row 0 crossed two switches (lags 2, 1, 0), row 1 was sampled at 5
# (lags 1, 1; the truncated row). Group 1: an old client's group at version 6 (lags 0).
GROUPS = [group((3, 2), 4, ([4, 5, 6], [5, 5])), group((2, 1), 6, seed=1)]


def step_numbers(batch: TrainBatch, *, mask_truncated: bool = False) -> dict[str, float]:
    """The metrics from the micro-batches' device sums, reduced as grpo_step reduces them (summed; max)."""
    sums = {MISMATCH_SUM_PREFIX + "tokens": 0.0, MISMATCH_SUM_PREFIX + "token_lag": 0.0}
    spread = 0.0
    for mb in split_micro_batches(batch, advantages_of(batch), 2, mask_truncated, CPU, learner_version=6):
        valid = completion_mask(mb.loss_lengths, mb.behaviour_logprobs.shape[1], mb.loss_mask)
        got = version_lag_sums(valid, mb.lags, mb.token_lags)
        sums[MISMATCH_SUM_PREFIX + "tokens"] += float(valid.sum())
        sums[MISMATCH_SUM_PREFIX + "token_lag"] += float(got[MISMATCH_SUM_PREFIX + "token_lag"])
        spread = max(spread, float(got[TOKEN_SPREAD_MAX_KEY]))
    return {**mismatch_metrics(sums), TOKEN_SPREAD_MAX_KEY: spread}


def test_token_lags_come_from_the_tokens_versions():
    batch = TrainBatch.from_groups(GROUPS, None)
    assert batch.policy_versions.tolist() == [4, 4, 6, 6]
    numbers = step_numbers(batch)
    assert numbers["token_version_lag_mean"] == pytest.approx((2 + 1 + 0 + 1 + 1) / 8)
    assert numbers[TOKEN_SPREAD_MAX_KEY] == 2.0                          # row 0: versions 4 .. 6
    # the truncated rows left out of the loss leave the metrics too (row 1: lags 1, 1; row 3: lag 0)
    masked = step_numbers(batch, mask_truncated=True)
    assert masked["token_version_lag_mean"] == pytest.approx(3 / 5) and masked[TOKEN_SPREAD_MAX_KEY] == 2.0


def test_without_token_versions_every_token_has_its_rows_lag():
    batch = replace(TrainBatch.from_groups(GROUPS, None), token_versions=None)
    numbers = step_numbers(batch)
    assert numbers["token_version_lag_mean"] == pytest.approx((2 * 3 + 2 * 2) / 8)   # group 0's rows lag 2
    assert numbers[TOKEN_SPREAD_MAX_KEY] == 0.0


@pytest.mark.slow
def test_the_step_reports_them(distributed, tiny_model_dir):
    """Through grpo_step on the tiny model: the same numbers, reduced over two micro-batches by the step."""
    groups = sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0]], seed=3)
    lengths = groups[0].completion_lengths.tolist()
    groups[0] = replace(groups[0], policy_version=4,
                        token_versions=torch.tensor([[4 + min(t, 2) for t in range(groups[0].completion_ids.shape[1])]
                                                     for _ in lengths])).validate()
    groups[1].policy_version = 5
    batch = batch_of(groups)
    engine = make_engine(tiny_model_dir, lr=1e-3, micro_batches=2, groups_per_step=2)
    micro = split_micro_batches(batch, advantages_of(batch), 2, False, CPU, learner_version=6)
    outcome = grpo_step(engine, micro, LossConfig(beta=0.0), temperature=1.0, old_mode="behaviour", world_size=1,
                        log_entropy=False, chunk_tokens=None, lag_buckets=4)
    hand_lags = [6 - min(4 + min(t, 2), 6) for n in lengths for t in range(n)]
    hand_lags += [1] * int(groups[1].completion_lengths.sum())
    assert outcome.finite
    assert outcome.metrics["token_version_lag_mean"] == pytest.approx(sum(hand_lags) / len(hand_lags))
    longest = max(lengths)
    assert outcome.metrics[TOKEN_SPREAD_MAX_KEY] == min(longest - 1, 2)
