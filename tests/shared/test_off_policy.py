"""shared/grpo/off_policy.py: every correction mode by hand, against a plain-Python reference on random inputs, and
the drift metrics against a hand computation."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.config.schema import LossConfig
from shared.grpo.losses import compute_policy_loss
from shared.grpo.off_policy import (
    MASKING_MODES,
    OFF_POLICY_CORRECTIONS,
    mismatch_metrics,
    mismatch_sums,
    off_policy_weights,
)
from shared.tensors.masks import completion_mask

LN = math.log
# row 0: d = [ln 3, ln 0.25, 0] (all valid); row 1: d = [ln 9, 0, junk] (length 2); row 2: empty;
# row 3: d = [ln 1.5, ln 100 (an environment token), ln 1.5] (loss mask 1 0 1)
OLD = torch.tensor([[LN(3), LN(0.25), 0.0], [LN(9), 0.0, 123.0], [5.0, 5.0, 5.0], [LN(1.5), LN(100), LN(1.5)]])
BEHAVIOUR = torch.zeros(4, 3)
LENGTHS = torch.tensor([3, 2, 0, 3])
LOSS_MASK = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 0, 1]])
G = 0.75 ** (1 / 3)  # row 0's geometric mean ratio

HAND = {  # mode -> (weights, keep) for low 0.5, high 2
    "none": ([[1, 1, 1], [1, 1, 0], [0, 0, 0], [1, 0, 1]], [[1, 1, 1], [1, 1, 0], [0, 0, 0], [1, 0, 1]]),
    "token_tis": ([[2, 0.25, 1], [2, 1, 0], [0, 0, 0], [1.5, 0, 1.5]], [[1, 1, 1], [1, 1, 0], [0, 0, 0], [1, 0, 1]]),
    "token_mask": ([[0, 0, 1], [0, 1, 0], [0, 0, 0], [1, 0, 1]], [[0, 0, 1], [0, 1, 0], [0, 0, 0], [1, 0, 1]]),
    "token_is_mask": ([[0, 0, 1], [0, 1, 0], [0, 0, 0], [1.5, 0, 1.5]], [[0, 0, 1], [0, 1, 0], [0, 0, 0], [1, 0, 1]]),
    # row 3's sequence ratio is 1.5 * 1.5 = 2.25 (the environment token is not counted)
    "seq_tis": ([[0.75] * 3, [2, 2, 0], [0, 0, 0], [2, 0, 2]], [[1, 1, 1], [1, 1, 0], [0, 0, 0], [1, 0, 1]]),
    "seq_mask": ([[1, 1, 1], [0, 0, 0], [0, 0, 0], [0, 0, 0]], [[1, 1, 1], [0, 0, 0], [0, 0, 0], [0, 0, 0]]),
    # geometric: row 0 0.909, row 1 3 (dropped), row 3 1.5 (kept)
    "seq_geo_mask": ([[1, 1, 1], [0, 0, 0], [0, 0, 0], [1, 0, 1]], [[1, 1, 1], [0, 0, 0], [0, 0, 0], [1, 0, 1]]),
}


def test_every_registered_mode_has_a_worked_example():
    assert set(HAND) == set(OFF_POLICY_CORRECTIONS.names())
    assert MASKING_MODES == {"token_mask", "token_is_mask", "seq_mask", "seq_geo_mask"}


@pytest.mark.parametrize("mode", sorted(HAND))
def test_worked_example_by_hand(mode):
    weights, keep = off_policy_weights(OLD, BEHAVIOUR, LENGTHS, mode=mode, low=0.5, high=2.0, loss_mask=LOSS_MASK)
    expected_w, expected_keep = HAND[mode]
    torch.testing.assert_close(weights, torch.tensor(expected_w, dtype=torch.float32), rtol=1e-6, atol=1e-6)
    assert torch.equal(keep, torch.tensor(expected_keep, dtype=torch.bool))
    assert weights.dtype == OLD.dtype and not weights.requires_grad


def test_row_ratio_exactly_at_the_bounds_is_kept_and_geo_mean_uses_valid_tokens_only():
    old = torch.tensor([[0.0, 0.0, 9.0]])  # r = 1 exactly: kept by the closed interval [1, 1]
    for mode in ("token_mask", "token_is_mask", "seq_mask", "seq_geo_mask"):
        _, keep = off_policy_weights(old, torch.zeros(1, 3), torch.tensor([2]), mode=mode, low=1.0, high=1.0)
        assert keep.tolist() == [[True, True, False]], mode
    _, keep = off_policy_weights(torch.tensor([[LN(4.0), 0.0, 50.0]]), torch.zeros(1, 3), torch.tensor([2]),
                                 mode="seq_geo_mask", low=0.5, high=2.01)
    assert keep.tolist() == [[True, True, False]]  # g = sqrt(4) = 2: the padded 50 is not in the mean


def test_no_gradient_and_garbage_padding_is_never_read():
    old = torch.tensor([[-1.0, float("nan"), float("inf")]], requires_grad=True)
    behaviour = torch.tensor([[-1.2, float("-inf"), float("nan")]])
    for mode in HAND:
        weights, keep = off_policy_weights(old, behaviour, torch.tensor([1]), mode=mode, low=0.5, high=2.0)
        assert torch.isfinite(weights).all() and not weights.requires_grad
        assert keep[0, 1:].tolist() == [False, False] and weights[0, 1:].tolist() == [0.0, 0.0]


def test_bad_arguments_are_clear_errors():
    with pytest.raises(KeyError, match="unknown off-policy correction 'tis'; known: none, seq_geo_mask"):
        off_policy_weights(OLD, BEHAVIOUR, LENGTHS, mode="tis", low=0.5, high=2.0)
    with pytest.raises(ValueError, match="low <= high"):
        off_policy_weights(OLD, BEHAVIOUR, LENGTHS, mode="token_mask", low=3.0, high=2.0)
    with pytest.raises(ValueError, match=r"lengths must be \[N\]"):
        off_policy_weights(OLD, BEHAVIOUR, LENGTHS[:2], mode="none", low=0.5, high=2.0)
    with pytest.raises(ValueError, match="both be"):
        off_policy_weights(OLD, BEHAVIOUR[:, :2], LENGTHS, mode="none", low=0.5, high=2.0)


# ---- against a plain-Python reference, on random inputs ---------------------------------------------------------

def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def reference(old, behaviour, lengths, mode, low, high, loss_mask):
    """The issue's definitions, one row and one position at a time, in Python floats."""
    rows, width = len(old), len(old[0]) if old else 0
    weights = [[0.0] * width for _ in range(rows)]
    keep = [[False] * width for _ in range(rows)]
    for i in range(rows):
        valid = [t for t in range(width) if t < lengths[i] and (loss_mask is None or loss_mask[i][t] == 1)]
        if not valid:
            continue
        d = {t: old[i][t] - behaviour[i][t] for t in valid}
        s, g = _exp(sum(d.values())), _exp(sum(d.values()) / len(valid))
        for t in valid:
            r = _exp(d[t])
            w, k = {
                "none": (1.0, True), "token_tis": (min(r, high), True),
                "token_mask": (1.0, low <= r <= high), "token_is_mask": (r, low <= r <= high),
                "seq_tis": (min(s, high), True), "seq_mask": (1.0, low <= s <= high),
                "seq_geo_mask": (1.0, low <= g <= high),
            }[mode]
            keep[i][t] = k
            weights[i][t] = w if k else 0.0
    return weights, keep


