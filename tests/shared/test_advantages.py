import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.grpo.advantages import ADVANTAGE_ESTIMATORS
from shared.grpo.advantages import compute_advantages as _compute
from shared.grpo.advantages import group_advantages as _group
from shared.grpo.advantages import rloo_advantages as _rloo


def _flat(rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[P, G]`` rewards as the flat ``[N]`` rewards and group index the estimators take."""
    if rewards.dim() != 2:
        return rewards, torch.zeros(rewards.shape[:1], dtype=torch.long)
    return rewards.flatten(), torch.arange(rewards.shape[0]).repeat_interleave(rewards.shape[1])


def _grid(fn):
    """Call a flat estimator on ``[P, G]`` rewards and give the answer back as ``[P, G]``."""
    def call(rewards, *args, **kwargs):
        flat, index = _flat(rewards)
        out = fn(flat, index, *args, **kwargs)
        return out.view(rewards.shape).to(rewards.dtype)
    return call


group_advantages, rloo_advantages, compute_advantages = _grid(_group), _grid(_rloo), _grid(_compute)


def test_seed_000_rewards_give_pm_0_9129():
    adv = group_advantages(torch.tensor([[0.0, 1, 0, 1, 1, 0]]), eps=1e-8)
    expected = torch.tensor([[-0.9129, 0.9129, -0.9129, 0.9129, 0.9129, -0.9129]])
    torch.testing.assert_close(adv, expected, atol=1e-4, rtol=0)


def test_group_std_is_unbiased_like_torch_std():
    rewards = torch.tensor([[1.0, 2.0, 4.0]])
    # mean 7/3; unbiased std = sqrt(((-4/3)^2 + (-1/3)^2 + (5/3)^2) / 2) = sqrt(7/3)
    expected = (rewards - 7 / 3) / (7 / 3) ** 0.5
    torch.testing.assert_close(group_advantages(rewards, eps=0.0), expected)


def test_all_equal_groups_get_exact_zero_never_nan():
    rewards = torch.tensor([[0.3, 0.3, 0.3, 0.3], [1.0, 0.0, 1.0, 0.0], [-7.1, -7.1, -7.1, -7.1]])
    for scale in ("group", "batch", "none"):
        adv = group_advantages(rewards, scale=scale, eps=1e-12)
        assert torch.isfinite(adv).all()
        assert torch.equal(adv[0], torch.zeros(4)) and torch.equal(adv[2], torch.zeros(4))
        assert (adv[1] != 0).all()


def test_group_of_one_gets_zero():
    assert torch.equal(group_advantages(torch.tensor([[5.0], [2.0]])), torch.zeros(2, 1))
    assert torch.equal(rloo_advantages(torch.tensor([[5.0], [2.0]])), torch.zeros(2, 1))


def test_scale_none_is_dr_grpo_mean_centering():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 4.0, 6.0, 8.0]])
    expected = torch.tensor([[0.75, -0.25, -0.25, -0.25], [-3.0, -1.0, 1.0, 3.0]])
    torch.testing.assert_close(group_advantages(rewards, scale="none"), expected)


def test_scale_batch_uses_group_mean_and_batch_std():
    rewards = torch.tensor([[1.0, 0.0], [3.0, 5.0]])
    batch_std = rewards.flatten().std()  # unbiased over all 4: std([1,0,3,5]) = 2.2174
    assert abs(batch_std.item() - 2.21736) < 1e-4
    expected = torch.tensor([[0.5, -0.5], [-1.0, 1.0]]) / batch_std
    torch.testing.assert_close(group_advantages(rewards, scale="batch", eps=0.0), expected)


def test_rloo_is_reward_minus_mean_of_others():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 2.0]])
    # baseline of sample 0 = mean(0, 0, 2) = 2/3 -> 1/3 ; sample 3: 2 - 1/3 = 5/3
    expected = torch.tensor([[1 / 3, -1.0, -1.0, 5 / 3]])
    torch.testing.assert_close(rloo_advantages(rewards), expected)


def test_registry_and_dispatch():
    assert {"grpo", "rloo"} <= set(ADVANTAGE_ESTIMATORS.names())
    rewards = torch.tensor([[1.0, 0.0, 0.0, 2.0]])
    torch.testing.assert_close(compute_advantages(rewards, "rloo", scale="none"), rloo_advantages(rewards))
    with pytest.raises(KeyError, match="unknown advantage estimator 'gae'; known: grpo, rloo"):
        compute_advantages(rewards, "gae")
    with pytest.raises(ValueError, match="unknown advantage scale"):
        group_advantages(rewards, scale="global")


def test_rejects_non_finite_rewards_and_bad_shapes():
    with pytest.raises(ValueError, match="NaN or inf"):
        group_advantages(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match=r"must both be \[N\]"):
        _group(torch.tensor([1.0, 0.0]), torch.tensor([0]))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.floats(-10, 10, allow_nan=False), min_size=2, max_size=8), min_size=1, max_size=6)
    .filter(lambda rows: len({len(r) for r in rows}) == 1)
)
def test_group_advantages_properties(rows):
    rewards = torch.tensor(rows, dtype=torch.float64)
    adv = group_advantages(rewards, scale="group", eps=1e-6)
    assert adv.shape == rewards.shape and torch.isfinite(adv).all()
    # zero mean per group; an order-preserving map of the rewards within each group
    torch.testing.assert_close(adv.mean(dim=1), torch.zeros(len(rows), dtype=torch.float64), atol=1e-6, rtol=0)
    for r, a in zip(rewards, adv):
        for i in range(len(r)):
            for j in range(len(r)):
                if r[i] > r[j]:
                    assert a[i] >= a[j]
    # invariant to shifting a group's rewards (up to float rounding); std-scaled ones bounded by sqrt(G-1)
    shifted = group_advantages(rewards + 3.0, scale="group", eps=1e-6)
    torch.testing.assert_close(shifted, adv, atol=1e-5, rtol=1e-5)
    assert adv.abs().max() <= (rewards.shape[1] - 1) ** 0.5 + 1e-6


def test_groups_of_different_sizes_in_one_batch():
    rewards = torch.tensor([1.0, 0.0, 3.0, 5.0, 4.0])
    index = torch.tensor([0, 0, 1, 1, 1])
    adv = _group(rewards, index, scale="none")
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -1.0, 1.0, 0.0]))
    # group 1: std([3, 5, 4]) = 1; RLOO factor 3/2 there, 2 in group 0
    torch.testing.assert_close(_group(rewards, index, eps=0.0), torch.tensor([0.5, -0.5, 0.0, 0.0, 0.0]) / 0.70710677
                               + torch.tensor([0.0, 0.0, -1.0, 1.0, 0.0]))
    torch.testing.assert_close(_rloo(rewards, index), torch.tensor([1.0, -1.0, -1.5, 1.5, 0.0]))


def test_batch_scale_is_the_std_of_the_whole_batch_not_of_each_group():
    """[0,1,0,1] and [0,10,0,10] in one batch: the batch std is 4.496, so +-0.11 and +-1.11 (GRPO's group std
    would give +-0.866 for both)."""
    rewards = torch.tensor([0.0, 1, 0, 1, 0, 10, 0, 10])
    index = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    batch = _group(rewards, index, scale="batch", eps=0.0)
    torch.testing.assert_close(batch.abs(), torch.tensor([0.5] * 4 + [5.0] * 4) / 4.49603, atol=1e-5, rtol=0)
    group = _group(rewards, index, scale="group", eps=0.0)
    torch.testing.assert_close(group.abs(), torch.full((8,), 0.866025), atol=1e-5, rtol=0)
    # the learner passes the std over every rank's rewards
    given = _group(rewards, index, scale="batch", eps=0.0, batch_std=2.0)
    torch.testing.assert_close(given.abs(), torch.tensor([0.25] * 4 + [2.5] * 4))
