"""Top-k logit distillation's loss terms (shared.grpo.distill.topk_forward_kl_loss_terms): the docstring's example
and a small batch by hand, and its rules by property (zeros outside, finite, >= 0, 0 at the renormalised teacher,
-log Z_T at the teacher itself, the gradient p_S - p~_T)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.grpo.distill import forward_kl_mean, topk_forward_kl_loss_terms

t = torch.tensor
log = math.log


def test_worked_example_of_the_docstring():
    teacher, student = t([[[log(0.6), log(0.2)]]]), t([[[log(0.5), log(0.25)]]])
    terms = topk_forward_kl_loss_terms(student, teacher, t([1]))
    assert terms.shape == (1, 1) and terms.dtype == torch.float32
    assert float(terms[0, 0]) == pytest.approx(0.75 * log(1.5), abs=1e-6)  # 0.3041


def test_a_small_batch_by_hand():
    """Two rows, k = 3, width 3: row 0 has 2 tokens, the second an environment token; row 1 has 1 token. Padding
    and the environment token hold NaN and -inf, which must not leak."""
    nan, inf = float("nan"), float("inf")
    teacher = t([[[log(0.5), log(0.3), log(0.2)], [nan, nan, nan], [0.0, 0.0, 0.0]],
                 [[log(0.4), log(0.4), -inf], [-inf, -inf, -inf], [nan, 0.0, 0.0]]])
    student = t([[[log(0.25), log(0.25), log(0.25)], [-inf, 0.0, 0.0], [nan, nan, nan]],
                 [[log(0.1), log(0.7), log(0.2)], [nan, nan, nan], [0.0, 0.0, 0.0]]])
    terms = topk_forward_kl_loss_terms(student, teacher, t([2, 1]), loss_mask=t([[1, 0, 1], [1, 1, 1]]))
    # row 0, token 0: the teacher's top-3 hold all its mass: 0.5 log 2 + 0.3 log 1.2 + 0.2 log 0.8
    row0 = 0.5 * log(0.5 / 0.25) + 0.3 * log(0.3 / 0.25) + 0.2 * log(0.2 / 0.25)
    # row 1, token 0: the third id has no teacher mass (-inf): p~_T = [0.5, 0.5, 0]
    row1 = 0.5 * log(0.5 / 0.1) + 0.5 * log(0.5 / 0.7)
    torch.testing.assert_close(terms, t([[row0, 0.0, 0.0], [row1, 0.0, 0.0]]))
    mean = forward_kl_mean(terms, t([2, 1]), t([[1, 0, 1], [1, 1, 1]]))
    assert float(mean) == pytest.approx((row0 + row1) / 2, abs=1e-6)


def test_shapes_and_lengths_are_checked():
    x = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="must both be"):
        topk_forward_kl_loss_terms(x, x[..., :2], t([1, 1]))
    with pytest.raises(ValueError, match="lengths must be"):
        topk_forward_kl_loss_terms(x, x, t([1.0, 1.0]))
    with pytest.raises(ValueError):
        topk_forward_kl_loss_terms(x, x, t([1, 4]))
    with pytest.raises(ValueError, match="loss_mask must be"):
        topk_forward_kl_loss_terms(x, x, t([1, 1]), loss_mask=torch.ones(2, 2))


def _case(draw):
    n, width, k = draw(st.integers(1, 4)), draw(st.integers(1, 6)), draw(st.integers(1, 6))
    vocab = k + draw(st.integers(0, 8))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    scale = draw(st.sampled_from([0.1, 1.0, 5.0]))
    teacher_full = (torch.randn(n, width, vocab, generator=gen) * scale).log_softmax(-1)
    student_full = (torch.randn(n, width, vocab, generator=gen) * scale).log_softmax(-1)
    teacher, ids = teacher_full.topk(k, dim=-1)
    lengths = torch.tensor(draw(st.lists(st.integers(0, width), min_size=n, max_size=n)))
    mask = torch.rand(n, width, generator=gen) > draw(st.sampled_from([0.0, 0.3]))
    return teacher, student_full.gather(-1, ids), teacher_full.gather(-1, ids), lengths, mask


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_rules_by_property(data):
    teacher, student, teacher_as_student, lengths, mask = _case(data.draw)
    terms = topk_forward_kl_loss_terms(student, teacher, lengths, loss_mask=mask)
    valid = (torch.arange(teacher.shape[1])[None] < lengths[:, None]) & mask
    assert terms.shape == lengths.shape + teacher.shape[1:2] and torch.isfinite(terms).all()
    assert (terms[~valid] == 0).all()
    assert (terms >= -1e-5).all()                               # >= 0: KL(p~_T || p~_S) - log Z_S, both >= 0
    # the student equal to the renormalised teacher on the top-k: exactly the minimum, 0
    renormalised = teacher - teacher.logsumexp(-1, keepdim=True)
    at_minimum = topk_forward_kl_loss_terms(renormalised, teacher, lengths, loss_mask=mask)
    assert at_minimum.abs().max() < 1e-5
    # the student equal to the teacher: -log Z_T, the teacher's mass outside its top-k
    same = topk_forward_kl_loss_terms(teacher_as_student, teacher, lengths, loss_mask=mask)
    tail = -teacher.logsumexp(-1)
    torch.testing.assert_close(same, torch.where(valid, tail, 0.0), atol=1e-5, rtol=1e-4)


def test_gradient_is_student_minus_renormalised_teacher_on_the_vocabulary():
    """d D / d z = softmax(z) - p~_T (p~_T zero outside the teacher's top-k), with z the student's logits."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 1, 10, generator=gen, requires_grad=True)
    teacher_full = torch.randn(1, 1, 10, generator=gen).log_softmax(-1)
    teacher, ids = teacher_full.topk(4, dim=-1)
    student = logits.log_softmax(-1).gather(-1, ids)
    topk_forward_kl_loss_terms(student, teacher, t([1])).sum().backward()
    target = torch.zeros(10).scatter(0, ids[0, 0], (teacher - teacher.logsumexp(-1, keepdim=True)).exp()[0, 0])
    torch.testing.assert_close(logits.grad[0, 0], logits.softmax(-1)[0, 0].detach() - target, atol=1e-6, rtol=0)


def test_padding_gets_no_gradient_even_from_nan():
    student = t([[[-1.0, -2.0], [float("nan"), float("-inf")]]], requires_grad=True)
    teacher = t([[[-0.5, -1.0], [float("nan"), 0.0]]])
    topk_forward_kl_loss_terms(student, teacher, t([1])).sum().backward()
    assert torch.isfinite(student.grad).all() and (student.grad[0, 1] == 0).all()