@st.composite
def cases(draw):
    rows, width = draw(st.integers(1, 5)), draw(st.integers(1, 7))
    gap = st.floats(-50, 50, allow_nan=False, width=32)
    old = [[draw(gap) for _ in range(width)] for _ in range(rows)]
    behaviour = [[draw(gap) for _ in range(width)] for _ in range(rows)]
    lengths = [draw(st.integers(0, width)) for _ in range(rows)]
    loss_mask = draw(st.none() | st.just([[draw(st.sampled_from([0, 1])) for _ in range(width)] for _ in range(rows)]))
    low = draw(st.floats(0.0, 1.0))
    high = draw(st.floats(max(low, 1e-3), 10.0))
    return old, behaviour, lengths, loss_mask, low, high


@settings(max_examples=150, deadline=None)
@given(case=cases(), mode=st.sampled_from(sorted(HAND)))
def test_matches_the_reference_and_stays_finite_on_random_inputs(case, mode):
    old, behaviour, lengths, loss_mask, low, high = case
    mask_t = None if loss_mask is None else torch.tensor(loss_mask)
    weights, keep = off_policy_weights(torch.tensor(old), torch.tensor(behaviour), torch.tensor(lengths), mode=mode,
                                       low=low, high=high, loss_mask=mask_t)
    # the reference in float64 from the float32 values the function sees
    old64 = torch.tensor(old, dtype=torch.float32).double().tolist()
    behaviour64 = torch.tensor(behaviour, dtype=torch.float32).double().tolist()
    expected_w, expected_keep = reference(old64, behaviour64, lengths, mode, low, high, loss_mask)
    assert torch.isfinite(weights).all()
    valid = completion_mask(torch.tensor(lengths), len(old[0]), mask_t)
    assert not (keep & ~valid).any() and (weights[~valid] == 0).all() and (weights[~keep] == 0).all()
    expected = torch.tensor(expected_w, dtype=torch.float64)
    torch.testing.assert_close(weights.double(), expected, rtol=1e-6, atol=1e-30)
    # a ratio within float rounding of a bound may land on either side; anywhere else the masks agree
    assert torch.equal(keep, torch.tensor(expected_keep, dtype=torch.bool)) or _near_a_bound(
        old64, behaviour64, lengths, loss_mask, low, high)


