import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.config.schema import LossConfig
from shared.grpo.losses import AGGREGATIONS, compute_policy_loss, loss_normalizers
from shared.grpo.off_policy import off_policy_weights
from shared.grpo.policy_losses import POLICY_LOSSES, clipped_surrogate


def cfg(**kw):
    return LossConfig(**{"beta": 0.0, **kw})


def ratios_as_logprobs(ratios):
    return torch.tensor(ratios).log().unsqueeze(0), torch.zeros(1, len(ratios))


def test_issue_clipped_loss_value():
    logp, old = ratios_as_logprobs([0.5, 1.0, 1.5])
    out = compute_policy_loss(logp, torch.tensor([[1.0, -1.0, 2.0]]), torch.tensor([3]), cfg(), old_logprobs=old)
    assert out.loss.item() == pytest.approx(-0.6333, abs=1e-4)
    torch.testing.assert_close(out.token_loss, torch.tensor([[-0.5, 1.0, -2.4]]))
    # the 1.5 ratio with A=2 sits above 1 + 0.2: one of three tokens is high-clipped; the 0.5 one has A>0 -> not
    assert out.metrics["clip_frac_high"].item() == pytest.approx(1 / 3)
    assert out.metrics["clip_frac_low"].item() == 0.0
    assert out.metrics["ratio_mean"].item() == pytest.approx(1.0)


def test_issue_dual_clip_values():
    terms = clipped_surrogate(torch.tensor([0.5, 1.0, 10.0]), torch.tensor([1.0, -1.0, -4.0]),
                              eps_low=0.2, eps_high=0.2, dual_clip=3.0)
    torch.testing.assert_close(terms.loss, torch.tensor([-0.5, 1.0, 12.0]))
    assert terms.dual_clipped.tolist() == [False, False, True]
    logp, old = ratios_as_logprobs([0.5, 1.0, 10.0])
    out = compute_policy_loss(logp, torch.tensor([1.0, -1.0, -4.0]).unsqueeze(0), torch.tensor([3]),
                              cfg(dual_clip=3.0), old_logprobs=old)
    torch.testing.assert_close(out.token_loss, torch.tensor([[-0.5, 1.0, 12.0]]))
    assert out.metrics["dual_clip_frac"].item() == pytest.approx(1 / 3)


def test_clip_higher_uses_separate_bounds():
    terms = clipped_surrogate(torch.tensor([1.25, 0.75]), torch.tensor([1.0, -1.0]), eps_low=0.2, eps_high=0.28)
    # 1.25 < 1.28 is not clipped above; 0.75 < 0.8 with A<0 is clipped below: loss = 0.8
    torch.testing.assert_close(terms.loss, torch.tensor([-1.25, 0.8]))
    assert terms.clipped_high.tolist() == [False, False] and terms.clipped_low.tolist() == [False, True]


def test_dual_clip_must_exceed_one():
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        clipped_surrogate(torch.ones(1), torch.ones(1), eps_low=0.2, eps_high=0.2, dual_clip=1.0)


def test_on_policy_ratio_is_one_and_gradient_is_policy_gradient():
    """old = None: ratio = exp(logp - logp.detach()) = 1, d loss / d logp_t = -A_t / N (simple_GRPO with pi_old = pi_theta)."""
    logp = torch.tensor([[-0.3, -2.0, -1.1], [-0.7, -0.2, -5.0]], requires_grad=True)
    adv = torch.tensor([0.5, -2.0])
    out = compute_policy_loss(logp, adv, torch.tensor([3, 2]), cfg())
    assert out.metrics["ratio_mean"].item() == 1.0
    out.loss.backward()
    expected = torch.tensor([[-0.5, -0.5, -0.5], [2.0, 2.0, 0.0]]) / 5
    torch.testing.assert_close(logp.grad, expected)
    # value: -sum(A) over tokens / N = -(3*0.5 - 2*2) / 5
    assert out.loss.item() == pytest.approx(-(1.5 - 4.0) / 5)


