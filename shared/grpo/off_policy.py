"""Off-policy correction: how far rollouts drift from the learner, and the weights that correct it.

Rollouts are off-policy twice over: they may come from an earlier policy version (staleness, bounded by
``ref_server.max_staleness``), and the engine that sampled them computes different numbers than the learner for
the same weights (kernels, dtypes, batch shapes: the training-inference mismatch). Both show in one quantity, per
completion token:

.. math::  d_{i,t} = \\log\\pi_{old}(o_{i,t}) - \\log\\pi_{behaviour}(o_{i,t}), \\qquad r_{i,t} = e^{d_{i,t}}

where ``pi_old`` is the learner's own logprob of the sampled token under its current weights (the recomputed "old"
logprobs) and ``pi_behaviour`` the logprob the generator sampled it with. :func:`off_policy_weights` turns ``d`` into
per-token weights (multiplying the policy-gradient term) and a keep mask (tokens left out of the loss and of its
normaliser), by the mode named in ``algorithm.off_policy.mode``, one entry of :data:`OFF_POLICY_CORRECTIONS`:

=================  =================================================================================================
``none``           ``w = 1``, keep every token
``token_tis``      truncated IS (Yao et al. 2025): ``w = min(r, high)``, keep every token
``token_mask``     token rejection (ICEPOP): keep iff ``low <= r <= high``, ``w = 1`` where kept
``token_is_mask``  masked IS: keep iff ``low <= r <= high``, ``w = r`` where kept
``seq_tis``        ``s = exp(sum_t d)``; ``w = min(s, high)`` on every token of the row, keep every token
``seq_mask``       ``s`` as above; the whole row kept iff ``low <= s <= high``, ``w = 1`` where kept
``seq_geo_mask``   ``g = exp(mean_t d)``; the whole row kept iff ``low <= g <= high``, ``w = 1`` where kept
=================  =================================================================================================

:func:`mismatch_sums` measures the drift (the k3 estimate of KL(behaviour || learner), mean ``|d|``, the largest
ratio, what the correction masks, split by the rows' version lag), :func:`version_lag_sums` how old the tokens are
(per token when a continuous generator switched weights mid-completion); :func:`mismatch_metrics` turns the step's
summed numbers into the reported metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from shared.registry import Registry
from shared.tensors.masks import completion_mask

# (d [N, T] float64, 0 outside valid; valid [N, T] bool; low; high) -> (weights [N, T] float64, keep [N, T] bool),
# both meaningful on valid positions only (off_policy_weights zeroes the rest)
Correction = Callable[[torch.Tensor, torch.Tensor, float, float], tuple[torch.Tensor, torch.Tensor]]

OFF_POLICY_CORRECTIONS: Registry[Correction] = Registry("off-policy correction")
# the modes whose keep mask can drop tokens: with these, the loss's token and sequence counts come from the mask
MASKING_MODES: set[str] = set()


def _masking(fn: Correction) -> Correction:
    MASKING_MODES.add(fn.__name__.removeprefix("_"))
    return fn


@OFF_POLICY_CORRECTIONS.register("none")
def _none(d, valid, low, high):
    """w = 1, every token kept (no correction)."""
    return torch.ones_like(d), valid


@OFF_POLICY_CORRECTIONS.register("token_tis")
def _token_tis(d, valid, low, high):
    """Truncated IS: w = min(r, high), every token kept."""
    return torch.exp(d).clamp(max=high), valid


@OFF_POLICY_CORRECTIONS.register("token_mask")
@_masking
def _token_mask(d, valid, low, high):
    """Token rejection (ICEPOP): keep iff low <= r <= high, w = 1."""
    ratio = torch.exp(d)
    return torch.ones_like(d), (ratio >= low) & (ratio <= high)


@OFF_POLICY_CORRECTIONS.register("token_is_mask")
@_masking
def _token_is_mask(d, valid, low, high):
    """Masked IS: keep iff low <= r <= high, w = r."""
    ratio = torch.exp(d)
    return ratio, (ratio >= low) & (ratio <= high)


def _row_ratio(d: torch.Tensor, valid: torch.Tensor, *, mean: bool) -> torch.Tensor:
    """``[N, 1]``: ``exp(sum_t d)`` or ``exp(mean_t d)`` over each row's valid positions (``d`` is 0 elsewhere)."""
    total = d.sum(dim=1, keepdim=True)
    if mean:
        total = total / valid.sum(dim=1, keepdim=True).clamp(min=1)
    return torch.exp(total)