def _near_a_bound(old, behaviour, lengths, loss_mask, low, high) -> bool:
    for i in range(len(old)):
        valid = [t for t in range(len(old[0])) if t < lengths[i] and (loss_mask is None or loss_mask[i][t] == 1)]
        d = [old[i][t] - behaviour[i][t] for t in valid]
        values = [*d, sum(d), sum(d) / max(len(d), 1)]
        if any(abs(v - math.log(b)) < 1e-9 for v in values for b in (low, high) if b > 0):
            return True
    return False


@settings(max_examples=60, deadline=None)
@given(case=cases())
def test_none_is_bitwise_the_loss_without_a_correction(case):
    old, behaviour, lengths, loss_mask, _, _ = case
    gen = torch.Generator().manual_seed(len(lengths))
    logprobs = (torch.tensor(old) / 50 - 1).requires_grad_()
    advantages = torch.randn(len(lengths), generator=gen)
    mask_t = None if loss_mask is None else torch.tensor(loss_mask, dtype=torch.bool)
    cfg = LossConfig(beta=0.0)
    kwargs = dict(old_logprobs=torch.tensor(behaviour) / 50 - 1, token_mask=mask_t)
    plain = compute_policy_loss(logprobs, advantages, torch.tensor(lengths), cfg, **kwargs)
    correction = off_policy_weights(logprobs.detach(), torch.tensor(behaviour), torch.tensor(lengths), mode="none",
                                    low=0.5, high=2.0, loss_mask=mask_t)
    none = compute_policy_loss(logprobs, advantages, torch.tensor(lengths), cfg, correction=correction, **kwargs)
    assert torch.equal(plain.loss, none.loss) and torch.equal(plain.token_loss, none.token_loss)
    (g_plain,) = torch.autograd.grad(plain.loss, logprobs)
    (g_none,) = torch.autograd.grad(none.loss, logprobs)
    assert torch.equal(g_plain, g_none)