def test_gspo_uses_one_ratio_per_sequence():
    logp = torch.tensor([[-1.0, -2.0, -3.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -1.5, -3.0, 7.0]])  # last position is padding (length 3)
    adv = torch.tensor([1.0])
    out = compute_policy_loss(logp, adv, torch.tensor([3]), cfg(policy_loss="gspo", eps_high=10.0),
                              old_logprobs=old)
    seq_ratio = math.exp((0.5 - 0.5 + 0.0) / 3)
    assert out.metrics["ratio_min"].item() == pytest.approx(seq_ratio)
    assert out.metrics["ratio_max"].item() == pytest.approx(seq_ratio)
    out.loss.backward()
    # d/dlogp_t of -(1/3) sum_t s * A with s's token form: -s * A / 3 on each valid token
    torch.testing.assert_close(logp.grad, torch.tensor([[-1 / 3, -1 / 3, -1 / 3, 0.0]]) * seq_ratio)


def test_gspo_clips_whole_sequence():
    logp = torch.tensor([[0.0, 0.0]])
    old = torch.tensor([[-1.0, -1.0]])  # sequence ratio e = 2.718 > 1.2 with A > 0: every token clipped
    out = compute_policy_loss(logp, torch.tensor([1.0]), torch.tensor([2]), cfg(policy_loss="gspo"),
                              old_logprobs=old)
    assert out.metrics["clip_frac_high"].item() == 1.0
    assert out.loss.item() == pytest.approx(-1.2)


def test_truncated_importance_weights():
    logp = torch.zeros(1, 3, requires_grad=True)
    behaviour = torch.tensor([[0.0, -1.0, 1.0]])  # w = exp(old - behaviour) = [1, e, 1/e], capped at 2
    lengths = torch.tensor([3])
    correction = off_policy_weights(logp.detach(), behaviour, lengths, mode="token_tis", low=0.5, high=2.0)
    out = compute_policy_loss(logp, torch.tensor([1.0]), lengths, cfg(), correction=correction)
    weights = torch.tensor([1.0, 2.0, math.exp(-1)])
    assert out.loss.item() == pytest.approx(-(weights.sum() / 3).item())
    assert out.metrics["is_weight_max"].item() == pytest.approx(2.0)
    assert out.metrics["is_weight_min"].item() == pytest.approx(math.exp(-1))
    off = compute_policy_loss(logp, torch.tensor([1.0]), lengths, cfg())
    assert off.loss.item() == pytest.approx(-1.0) and off.metrics["is_weight_max"].item() == 1.0
    # token_mask drops the two tokens outside [0.5, 2]: they leave the sum and the (local) normaliser
    masked = off_policy_weights(logp.detach(), behaviour, lengths, mode="token_mask", low=0.5, high=2.0)
    out = compute_policy_loss(logp, torch.tensor([1.0]), lengths, cfg(), correction=masked)
    assert out.loss.item() == pytest.approx(-1.0) and out.metrics["num_tokens"].item() == 1


def test_kl_term_added_with_beta():
    logp = torch.tensor([[-1.0, -1.0, -1.0]])
    ref = torch.tensor([[0.0, -15.0, -30.0]])
    out = compute_policy_loss(logp, torch.tensor([0.0]), torch.tensor([3]), cfg(beta=0.1, kl_estimator="k2"),
                              ref_logprobs=ref)
    assert out.loss.item() == pytest.approx(0.1 * (0.5 + 98 + 420.5) / 3)
    assert out.metrics["kl_mean"].item() == pytest.approx((0.5 + 98 + 420.5) / 3)
    with pytest.raises(ValueError, match="beta > 0 needs ref_logprobs"):
        compute_policy_loss(logp, torch.tensor([0.0]), torch.tensor([3]), cfg(beta=0.1))


def test_aggregations_hand_computed():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    none = dict(num_tokens=None, num_seqs=None, norm_len=None)
    assert AGGREGATIONS.get("token-mean")(values, mask, **none).item() == pytest.approx(10 / 4)
    assert AGGREGATIONS.get("seq-mean-token-mean")(values, mask, **none).item() == pytest.approx((2 + 4) / 2)
    drgrpo = AGGREGATIONS.get("seq-mean-token-sum-norm")(values, mask, **{**none, "norm_len": 8})
    assert drgrpo.item() == pytest.approx((6 / 8 + 4 / 8) / 2)
    with pytest.raises(ValueError, match="norm_len"):
        AGGREGATIONS.get("seq-mean-token-sum-norm")(values, mask, **none)


