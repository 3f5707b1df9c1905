"""The policy loss with per-token advantages ``[B, L]`` (process supervision, KL in the reward): rows that are
constant give exactly the ``[B]`` loss, for both policy losses and every aggregation; a varying row changes it
the way the formula says; a wrong shape is an error naming both shapes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.config.schema import LossConfig
from shared.grpo.losses import AGGREGATIONS, compute_policy_loss
from shared.grpo.off_policy import off_policy_weights
from shared.grpo.policy_losses import POLICY_LOSSES

CASES = [(p, a) for p in ("grpo", "gspo") for a in AGGREGATIONS.names()]


def cfg(policy_loss, aggregation, **kw):
    return LossConfig(**{"policy_loss": policy_loss, "aggregation": aggregation, "norm_len": 7, "beta": 0.0,
                         **kw})


@st.composite
def batches(draw):
    rows = draw(st.integers(1, 4))
    width = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(0, width), min_size=rows, max_size=rows))
    seed = draw(st.integers(0, 2**31 - 1))
    return rows, width, lengths, seed


@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from(CASES), st.booleans())
def test_constant_rows_equal_the_per_completion_path(batch, case, extras):
    """Padding columns of the [B, L] tensor hold garbage (they must not matter); with ``extras`` the loss also has
    truncated importance weights, a dual clip, a KL term and global normalisers."""
    rows, width, lengths, seed = batch
    gen = torch.Generator().manual_seed(seed)
    logprobs = (-torch.rand(rows, width, generator=gen) * 3).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(rows, width, generator=gen)
    behaviour = old + 0.2 * torch.randn(rows, width, generator=gen)
    ref = old - 0.5 * torch.rand(rows, width, generator=gen)
    per_row = torch.randn(rows, generator=gen)
    mask = torch.arange(width) < torch.tensor(lengths).unsqueeze(1)
    wide = torch.where(mask, per_row.unsqueeze(1).expand(rows, width), torch.randn(rows, width, generator=gen) * 50)
    extra = dict(dual_clip=3.0, beta=0.04) if extras else {}
    correction = off_policy_weights(old, behaviour, torch.tensor(lengths), mode="token_tis", low=0.5, high=2.0)
    kwargs = dict(old_logprobs=old, ref_logprobs=ref, correction=correction if extras else None,
                  num_tokens=11.0 if extras else None, num_seqs=3.0 if extras else None)
    config = cfg(*case, **extra)
    narrow_out = compute_policy_loss(logprobs, per_row, lengths, config, **kwargs)
    (narrow_grad,) = torch.autograd.grad(narrow_out.loss, logprobs)
    wide_out = compute_policy_loss(logprobs, wide, lengths, config, **kwargs)
    (wide_grad,) = torch.autograd.grad(wide_out.loss, logprobs)
    assert torch.equal(narrow_out.loss, wide_out.loss)
    assert torch.equal(narrow_grad, wide_grad)
    assert torch.equal(narrow_out.token_loss, wide_out.token_loss)
    for key, value in narrow_out.metrics.items():
        assert torch.equal(value, wide_out.metrics[key]), key


@pytest.mark.parametrize("policy_loss", POLICY_LOSSES.names())
def test_token_advantages_by_hand(policy_loss):
    """One completion, ratios 1 (old = current): the surrogate is -A_t per token, so token-mean of A = [1, -2, 4]
    is -1; the gradient on token t is -A_t / 3 for the token ratio, and the same for GSPO-token (s_i = 1)."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    out = compute_policy_loss(logprobs, torch.tensor([[1.0, -2.0, 4.0]]), [3],
                              cfg(policy_loss, "token-mean"))
    assert out.loss.item() == pytest.approx(-1.0)
    (grad,) = torch.autograd.grad(out.loss, logprobs)
    torch.testing.assert_close(grad, torch.tensor([[-1 / 3, 2 / 3, -4 / 3]]))


def test_wrong_advantage_shape_names_both_shapes():
    logprobs = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"advantages must be \[B\] = \[2\] or \[B, L\] = \[2, 3\].*\(2, 4\)"):
        compute_policy_loss(logprobs, torch.zeros(2, 4), [3, 3], cfg("grpo", "token-mean"))
    with pytest.raises(ValueError, match=r"got shape \(3,\)"):
        compute_policy_loss(logprobs, torch.zeros(3), [3, 3], cfg("grpo", "token-mean"))