def test_a_masked_token_leaves_the_loss_and_its_normaliser():
    logprobs = torch.zeros(1, 4, requires_grad=True)
    behaviour = torch.tensor([[0.0, -3.0, 0.0, 0.0]])  # token 1: r = e^3, outside [0.5, 2]
    lengths = torch.tensor([4])
    correction = off_policy_weights(logprobs.detach(), behaviour, lengths, mode="token_mask", low=0.5, high=2.0)
    out = compute_policy_loss(logprobs, torch.tensor([[1.0, 7.0, 1.0, 1.0]]), lengths, LossConfig(beta=0.0),
                              correction=correction)
    assert out.loss.item() == pytest.approx(-1.0)  # (-1 -1 -1) / 3 tokens: the 7 is gone, and so is its count
    (grad,) = torch.autograd.grad(out.loss, logprobs)
    assert grad[0, 1].item() == 0.0 and grad[0, 0].item() == pytest.approx(-1 / 3)


# ---- the drift metrics --------------------------------------------------------------------------------------------

def test_mismatch_metrics_by_hand():
    # row 0 (lag 0): d = [ln 2, 0]; row 1 (lag 2): d = [ln 0.5] and one padded position
    old = torch.tensor([[LN(2.0), -1.0], [LN(0.5), 7.0]])
    behaviour = torch.tensor([[0.0, -1.0], [0.0, 0.0]])
    lengths = torch.tensor([2, 1])
    valid = completion_mask(lengths, 2, None)
    _, keep = off_policy_weights(old, behaviour, lengths, mode="token_mask", low=0.6, high=2.5)
    sums = mismatch_sums(old, behaviour, valid, keep, torch.tensor([0, 2]), lag_buckets=3)
    metrics = mismatch_metrics({k: float(v) for k, v in sums.items()})
    k3 = [2 - 1 - LN(2), 0.0, 0.5 - 1 - LN(0.5)]  # r - 1 - log r per valid token
    assert metrics["mismatch_kl"] == pytest.approx(sum(k3) / 3)
    assert metrics["mismatch_abs_logprob_diff"] == pytest.approx(2 * LN(2) / 3)
    assert float(sums["mismatch_ratio_max"]) == pytest.approx(2.0)
    assert metrics["off_policy_masked_token_frac"] == pytest.approx(1 / 3)  # r = 0.5 < low 0.6
    assert metrics["off_policy_masked_row_frac"] == pytest.approx(1 / 2)
    assert metrics["mismatch_kl/lag_0"] == pytest.approx((k3[0] + k3[1]) / 2)
    assert metrics["mismatch_kl/lag_2"] == pytest.approx(k3[2])
    assert metrics["mismatch_tokens/lag_2"] == 1 and "mismatch_kl/lag_1" not in metrics
    # token ratios r = 2, 1, 0.5: sum 3.5, squares 5.25; rows s = exp(ln 2 + 0) = 2 and 0.5: sum 2.5, squares 4.25
    assert metrics["mismatch_ess"] == pytest.approx(3.5**2 / (3 * 5.25))
    assert metrics["mismatch_chi2"] == pytest.approx(5.25 / 3 - 1)
    assert metrics["mismatch_ess_seq"] == pytest.approx(2.5**2 / (2 * 4.25))
    assert metrics["mismatch_chi2_seq"] == pytest.approx(4.25 / 2 - 1)
    assert mismatch_metrics({}) == {}


