"""Process supervision (DeepSeekMath §4.1.3) and the KL penalty in the reward: hand-computed values and properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.grpo.advantages import (
    group_advantages,
    kl_in_reward_advantages,
    normalised_step_rewards,
    outcome_token_rewards,
    process_advantages,
    step_token_rewards,
)

t = torch.tensor
S3 = 1 / math.sqrt(3)  # 0.57735

# The issue's worked example: G = 2; completion 0 has 5 tokens and steps (end 1, reward 1), (end 3, reward 0);
# completion 1 has 3 tokens and one step (end 2, reward 1).
EXAMPLE = dict(step_rewards=t([1.0, 0.0, 1.0]), step_index=t([0, 0, 1]), step_end=t([1, 3, 2]),
               group_index=t([0, 0]), lengths=t([5, 3]))


def _process(example=EXAMPLE, **kwargs):
    return process_advantages(*example.values(), **{"scale": "group", "eps": 1e-6, **kwargs})


def test_worked_example_of_the_issue():
    # R = [1, 0, 1], mean 2/3, std 0.57735, r~ = [0.57735, -1.1547, 0.57735]
    normalised = normalised_step_rewards(EXAMPLE["step_rewards"], EXAMPLE["step_index"], EXAMPLE["group_index"],
                                         scale="group", eps=1e-6)
    torch.testing.assert_close(normalised, t([S3, -2 * S3, S3]), atol=1e-5, rtol=0)
    expected = t([[-0.57735, -0.57735, -1.1547, -1.1547, 0.0], [0.57735, 0.57735, 0.57735, 0.0, 0.0]])
    adv = _process()
    assert adv.shape == (2, 5) and adv.dtype == torch.float32
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)


def test_steps_may_come_in_any_completion_order():
    shuffled = dict(EXAMPLE, step_rewards=t([1.0, 1.0, 0.0]), step_index=t([1, 0, 0]), step_end=t([2, 1, 3]))
    torch.testing.assert_close(_process(shuffled), _process())


def test_unequal_step_counts_no_steps_equal_rewards_and_a_single_step_in_one_batch():
    # group 0: row 0 (4 tokens) has 3 steps, row 1 (2 tokens) one, row 2 (3 tokens) none. R = [3, 0, 2, -1]:
    # mean 1, centred [2, -1, 1, -2], unbiased std sqrt(10/3) = 1.825742 -> r~ = [1.095445, -0.547723, 0.547723,
    # -1.095445]. group 1: rows 3, 4 with equal step rewards -> 0. group 2: row 5 with one step, row 6 none -> 0.
    example = dict(step_rewards=t([3.0, 0.0, 2.0, -1.0, 5.0, 5.0, 7.0]), step_index=t([0, 0, 0, 1, 3, 4, 5]),
                   step_end=t([0, 1, 3, 1, 0, 0, 2]), group_index=t([0, 0, 0, 1, 1, 2, 2]),
                   lengths=t([4, 2, 3, 2, 1, 3, 2]))
    a, b = 1.095445, 0.547723
    expected = torch.zeros(7, 4)
    expected[0] = t([a - b + b, -b + b, b, b])  # [1.095445, 0, 0.547723, 0.547723]
    expected[1, :2] = -a
    for scale in ("group", "batch", "none"):
        adv = _process(example, scale=scale, eps=0.0)
        assert torch.equal(adv[2:], torch.zeros(5, 4)), scale  # no steps, equal rewards, a single step: 0
        assert torch.isfinite(adv).all()
    torch.testing.assert_close(_process(example, eps=0.0), expected, atol=1e-5, rtol=0)


def test_a_step_ending_at_the_last_token_covers_every_token():
    # R = [1, 0]: mean 0.5, std 0.707107 -> r~ = +-0.707107 on all three tokens
    example = dict(step_rewards=t([1.0, 0.0]), step_index=t([0, 1]), step_end=t([2, 2]), group_index=t([0, 0]),
                   lengths=t([3, 3]))
    expected = t([[0.707107] * 3, [-0.707107] * 3])
    torch.testing.assert_close(_process(example, eps=0.0), expected, atol=1e-5, rtol=0)


def test_scale_none_is_dr_grpo_mean_centering():
    # r~ = R - 2/3 = [1/3, -2/3, 1/3]
    expected = t([[-1 / 3, -1 / 3, -2 / 3, -2 / 3, 0.0], [1 / 3, 1 / 3, 1 / 3, 0.0, 0.0]])
    torch.testing.assert_close(_process(scale="none"), expected)


def test_scale_batch_with_the_global_std_is_the_same_split_over_two_ranks():
    # rank 0 holds the worked example (group 0), rank 1 a second group: rows of 2 tokens, steps
    # (row 0, end 0, reward 4), (row 0, end 1, reward 0), (row 1, end 1, reward 5).
    second = dict(step_rewards=t([4.0, 0.0, 5.0]), step_index=t([0, 0, 1]), step_end=t([0, 1, 1]),
                  group_index=t([0, 0]), lengths=t([2, 2]))
    whole = dict(step_rewards=t([1.0, 0.0, 1.0, 4.0, 0.0, 5.0]), step_index=t([0, 0, 1, 2, 2, 3]),
                 step_end=t([1, 3, 2, 0, 1, 1]), group_index=t([0, 0, 1, 1]), lengths=t([5, 3, 2, 2]))
    batch_std = torch.cat([EXAMPLE["step_rewards"], second["step_rewards"]]).std().item()
    assert abs(batch_std - 2.136976) < 1e-5  # unbiased std of [1, 0, 1, 4, 0, 5]
    rank0 = _process(EXAMPLE, scale="batch", eps=0.0, batch_std=batch_std)
    rank1 = _process(second, scale="batch", eps=0.0, batch_std=batch_std)
    one_rank = _process(whole, scale="batch", eps=0.0)  # batch_std defaults to this batch's std
    torch.testing.assert_close(torch.cat([rank0, torch.nn.functional.pad(rank1, (0, 3))]), one_rank)
    # group 1: mean 3, centred [1, -3, 2] / 2.136976
    torch.testing.assert_close(rank1, t([[-2.0, -3.0], [2.0, 2.0]]) / 2.136976, atol=1e-5, rtol=0)
    # the batch std is not the rank's own: rank 0 alone would divide by std([1, 0, 1]) = 0.57735
    assert not torch.allclose(rank0, _process(EXAMPLE, scale="batch", eps=0.0))


def test_kl_in_reward_k1_and_k3_outcome_placement_by_hand():
    p, old, ref = t([[0.0, 0.0, 1.0]]), t([[-1.0, -1.0, -1.0]]), t([[-2.0, -1.0, -3.0]])
    # k1 = old - ref = [1, 0, 2]; r = -0.1 k + p = [-0.1, 0, 0.8]; returns to go [0.7, 0.8, 0.8]
    k1 = kl_in_reward_advantages(p, old, ref, t([3]), beta=0.1, estimator="k1")
    torch.testing.assert_close(k1, t([[0.7, 0.8, 0.8]]))
    torch.testing.assert_close(kl_in_reward_advantages(p, old, ref, t([3]), beta=0.1), k1)  # k1 is the default
    # log r = ref - old = [-1, 0, -2]; k3 = e^log r - 1 - log r = [0.367879, 0, 1.135335]
    # r = [-0.0367879, 0, 0.8864665]; returns to go [0.8496786, 0.8864665, 0.8864665]
    k3 = kl_in_reward_advantages(p, old, ref, t([3]), beta=0.1, estimator="k3")
    torch.testing.assert_close(k3, t([[0.8496786, 0.8864665, 0.8864665]]))


def test_kl_in_reward_outcome_helper_two_rows_and_padding():
    token_rewards = outcome_token_rewards(t([0.5, -0.5]), t([3, 2]))
    assert torch.equal(token_rewards, t([[0.0, 0.0, 0.5], [0.0, -0.5, 0.0]]))
    old = t([[-1.0, -1.0, -1.0], [-0.5, -2.0, -math.inf]])
    ref = t([[-2.0, -1.0, -3.0], [-1.0, -1.0, -math.inf]])
    # row 1: k1 = [0.5, -1] -> r = [-0.05, 0.1 - 0.5] -> [-0.45, -0.4], then 0 past its length
    adv = kl_in_reward_advantages(token_rewards, old, ref, t([3, 2]), beta=0.1, estimator="k1")
    torch.testing.assert_close(adv, t([[0.2, 0.3, 0.3], [-0.45, -0.4, 0.0]]))
    assert torch.equal(outcome_token_rewards(t([1.0, 2.0]), t([0, 1]), width=3), t([[0.0, 0, 0], [2.0, 0, 0]]))


def test_kl_in_reward_process_placement_by_hand():
    normalised = normalised_step_rewards(EXAMPLE["step_rewards"], EXAMPLE["step_index"], EXAMPLE["group_index"],
                                         scale="group", eps=1e-6)
    token_rewards = step_token_rewards(normalised, EXAMPLE["step_index"], EXAMPLE["step_end"], EXAMPLE["lengths"])
    torch.testing.assert_close(token_rewards, t([[0.0, S3, 0.0, -2 * S3, 0.0], [0.0, 0.0, S3, 0.0, 0.0]]),
                               atol=1e-5, rtol=0)
    ref = torch.full((2, 5), -1.0)
    old = ref + 0.2  # k1 = 0.2 on every token; log r = -0.2, k3 = e^-0.2 - 1 + 0.2 = 0.018730753
    # beta = 0: the returns to go of p alone, which is the process advantage
    zero = kl_in_reward_advantages(token_rewards, old, ref, EXAMPLE["lengths"], beta=0.0, estimator="k1")
    torch.testing.assert_close(zero, _process(), atol=1e-6, rtol=0)
    # beta 0.5 with k1 = 0.2: A_t = process A_t - 0.1 * (tokens from t to the end)
    k1 = kl_in_reward_advantages(token_rewards, old, ref, EXAMPLE["lengths"], beta=0.5, estimator="k1")
    expected = t([[-1.07735, -0.97735, -1.4547, -1.3547, -0.1], [0.27735, 0.37735, 0.47735, 0.0, 0.0]])
    torch.testing.assert_close(k1, expected, atol=1e-5, rtol=0)
    k3 = kl_in_reward_advantages(token_rewards, old, ref, EXAMPLE["lengths"], beta=0.5, estimator="k3")
    remaining = t([[5.0, 4, 3, 2, 1], [3.0, 2, 1, 0, 0]])
    torch.testing.assert_close(k3, _process() - 0.5 * 0.018730753 * remaining, atol=1e-5, rtol=0)


def test_kl_in_reward_takes_no_gradient():
    old = torch.full((1, 3), -1.0, requires_grad=True)
    ref = torch.full((1, 3), -2.0, requires_grad=True)
    adv = kl_in_reward_advantages(torch.zeros(1, 3), old, ref, t([3]), beta=0.1, estimator="k3")
    assert not adv.requires_grad


def test_zeros_past_lengths_and_empty_inputs():
    adv = _process(dict(EXAMPLE, lengths=t([5, 4])))
    assert adv[1, 3] == 0 and adv.shape == (2, 5)
    empty = process_advantages(t([]), t([], dtype=torch.long), t([], dtype=torch.long), t([0, 0]), t([3, 0]),
                               scale="group", eps=1e-6)
    assert torch.equal(empty, torch.zeros(2, 3))
    rewards = torch.ones(2, 4)
    garbage = torch.full((2, 4), math.nan)
    garbage[:, :2] = -1.0
    adv = kl_in_reward_advantages(rewards, garbage, garbage, t([2, 0]), beta=1.0, estimator="k3")
    assert torch.equal(adv, t([[2.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))


def test_supervisions_are_the_registry_the_config_checks():
    from learner.advantages import SUPERVISIONS, OutcomeSupervision, ProcessSupervision
    from shared.config.schema import AdvantageConfig

    assert SUPERVISIONS.names() == ["none", "outcome", "process"]
    assert SUPERVISIONS.get("outcome") is OutcomeSupervision and SUPERVISIONS.get("process") is ProcessSupervision
    with pytest.raises(ValueError, match="unknown advantage supervision 'steps'; known: none, outcome, process"):
        AdvantageConfig(supervision="steps")


@pytest.mark.parametrize("change, message", [
    (dict(step_rewards=t([1.0, math.nan, 1.0])), "step_rewards contain NaN or inf"),
    (dict(step_rewards=t([1.0, 0.0])), r"step_rewards and step_index must both be \[S\]"),
    (dict(step_end=t([1, 3])), r"step_end must be \[S\]"),
    (dict(step_index=t([0, 0, 2])), r"step_index must be in \[0, 2\)"),
    (dict(step_index=t([0.0, 0.0, 1.0])), "step_index must be a 1-D integer tensor"),
    (dict(step_end=t([1, 5, 2])), "step_end\\[1\\] = 5 is outside completion 0's 5 tokens"),
    (dict(step_end=t([1, 3, -1])), "step_end\\[2\\] = -1 is outside"),
    (dict(step_end=t([3, 1, 2])), "strictly increasing within a completion: step_end\\[1\\] = 1 of completion 0"),
    (dict(step_end=t([3, 3, 2])), "strictly increasing"),
    (dict(group_index=t([0])), r"group_index and lengths must both be \[N\]"),
    (dict(group_index=t([0, -1])), "group_index must be >= 0"),
    (dict(lengths=t([5, -3])), "lengths must be >= 0"),
])
def test_process_advantages_rejects_bad_inputs(change, message):
    with pytest.raises(ValueError, match=message):
        _process(dict(EXAMPLE, **change))


def test_bad_scale_and_bad_kl_in_reward_inputs():
    with pytest.raises(ValueError, match="unknown advantage scale 'global'"):
        _process(scale="global")
    good = dict(token_rewards=torch.zeros(2, 3), old_logprobs=torch.zeros(2, 3), ref_logprobs=torch.zeros(2, 3),
                lengths=t([3, 1]))
    cases = [
        (dict(old_logprobs=torch.zeros(2, 4)), r"must all be \[N, T\]"),
        (dict(lengths=t([3])), r"lengths must be \[N\] = \[2\]"),
        (dict(lengths=t([4, 1])), "exceeds max_len 3"),
        (dict(lengths=t([3, -1])), "lengths must be >= 0"),
        (dict(token_rewards=t([[0.0, math.inf, 0.0], [0.0, 0.0, 0.0]])), "token_rewards contain NaN or inf"),
        (dict(ref_logprobs=t([[0.0, 0.0, 0.0], [-math.inf, 0.0, 0.0]])), "ref_logprobs contain NaN or inf"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            kl_in_reward_advantages(**{**good, **change}, beta=0.1, estimator="k1")
    with pytest.raises(ValueError, match="unknown KL-in-reward estimator 'k2'"):
        kl_in_reward_advantages(**good, beta=0.1, estimator="k2")
    with pytest.raises(ValueError, match="beta must be a finite number >= 0"):
        kl_in_reward_advantages(**good, beta=-0.1, estimator="k1")
    assert kl_in_reward_advantages(**good, beta=0.1, estimator="low_var_kl").shape == (2, 3)  # verl's alias of k3


@st.composite
def _batches(draw, one_step_at_end=False):
    """A batch of groups: completions with lengths, step ends (sorted positions) and step rewards."""
    groups = draw(st.integers(1, 3))
    group_index, lengths, steps = [], [], []
    for g in range(groups):
        for _ in range(draw(st.integers(1, 4))):
            row, length = len(lengths), draw(st.integers(1 if one_step_at_end else 0, 6))
            group_index.append(g)
            lengths.append(length)
            ends = [length - 1] if one_step_at_end else sorted(draw(st.sets(st.integers(0, max(length - 1, 0)),
                                                                            max_size=length)))
            for end in ends:
                steps.append((row, end, draw(st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0]))))
    rows, ends, rewards = zip(*steps) if steps else ((), (), ())
    return dict(step_rewards=t(rewards, dtype=torch.float32), step_index=t(rows, dtype=torch.long),
                step_end=t(ends, dtype=torch.long), group_index=t(group_index), lengths=t(lengths))


@settings(max_examples=60, deadline=None)
@given(_batches(), st.sampled_from(["group", "batch", "none"]))
def test_process_advantage_is_the_sum_of_the_remaining_steps(batch, scale):
    adv = _process(batch, scale=scale).double()
    normalised = normalised_step_rewards(batch["step_rewards"], batch["step_index"], batch["group_index"],
                                         scale=scale, eps=1e-6).double()
    at_end = torch.zeros_like(adv).index_put_((batch["step_index"], batch["step_end"]), normalised)
    lengths = batch["lengths"]
    # token 0 holds the sum of the completion's r~ (completions of length 0 have no token 0)
    sums = torch.zeros(len(lengths), dtype=torch.float64).index_add_(0, batch["step_index"], normalised)
    if adv.shape[1]:
        torch.testing.assert_close(adv[:, 0], torch.where(lengths > 0, sums, 0.0), atol=1e-5, rtol=0)
    # A[t] - A[t+1] = r~ of the step ending at t (0 if none), with A = 0 from the length on
    following = torch.cat([adv[:, 1:], torch.zeros(len(lengths), 1, dtype=adv.dtype)], dim=1)
    torch.testing.assert_close(adv - following, at_end, atol=1e-5, rtol=0)
    positions = torch.arange(adv.shape[1])
    assert (adv[positions >= lengths[:, None]] == 0).all()


@settings(max_examples=60, deadline=None)
@given(_batches(one_step_at_end=True), st.sampled_from(["group", "batch", "none"]))
def test_one_step_at_the_last_token_is_outcome_grpo_broadcast(batch, scale):
    outcome = torch.zeros(len(batch["lengths"])).index_copy_(0, batch["step_index"], batch["step_rewards"])
    expected = group_advantages(outcome, batch["group_index"], scale=scale, eps=1e-6)
    adv = _process(batch, scale=scale)
    mask = torch.arange(adv.shape[1]) < batch["lengths"][:, None]
    torch.testing.assert_close(adv, torch.where(mask, expected[:, None], 0.0), atol=1e-5, rtol=1e-5)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(-3, 3, allow_nan=False), st.integers(0, 5)), min_size=1, max_size=6),
       st.integers(0, 2), st.sampled_from(["k1", "k3"]))
def test_kl_in_reward_with_beta_zero_gives_the_outcome_advantage_on_every_token(rows, extra, estimator):
    advantages, lengths = t([a for a, _ in rows]), t([n for _, n in rows])
    width = int(lengths.max()) + extra
    token_rewards = outcome_token_rewards(advantages, lengths, width=width)
    generator = torch.Generator().manual_seed(len(rows))
    old, ref = -torch.rand(2, len(rows), width, generator=generator) * 5
    adv = kl_in_reward_advantages(token_rewards, old, ref, lengths, beta=0.0, estimator=estimator)
    mask = torch.arange(width) < lengths[:, None]
    torch.testing.assert_close(adv, torch.where(mask, advantages[:, None], 0.0), atol=1e-6, rtol=0)
