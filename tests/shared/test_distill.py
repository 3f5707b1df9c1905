"""On-policy distillation's per-token reward: the docstring's example by hand, and its rules by property."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.grpo.distill import centred_token_rewards, distill_token_rewards, reverse_kl_mean

t = torch.tensor


def test_worked_example_of_the_docstring():
    student, teacher = t([[-1.0, -2.0, -0.5]]), t([[-0.5, -3.0, -0.5]])
    rewards = distill_token_rewards(student, teacher, t([2]), coef=1.0)
    assert rewards.dtype == torch.float32 and rewards.shape == (1, 3)
    torch.testing.assert_close(rewards, t([[0.5, -1.0, 0.0]]))
    masked = distill_token_rewards(student, teacher, t([2]), coef=1.0, loss_mask=t([[1, 0, 1]]))
    torch.testing.assert_close(masked, t([[0.5, 0.0, 0.0]]))


def test_coef_scales_and_padding_may_hold_anything():
    student = t([[-1.0, -1.0, float("-inf")], [-2.0, float("nan"), 0.0]])
    teacher = t([[-3.0, 0.0, float("nan")], [-1.0, -7.0, 0.0]])
    rewards = distill_token_rewards(student, teacher, t([2, 1]), coef=0.5)
    # row 0: -0.5 * ([-1, -1] - [-3, 0]) = -0.5 * [2, -1] = [-1, 0.5]; row 1: -0.5 * (-2 - -1) = 0.5
    torch.testing.assert_close(rewards, t([[-1.0, 0.5, 0.0], [0.5, 0.0, 0.0]]))
    assert reverse_kl_mean(student, teacher, t([2, 1])) == pytest.approx((2 - 1 - 1) / 3)


def test_equal_models_give_zero_and_no_gradient_flows():
    student = torch.randn(3, 4, requires_grad=True)
    rewards = distill_token_rewards(student, student.detach().clone(), t([4, 2, 0]), coef=2.0)
    assert not rewards.requires_grad and torch.equal(rewards, torch.zeros(3, 4))


@pytest.mark.parametrize("kwargs, message", [
    (dict(student=torch.zeros(2, 3), teacher=torch.zeros(2, 4), lengths=t([1, 1]), coef=1.0), "both be \\[N, T\\]"),
    (dict(student=torch.zeros(3), teacher=torch.zeros(3), lengths=t([1]), coef=1.0), "both be \\[N, T\\]"),
    (dict(student=torch.zeros(2, 3), teacher=torch.zeros(2, 3), lengths=t([1]), coef=1.0), "lengths must be"),
    (dict(student=torch.zeros(2, 3), teacher=torch.zeros(2, 3), lengths=t([1.0, 2.0]), coef=1.0), "integers"),
    (dict(student=torch.zeros(2, 3), teacher=torch.zeros(2, 3), lengths=t([1, 4]), coef=1.0), "exceeds"),
    (dict(student=torch.zeros(2, 3), teacher=torch.zeros(2, 3), lengths=t([1, -1]), coef=1.0), ">= 0"),
    (dict(student=torch.zeros(2, 3), teacher=torch.zeros(2, 3), lengths=t([1, 1]), coef=-1.0), "coef"),
    (dict(student=torch.zeros(2, 3), teacher=torch.zeros(2, 3), lengths=t([1, 1]), coef=math.nan), "coef"),
    (dict(student=t([[float("nan")]]), teacher=t([[0.0]]), lengths=t([1]), coef=1.0), "NaN or inf"),
    (dict(student=torch.zeros(2, 3), teacher=torch.zeros(2, 3), lengths=t([1, 1]), coef=1.0,
          loss_mask=torch.ones(2, 2)), "loss_mask"),
])
def test_bad_input_is_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        distill_token_rewards(kwargs.pop("student"), kwargs.pop("teacher"), kwargs.pop("lengths"), **kwargs)


@st.composite
def _cases(draw):
    n, width = draw(st.integers(0, 5)), draw(st.integers(0, 6))
    lengths = draw(st.lists(st.integers(0, width), min_size=n, max_size=n))
    floats = st.floats(-30.0, 0.0, allow_nan=False)
    student = draw(st.lists(st.lists(floats, min_size=width, max_size=width), min_size=n, max_size=n))
    teacher = draw(st.lists(st.lists(floats, min_size=width, max_size=width), min_size=n, max_size=n))
    mask = draw(st.lists(st.lists(st.booleans(), min_size=width + 1, max_size=width + 1), min_size=n, max_size=n))
    coef = draw(st.floats(0.0, 10.0))
    return (torch.tensor(student).reshape(n, width), torch.tensor(teacher).reshape(n, width),
            torch.tensor(lengths, dtype=torch.long), torch.tensor(mask, dtype=torch.bool).reshape(n, width + 1), coef)


@settings(max_examples=150, deadline=None)
@given(_cases(), st.booleans())
def test_each_token_is_its_own_reward_and_zero_elsewhere(case, with_mask):
    student, teacher, lengths, mask, coef = case
    rewards = distill_token_rewards(student, teacher, lengths, coef=coef, loss_mask=mask if with_mask else None)
    assert rewards.shape == student.shape and rewards.dtype == torch.float32
    for i in range(student.shape[0]):
        for j in range(student.shape[1]):
            counted = j < int(lengths[i]) and (not with_mask or bool(mask[i, j]))
            expected = -coef * (float(student[i, j]) - float(teacher[i, j])) if counted else 0.0
            assert float(rewards[i, j]) == pytest.approx(expected, rel=1e-5, abs=1e-4)


def test_the_baselines_worked_example():
    got = centred_token_rewards(torch.tensor([[0.5, -1.0, 0.0], [-2.0, 0.0, 0.0]]), torch.tensor([2, 1]))
    torch.testing.assert_close(got, torch.tensor([[4 / 3, -1 / 6, 0.0], [-7 / 6, 0.0, 0.0]]))
    assert torch.equal(centred_token_rewards(torch.ones(2, 3), torch.tensor([0, 0])), torch.zeros(2, 3))


@settings(max_examples=150, deadline=None)
@given(_cases(), st.booleans())
def test_the_baseline_centres_the_model_tokens_and_keeps_their_differences(case, with_mask):
    student, teacher, lengths, mask, coef = case
    loss_mask = mask if with_mask else None
    rewards = distill_token_rewards(student, teacher, lengths, coef=coef, loss_mask=loss_mask)
    centred = centred_token_rewards(rewards, lengths, loss_mask)
    counted = [(i, j) for i in range(student.shape[0]) for j in range(student.shape[1])
               if j < int(lengths[i]) and (not with_mask or bool(mask[i, j]))]
    mean = sum(float(rewards[i, j]) for i, j in counted) / len(counted) if counted else 0.0
    for i in range(student.shape[0]):
        for j in range(student.shape[1]):
            expected = float(rewards[i, j]) - mean if (i, j) in counted else 0.0
            assert float(centred[i, j]) == pytest.approx(expected, rel=1e-5, abs=1e-3)