@settings(max_examples=60, deadline=None)
@given(case=cases(), split=st.integers(0, 6), scale=st.sampled_from([1.0, 1e2, 1e4]))
def test_ess_and_chi2_are_bounded_finite_and_add_up_over_micro_batches(case, split, scale):
    """Any gaps (up to 1e4 nats: the clamp): ESS in (0, 1] and chi-square >= -1, both finite; on-policy (old equal
    to behaviour) exactly 1 and 0; and the sums of two micro-batches give the metrics of the whole batch."""
    old, behaviour, lengths, loss_mask, _, _ = case
    old_t, behaviour_t = torch.tensor(old) * scale / 50, torch.tensor(behaviour) * scale / 50
    lengths_t = torch.tensor(lengths)
    mask_t = None if loss_mask is None else torch.tensor(loss_mask, dtype=torch.bool)
    valid = completion_mask(lengths_t, old_t.shape[1], mask_t)
    lags = torch.zeros(len(lengths), dtype=torch.long)

    def metrics_of(rows):
        sums = [mismatch_sums(old_t[r], behaviour_t[r], valid[r], valid[r], lags[r], lag_buckets=1) for r in rows]
        return mismatch_metrics({k: float(sum(s[k] for s in sums)) for k in sums[0]})

    whole = metrics_of([slice(None)])
    if not valid.any():
        assert whole == {}
        return
    cut = min(split, len(lengths))
    parts = metrics_of([slice(0, cut), slice(cut, None)])
    for name in ("mismatch_ess", "mismatch_chi2", "mismatch_ess_seq", "mismatch_chi2_seq"):
        assert math.isfinite(whole[name]) and whole[name] == pytest.approx(parts[name], rel=1e-9), name
    assert 0 < whole["mismatch_ess"] <= 1 + 1e-12 and 0 < whole["mismatch_ess_seq"] <= 1 + 1e-12
    assert whole["mismatch_chi2"] >= -1 and whole["mismatch_chi2_seq"] >= -1   # E[r^2] >= 0
    same = mismatch_metrics({k: float(v) for k, v in mismatch_sums(old_t, old_t, valid, valid, lags, 1).items()})
    assert same["mismatch_ess"] == 1.0 and same["mismatch_chi2"] == 0.0 and same["mismatch_ess_seq"] == 1.0


@settings(max_examples=40, deadline=None)
@given(case=cases(), mode=st.sampled_from(["token_mask", "seq_mask", "seq_geo_mask"]),
       policy_loss=st.sampled_from(["grpo", "gspo"]),
       aggregation=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]))
def test_masked_tokens_leave_every_loss_as_the_loss_mask_does(case, mode, policy_loss, aggregation):
    """A correction that only masks (weights 1 where kept) gives every policy loss and aggregation exactly the loss of
    the same batch with the dropped tokens marked as environment tokens (loss mask 0), gradients included."""
    old, behaviour, lengths, loss_mask, low, high = case
    logprobs = (torch.tensor(old) / 50 - 1).requires_grad_()
    lengths_t = torch.tensor(lengths)
    mask_t = None if loss_mask is None else torch.tensor(loss_mask, dtype=torch.bool)
    weights, keep = off_policy_weights(logprobs.detach(), torch.tensor(behaviour) / 50 - 1, lengths_t, mode=mode,
                                       low=low, high=high, loss_mask=mask_t)
    advantages = torch.linspace(-1, 1, len(lengths))
    cfg = LossConfig(beta=0.0, policy_loss=policy_loss, aggregation=aggregation, norm_len=len(old[0]))
    old_t = torch.tensor(behaviour) / 60 - 1
    corrected = compute_policy_loss(logprobs, advantages, lengths_t, cfg, old_logprobs=old_t,
                                    correction=(weights, keep), token_mask=mask_t)
    as_mask = compute_policy_loss(logprobs, advantages, lengths_t, cfg, old_logprobs=old_t, token_mask=keep)
    torch.testing.assert_close(corrected.loss, as_mask.loss, rtol=0, atol=0)
    (g1,) = torch.autograd.grad(corrected.loss, logprobs)
    (g2,) = torch.autograd.grad(as_mask.loss, logprobs)
    torch.testing.assert_close(g1, g2, rtol=0, atol=0)
    assert (g1[~keep] == 0).all()