@OFF_POLICY_CORRECTIONS.register("seq_tis")
def _seq_tis(d, valid, low, high):
    """Sequence IS: w = min(exp(sum d), high) on every token of the row."""
    return _row_ratio(d, valid, mean=False).clamp(max=high).expand_as(d), valid


@OFF_POLICY_CORRECTIONS.register("seq_mask")
@_masking
def _seq_mask(d, valid, low, high):
    """Sequence rejection: the row kept iff low <= exp(sum d) <= high, w = 1."""
    ratio = _row_ratio(d, valid, mean=False)
    return torch.ones_like(d), ((ratio >= low) & (ratio <= high)).expand_as(valid)


@OFF_POLICY_CORRECTIONS.register("seq_geo_mask")
@_masking
def _seq_geo_mask(d, valid, low, high):
    """Geometric sequence masking: the row kept iff low <= exp(mean d) <= high, w = 1."""
    ratio = _row_ratio(d, valid, mean=True)
    return torch.ones_like(d), ((ratio >= low) & (ratio <= high)).expand_as(valid)


def off_policy_weights(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    lengths: torch.Tensor,
    *,
    mode: str,
    low: float,
    high: float,
    loss_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token correction of off-policy rollouts: ``(weights, keep)``, both ``[N, T]``.

    With ``d = old - behaviour`` and ``r = exp(d)`` over the valid positions of each row (``t < lengths[i]`` and,
    with ``loss_mask``, ``loss_mask[i, t] == 1``: a model token), ``mode`` picks (see the module's table):
    ``none`` (w 1), ``token_tis`` (w = min(r, high)), ``token_mask`` (keep low <= r <= high, w 1),
    ``token_is_mask`` (keep low <= r <= high, w r), ``seq_tis`` (w = min(exp(sum d), high) on the row),
    ``seq_mask`` (row kept iff low <= exp(sum d) <= high), ``seq_geo_mask`` (row kept iff
    low <= exp(mean d) <= high). Positions that are not valid get weight 0 and keep False; so does every position
    of a row with no valid position, and a position a mode drops (``keep`` False means weight 0).

    Worked example (``low`` 0.5, ``high`` 2): a row with d = [ln 3, ln 0.25, 0] gives ``token_tis`` w [2, 0.25, 1];
    ``token_mask`` keep [F, F, T]; ``token_is_mask`` w [0, 0, 1]; ``seq_tis`` (s = 0.75) w [0.75, 0.75, 0.75];
    ``seq_geo_mask`` (g = 0.75^(1/3) = 0.909) keeps the row.

    ``weights`` carry no gradient, in ``old_logprobs``' dtype; the arithmetic runs in float64, so a logprob gap of
    +-50 per token (or a sequence sum far beyond float32's exp range) still gives finite weights: a ratio that
    overflows to inf is above any ``high`` (truncated to it, or masked). Values at invalid positions are never read
    (they may be padding, -inf or NaN).
    """
    correction = OFF_POLICY_CORRECTIONS.get(mode)
    if old_logprobs.dim() != 2 or old_logprobs.shape != behaviour_logprobs.shape:
        raise ValueError(f"old and behaviour logprobs must both be [N, T], got {tuple(old_logprobs.shape)} and "
                         f"{tuple(behaviour_logprobs.shape)}")
    rows, width = old_logprobs.shape
    lengths = torch.as_tensor(lengths, device=old_logprobs.device)
    if lengths.shape != (rows,):
        raise ValueError(f"lengths must be [N] = [{rows}], got shape {tuple(lengths.shape)}")
    if loss_mask is not None and (loss_mask.dim() != 2 or loss_mask.shape[0] != rows or loss_mask.shape[1] < width):
        raise ValueError(f"loss_mask must be [N, >= T] = [{rows}, >= {width}], got shape {tuple(loss_mask.shape)}")
    if not 0 <= low <= high:
        raise ValueError(f"off-policy thresholds need 0 <= low <= high, got low {low}, high {high}")
    valid = completion_mask(lengths, width, loss_mask)
    gap = log_ratio(old_logprobs, behaviour_logprobs, valid)
    weights, keep = correction(gap, valid, float(low), float(high))
    keep = keep & valid
    return torch.where(keep, weights, torch.zeros_like(weights)).to(old_logprobs.dtype), keep


def log_ratio(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``d = old - behaviour`` in float64, without gradient, exactly 0 where ``valid`` is False (padding there may be
    -inf or NaN and is never read)."""
    zero = torch.zeros((), dtype=torch.float64, device=old_logprobs.device)
    return torch.where(valid, old_logprobs.detach().double() - behaviour_logprobs.detach().double(), zero)


# ---- measuring the drift ---------------------------------------------------------------------------------------

MISMATCH_SUM_PREFIX = "mismatch_sum/"   # step.py sums every key with this prefix over micro-batches and ranks
# ESS and chi-square read exp(gap) and exp(2 gap): the log ratios are clamped to +-this first, so that one absurd
# token (a gap of hundreds of nats) saturates the metrics instead of turning them into inf / NaN (verl's bound)
RATIO_LOG_BOUND = 20.0
MISMATCH_MAX_KEY = "mismatch_ratio_max"  # step.py takes the max of this one
TOKEN_SPREAD_MAX_KEY = "token_version_spread_max"  # and of this one


def mismatch_sums(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, valid: torch.Tensor,
                  keep: torch.Tensor, lags: torch.Tensor, lag_buckets: int) -> dict[str, torch.Tensor]:
    """The drift of one (micro-)batch as sums that add up over micro-batches and ranks (device tensors, no host
    read): over the valid tokens, ``sum(r - 1 - log r)`` (the k3 estimate of KL(behaviour || learner) with
    ``r = exp(old - behaviour)``: its samples come from the behaviour policy), ``sum |d|``, the token count, the
    tokens and rows the correction dropped (``valid & ~keep``; a row counts when it lost any token) and the rows
    with a valid token; the same three first sums per version lag (``lags`` ``[N]``: the learner's version minus
    the row's, clamped into ``0..lag_buckets-1``, so every rank reports the same keys); and the largest ratio under
    :data:`MISMATCH_MAX_KEY`; for the effective sample size and chi-square, ``sum r`` and ``sum r^2`` over the valid
    tokens and ``sum s`` and ``sum s^2`` over the rows with one (``s = exp(sum of d over the row)``), the log
    ratios clamped to +-:data:`RATIO_LOG_BOUND`. :func:`mismatch_metrics` turns the reduced sums into the metrics."""
    zero = torch.zeros((), dtype=torch.float64, device=old_logprobs.device)
    gap = log_ratio(old_logprobs, behaviour_logprobs, valid)
    ratio = torch.exp(gap)
    k3 = torch.where(valid, ratio - 1.0 - gap, zero)  # r - 1 - log r
    abs_gap = gap.abs()
    dropped = valid & ~keep
    has_valid = valid.any(dim=1)
    row_k3, row_abs, row_tokens = k3.sum(dim=1), abs_gap.sum(dim=1), valid.sum(dim=1).double()
    out = {
        "kl": row_k3.sum(), "abs_diff": row_abs.sum(), "tokens": row_tokens.sum(),
        "masked_tokens": dropped.sum().double(), "masked_rows": (dropped.any(dim=1) & has_valid).sum().double(),
        "rows": has_valid.sum().double(),
    }
    bounded = torch.where(valid, ratio.clamp(math.exp(-RATIO_LOG_BOUND), math.exp(RATIO_LOG_BOUND)), zero)
    row_ratio = torch.where(has_valid, torch.exp(gap.sum(dim=1).clamp(-RATIO_LOG_BOUND, RATIO_LOG_BOUND)), zero)
    out.update({"ratio": bounded.sum(), "ratio_sq": (bounded ** 2).sum(),
                "seq_ratio": row_ratio.sum(), "seq_ratio_sq": (row_ratio ** 2).sum()})
    bucket = lags.to(old_logprobs.device).long().clamp(0, lag_buckets - 1)
    for name, per_row in (("kl", row_k3), ("abs_diff", row_abs), ("tokens", row_tokens)):
        by_lag = torch.zeros(lag_buckets, dtype=torch.float64, device=old_logprobs.device)
        by_lag = by_lag.scatter_add(0, bucket, per_row)
        out.update({f"{name}/lag_{lag}": by_lag[lag] for lag in range(lag_buckets)})
    sums = {MISMATCH_SUM_PREFIX + key: value for key, value in out.items()}
    sums[MISMATCH_MAX_KEY] = torch.where(valid, ratio, zero).amax() if ratio.numel() else zero
    return sums


def version_lag_sums(valid: torch.Tensor, lags: torch.Tensor, token_lags: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """How old the tokens of one (micro-)batch are, as device tensors that add up over micro-batches and ranks: the
    sum over ``valid`` tokens of each token's version lag (``token_lags`` ``[N, T]``, the learner's version minus
    the version that sampled the token; None: every token has its row's lag, ``lags`` ``[N]``), and under
    :data:`TOKEN_SPREAD_MAX_KEY` the largest ``newest - oldest`` token version within a row (0 without
    ``token_lags``). :func:`mismatch_metrics` turns the sum into ``token_version_lag_mean``."""
    zero = torch.zeros((), dtype=torch.float64, device=valid.device)
    if token_lags is None:
        per_row = valid.sum(dim=1).double() * lags.to(valid.device).double()
        return {MISMATCH_SUM_PREFIX + "token_lag": per_row.sum(), TOKEN_SPREAD_MAX_KEY: zero}
    lag = token_lags.to(valid.device).double()
    oldest = torch.where(valid, lag, zero).amax(dim=1)             # lags are >= 0: the oldest token lags most
    newest = torch.where(valid, lag, math.inf).amin(dim=1)
    spread = torch.where(valid.any(dim=1), oldest - newest, zero)
    return {MISMATCH_SUM_PREFIX + "token_lag": torch.where(valid, lag, zero).sum(),
            TOKEN_SPREAD_MAX_KEY: spread.amax() if spread.numel() else zero}


def mismatch_metrics(sums: Mapping[str, float]) -> dict[str, float]:
    """The step's drift metrics from the reduced :func:`mismatch_sums`: ``mismatch_kl`` (mean k3 per token),
    ``mismatch_abs_logprob_diff`` (mean ``|old - behaviour|``), ``off_policy_masked_token_frac`` and
    ``off_policy_masked_row_frac``, and per version lag present in the batch ``mismatch_kl/lag_K``,
    ``mismatch_abs_logprob_diff/lag_K`` and ``mismatch_tokens/lag_K``; with :func:`version_lag_sums`
    ``token_version_lag_mean`` (mean version lag of the tokens). And how much an importance-sampling estimate at
    the learner's policy is worth, over the n valid tokens' ratios r (and, ``_seq``, the m rows' ``s``):

        mismatch_ess   = (sum r)^2 / (n * sum r^2)      in (0, 1]: 1 when every r is equal (on-policy: all 1)
        mismatch_chi2  = sum r^2 / n - 1                 the chi-square divergence estimate E_behaviour[r^2] - 1

    (``mismatch_ess_seq``, ``mismatch_chi2_seq`` the same over ``s``): an ESS of 0.5 means the batch's tokens are
    worth half as many on-policy ones to an unbiased correction; the chi-square bounds that correction's variance."""
    def total(key: str) -> float:
        return float(sums.get(MISMATCH_SUM_PREFIX + key, 0.0))

    tokens = total("tokens")
    if tokens <= 0:
        return {}
    metrics = {"mismatch_kl": total("kl") / tokens, "mismatch_abs_logprob_diff": total("abs_diff") / tokens,
               "off_policy_masked_token_frac": total("masked_tokens") / tokens,
               "off_policy_masked_row_frac": total("masked_rows") / max(total("rows"), 1.0)}
    metrics.update(_effective_sample_size("", total("ratio"), total("ratio_sq"), tokens))
    metrics.update(_effective_sample_size("_seq", total("seq_ratio"), total("seq_ratio_sq"), total("rows")))
    if MISMATCH_SUM_PREFIX + "token_lag" in sums:
        metrics["token_version_lag_mean"] = total("token_lag") / tokens
    lag = 0
    while MISMATCH_SUM_PREFIX + f"tokens/lag_{lag}" in sums:
        count = total(f"tokens/lag_{lag}")
        if count > 0:
            metrics[f"mismatch_kl/lag_{lag}"] = total(f"kl/lag_{lag}") / count
            metrics[f"mismatch_abs_logprob_diff/lag_{lag}"] = total(f"abs_diff/lag_{lag}") / count
            metrics[f"mismatch_tokens/lag_{lag}"] = count
        lag += 1
    return metrics


def _effective_sample_size(suffix: str, ratio_sum: float, ratio_sq_sum: float, count: float) -> dict[str, float]:
    """``mismatch_ess{suffix}`` and ``mismatch_chi2{suffix}`` of ``count`` ratios from their sum and sum of squares
    (none when nothing was summed: sums of an older learner, or no rows)."""
    if count <= 0 or ratio_sq_sum <= 0:
        return {}
    return {f"mismatch_ess{suffix}": ratio_sum ** 2 / (count * ratio_sq_sum),
            f"mismatch_chi2{suffix}": ratio_sq_sum / count - 1.0}