def test_zero_length_and_garbage_padding_never_nan():
    nan, inf = float("nan"), float("inf")
    logp = torch.tensor([[-1.0, nan, -inf], [nan, nan, nan]], requires_grad=True)
    old = torch.tensor([[-1.0, inf, nan], [-inf, nan, 5.0]])
    ref = torch.tensor([[-2.0, nan, inf], [nan, -inf, nan]])
    lengths = torch.tensor([1, 0])
    for aggregation in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        out = compute_policy_loss(logp, torch.tensor([1.0, nan]), lengths,
                                  cfg(aggregation=aggregation, norm_len=3, beta=0.5),
                                  old_logprobs=old, ref_logprobs=ref,
                                  correction=off_policy_weights(old, old, lengths, mode="token_tis", low=0.5,
                                                                high=2.0))
        logp.grad = None
        out.loss.backward()
        assert torch.isfinite(out.loss) and torch.isfinite(logp.grad).all()
        assert logp.grad[1].abs().sum() == 0 and logp.grad[0, 1:].abs().sum() == 0
        assert all(torch.isfinite(v).all() for v in out.metrics.values())
    empty = compute_policy_loss(torch.zeros(2, 0, requires_grad=True), torch.ones(2), torch.tensor([0, 0]), cfg())
    assert empty.loss.item() == 0.0 and empty.metrics["is_weight_max"].item() == 0.0


def test_registries_list_variants():
    assert {"grpo", "gspo"} <= set(POLICY_LOSSES.names())
    assert set(AGGREGATIONS.names()) == {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"}


def _split_losses(logp, old, adv, lengths, config, pieces):
    """Loss and grads computed over ``pieces`` of the batch with the global normalisers, summed."""
    num_tokens, num_seqs = loss_normalizers(lengths)
    total = torch.zeros(())
    logp = logp.detach().clone().requires_grad_(True)
    for idx in pieces:
        out = compute_policy_loss(logp[idx], adv[idx], lengths[idx], config, old_logprobs=old[idx],
                                  num_tokens=num_tokens, num_seqs=num_seqs)
        out.loss.backward()
        total = total + out.loss.detach()
    return total, logp.grad


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 6), min_size=2, max_size=8),
    split=st.integers(1, 7),
    aggregation=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]),
    policy_loss=st.sampled_from(["grpo", "gspo"]),
    seed=st.integers(0, 2**16),
)
def test_loss_invariant_to_how_the_batch_is_split(lengths, split, aggregation, policy_loss, seed):
    """Splitting a global batch over ranks / accumulation steps and summing the pieces' losses (each normalised
    by the global counts) gives the loss and gradient of the whole batch."""
    gen = torch.Generator().manual_seed(seed)
    batch, width = len(lengths), 6
    lengths = torch.tensor(lengths)
    logp = -torch.rand(batch, width, generator=gen) * 3
    old = logp + 0.3 * torch.randn(batch, width, generator=gen)
    adv = torch.randn(batch, generator=gen)
    config = cfg(aggregation=aggregation, norm_len=width, policy_loss=policy_loss)
    whole, whole_grad = _split_losses(logp, old, adv, lengths, config, [slice(0, batch)])
    split = min(split, batch - 1)
    parts, parts_grad = _split_losses(logp, old, adv, lengths, config, [slice(0, split), slice(split, batch)])
    torch.testing.assert_close(parts, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(parts_grad, whole_grad, atol=1e-6, rtol=1e-5)
    singles, singles_grad = _split_losses(logp, old, adv, lengths, config, [slice(i, i + 1) for i in range(batch)])
    torch.testing.assert_close(singles, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(singles_grad, whole_grad, atol=1e-6, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, 5), min_size=1, max_size=6), extra_width=st.integers(0, 3))
def test_padding_width_and_pad_values_do_not_matter(lengths, extra_width):
    """Masks come from lengths: widening the tensors or changing what sits in the padding changes nothing."""
    gen = torch.Generator().manual_seed(len(lengths) * 31 + extra_width)
    lengths_t = torch.tensor(lengths)
    width = max(lengths)
    logp = -torch.rand(len(lengths), width, generator=gen)
    adv = torch.randn(len(lengths), generator=gen)
    base = compute_policy_loss(logp, adv, lengths_t, cfg()).loss
    wide = torch.cat([logp, torch.full((len(lengths), extra_width), -123.0)], dim=1)
    mask = torch.arange(wide.shape[1]) < lengths_t.unsqueeze(1)
    wide = torch.where(mask, wide, torch.full_like(wide, 7.0))
    torch.testing.assert_close(compute_policy_loss(wide, adv, lengths_t, cfg()).loss, base)
