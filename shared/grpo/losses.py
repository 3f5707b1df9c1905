"""The GRPO policy loss: clipped surrogate (token or sequence ratio), dual clip, the off-policy correction's weights
and keep mask (:mod:`shared.grpo.off_policy`), beta * KL, and the aggregation over tokens.

Per-token tensors are ``[B, L]`` over completion tokens, left-aligned; validity comes from
``completion_lengths`` (see :mod:`shared.tensors.masks`). Everything a config can choose is a registry entry:

* :data:`shared.grpo.policy_losses.POLICY_LOSSES`: the per-token surrogate (``"grpo"``, ``"gspo"``, ``"cispo"``,
  ``"sapo"``);
* :data:`AGGREGATIONS`: ``"token-mean"`` (DAPO), ``"seq-mean-token-mean"`` (original GRPO),
  ``"seq-mean-token-sum-norm"`` (Dr. GRPO);
* the KL estimator, from :data:`shared.grpo.kl.KL_ESTIMATORS`.

The full objective, per valid token t of completion i (minimised):

.. math::
    \\ell_{i,t} = w_{i,t}\\,\\max\\big(-\\rho_{i,t} A_{i,t},\\; -\\mathrm{clip}(\\rho_{i,t}, 1-\\epsilon_{low},
    1+\\epsilon_{high}) A_{i,t}\\big) + \\beta\\,\\mathrm{KL}_{i,t}

then aggregated over the kept tokens. ``rho`` is ``pi_theta / pi_old``; ``w`` the off-policy correction's weight
(1 without one); a token the correction drops leaves the sum and the normaliser, as a loss-masked token does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch

from shared.config.schema import LossConfig
from shared.grpo.kl import kl_penalty
from shared.grpo.policy_losses import POLICY_LOSSES, SurrogateTerms
from shared.registry import Registry
from shared.tensors.masks import (
    completion_mask,
    lengths_to_mask,
    masked_mean,
    masked_min_max,
    masked_sum,
    model_token_mask,
)
from shared.tensors.transfers import to_device

AGGREGATIONS: Registry = Registry("loss aggregation")

def _at_least_one(count: float | torch.Tensor, like: torch.Tensor) -> float | torch.Tensor:
    """``max(count, 1)``: a host number stays one; a tensor (a count on the device, e.g. all-reduced over ranks)
    is clamped there, in ``like``'s dtype, instead of being read back (which would wait for the device)."""
    if isinstance(count, torch.Tensor):
        return count.to(dtype=like.dtype, device=like.device).clamp(min=1.0)
    return max(float(count), 1.0)


@AGGREGATIONS.register("token-mean")
def token_mean(
    values: torch.Tensor, mask: torch.Tensor, *, num_tokens: float | torch.Tensor | None,
    num_seqs: float | torch.Tensor | None,
    norm_len: int | None,
) -> torch.Tensor:
    """DAPO: ``sum_{i,t} l_{i,t} / N_tokens``, where ``N_tokens`` is the GLOBAL count of valid tokens.

    Passing the global count (all ranks, all accumulation micro-batches) makes the sum of the per-piece losses
    equal the loss of the whole batch, however the batch is split. Defaults to the local count.
    """
    denominator = mask.sum() if num_tokens is None else num_tokens
    return masked_sum(values, mask) / _at_least_one(denominator, values)


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(
    values: torch.Tensor, mask: torch.Tensor, *, num_tokens: float | torch.Tensor | None,
    num_seqs: float | torch.Tensor | None,
    norm_len: int | None,
) -> torch.Tensor:
    """Original GRPO (DeepSeekMath, Shao et al. 2024, eq. 3): ``(1/N_seqs) sum_i (1/|o_i|) sum_t l_{i,t}``.

    ``N_seqs`` counts the non-empty completions of the global batch (a zero-length completion contributes
    nothing, neither to the sum nor to the count); defaults to the local count.
    """
    per_sequence = masked_mean(values, mask, dim=-1)
    denominator = (mask.sum(dim=-1) > 0).sum() if num_seqs is None else num_seqs
    return per_sequence.sum() / _at_least_one(denominator, values)


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    values: torch.Tensor, mask: torch.Tensor, *, num_tokens: float | torch.Tensor | None,
    num_seqs: float | torch.Tensor | None,
    norm_len: int | None,
) -> torch.Tensor:
    """Dr. GRPO: ``(1/N_seqs) sum_i (1/L) sum_t l_{i,t}`` with a CONSTANT L (the generation's max length),
    so long and short completions are weighted per token alike and no length bias enters the gradient."""
    if norm_len is None or norm_len < 1:
        raise ValueError("seq-mean-token-sum-norm needs a constant norm_len >= 1 (the max completion length)")
    per_sequence = masked_sum(values, mask, dim=-1) / float(norm_len)
    denominator = (mask.sum(dim=-1) > 0).sum() if num_seqs is None else num_seqs
    return per_sequence.sum() / _at_least_one(denominator, values)


def loss_normalizers(completion_lengths: torch.Tensor, token_mask: torch.Tensor | None = None) -> tuple[int, int]:
    """``(num_tokens, num_seqs)`` of a (micro-)batch: the counts to sum over ranks and accumulation steps and
    pass back to :func:`compute_policy_loss` as the global normalisers. ``token_mask`` (``[B, L]``, multi-turn):
    only the model's tokens count, and a sequence counts when it has one (:mod:`shared.tensors.masks`)."""
    lengths = torch.as_tensor(completion_lengths)
    if token_mask is None:
        return int(lengths.clamp(min=0).sum()), int((lengths > 0).sum())
    counted = model_token_mask(token_mask, lengths_to_mask(lengths.clamp(min=0), token_mask.shape[1])).sum(dim=1)
    return int(counted.sum()), int((counted > 0).sum())


def _completion_mask(completion_lengths: torch.Tensor | Sequence[int], logprobs: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` validity of ``logprobs``' columns. Lengths given as a list are checked on the host and compared on
    the device (no device read); a tensor is checked by :func:`lengths_to_mask` (which reads it back)."""
    if isinstance(completion_lengths, torch.Tensor):
        return lengths_to_mask(completion_lengths.to(logprobs.device), logprobs.shape[1])
    lengths = [int(n) for n in completion_lengths]
    width = logprobs.shape[1]
    if any(n < 0 or n > width for n in lengths):
        raise ValueError(f"completion lengths must be within 0..{width} (the logprobs' width), got {lengths}")
    return completion_mask(to_device(lengths, logprobs.device), width)


def _loss_tokens(completion_lengths: torch.Tensor | Sequence[int], logprobs: torch.Tensor,
                 token_mask: torch.Tensor | None, correction: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """``[B, L]``: the tokens in the loss: valid, the model's (``token_mask``) and kept by the off-policy
    ``correction``."""
    mask = model_token_mask(token_mask, _completion_mask(completion_lengths, logprobs))
    if correction is None:
        return mask
    weight, keep = correction
    if weight.shape != logprobs.shape or keep.shape != logprobs.shape:
        raise ValueError(f"off-policy weights and keep mask must be {list(logprobs.shape)} like the logprobs, got "
                         f"{tuple(weight.shape)} and {tuple(keep.shape)}")
    return mask & keep.to(mask.device)


@dataclass
class PolicyLossOutput:
    """The scalar loss to backpropagate, the per-token loss before aggregation (detached), and detached metric
    scalars computed over this piece's valid tokens (the learner averages them across pieces)."""

    loss: torch.Tensor
    token_loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


def compute_policy_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    completion_lengths: torch.Tensor | Sequence[int],
    cfg: LossConfig,
    *,
    old_logprobs: torch.Tensor | None = None,
    correction: tuple[torch.Tensor, torch.Tensor] | None = None,
    ref_logprobs: torch.Tensor | None = None,
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None, token_mask: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None, entropy_coef: float = 0.0,
) -> PolicyLossOutput:
    """The GRPO loss of one (micro-)batch. Shapes: per-token ``[B, L]``, ``advantages`` ``[B]`` or ``[B, L]`` (:func:`per_token`).

    * ``old_logprobs``: pi_old of the ratio. ``None`` means one update per batch (old = current): the ratio is
      ``exp(logp - logp.detach())``, value 1 with the policy gradient flowing (as simple_GRPO computes it when pi_old = pi_theta).
    * ``correction``: ``(weights, keep)`` of :func:`shared.grpo.off_policy.off_policy_weights` (old vs the
      sampler's behaviour logprobs): each token's policy-gradient term is multiplied by its (detached) weight, and
      tokens with keep False leave the loss like padding (their KL term too; the global normalisers must then count
      kept tokens only). ``None``: no correction (``off_policy.mode: none`` gives bitwise the same loss).
    * ``ref_logprobs``: required when ``cfg.beta > 0``; the KL term is ``beta * KL_estimator``.
    * ``num_tokens`` / ``num_seqs``: the global normalisers from :func:`loss_normalizers` (host numbers, or
      device tensors, e.g. all-reduced over ranks: then they are not read back).
    * ``completion_lengths``: which tokens count (a list is never read back from the device); ``token_mask``
      (multi-turn, ``[B, >= L]`` bool): of those, only where the model wrote the token (the rest: as padding).
    * ``entropy`` (``[B, L]``, with its gradient) and ``entropy_coef``: the entropy bonus, ``-entropy_coef * H_t``
      added to each token's loss (learner/entropy_control.py); its aggregate is the ``entropy_bonus`` metric.
    """
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, L], got shape {tuple(logprobs.shape)}")
    mask = _loss_tokens(completion_lengths, logprobs, token_mask, correction)
    advantages = per_token(advantages, logprobs)
    if cfg.beta > 0 and ref_logprobs is None:
        raise ValueError("beta > 0 needs ref_logprobs")
    dtype = logprobs.dtype  # padded positions zeroed before any arithmetic (zero_padding)
    logprobs = zero_padding(logprobs, mask, dtype)
    advantages = zero_padding(advantages, mask, dtype).detach()
    old = logprobs.detach() if old_logprobs is None else zero_padding(old_logprobs, mask, dtype).detach()

    terms = POLICY_LOSSES.get(cfg.policy_loss)(logprobs - old, advantages, mask, cfg)
    weight = torch.ones_like(logprobs) if correction is None else zero_padding(correction[0], mask, dtype).detach()
    token_loss = terms.loss if correction is None else terms.loss * weight
    metrics = importance_weight_metrics(weight, mask)

    aggregate = partial(AGGREGATIONS.get(cfg.aggregation), num_tokens=num_tokens, num_seqs=num_seqs,
                        norm_len=cfg.norm_len)
    metrics["pg_loss"] = aggregate(token_loss.detach(), mask)
    token_loss = _with_regularisers(token_loss, logprobs, mask, cfg, metrics, aggregate, ref_logprobs=ref_logprobs,
                                    entropy=entropy, entropy_coef=entropy_coef)
    loss = aggregate(token_loss, mask)
    metrics.update(surrogate_metrics(terms, mask))
    return PolicyLossOutput(loss=loss, token_loss=token_loss.detach(), metrics=metrics)


def _with_regularisers(token_loss: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor, cfg: LossConfig,
                       metrics: dict, aggregate, *, ref_logprobs: torch.Tensor | None, entropy: torch.Tensor | None,
                       entropy_coef: float) -> torch.Tensor:
    """``token_loss`` plus ``beta * KL`` (with ``ref_logprobs``; ``kl_mean`` is measured whenever they are given) and
    minus ``entropy_coef * H`` (the ``entropy_bonus`` metric: its aggregate)."""
    dtype = logprobs.dtype
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, zero_padding(ref_logprobs, mask, dtype), cfg.kl_estimator,
                        log_ratio_clamp=cfg.kl_log_ratio_clamp, value_clamp=cfg.kl_value_clamp)
        metrics["kl_mean"] = masked_mean(kl.detach(), mask)
        if cfg.beta > 0:
            token_loss = token_loss + cfg.beta * kl
    if entropy is not None and entropy_coef != 0.0:
        bonus = entropy_coef * zero_padding(entropy, mask, dtype)
        metrics["entropy_bonus"] = aggregate(bonus.detach(), mask)
        token_loss = token_loss - bonus
    return token_loss


def per_token(advantages: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` advantages: a ``[B]`` one (outcome supervision) broadcast over each completion's tokens, a
    ``[B, L]`` one (process supervision, KL in the reward: ``A_{i,t}``) as it is. Both policy losses take either:
    ``grpo`` multiplies each token's ratio by its ``A_{i,t}``, ``gspo`` the sequence ratio ``s_i`` (GSPO-token);
    a ``[B, L]`` tensor whose rows are constant gives exactly the ``[B]`` loss."""
    if advantages.dim() == 1 and advantages.shape[0] == logprobs.shape[0]:
        return advantages.unsqueeze(-1).expand_as(logprobs)
    if advantages.shape != logprobs.shape:
        raise ValueError(f"advantages must be [B] = [{logprobs.shape[0]}] or [B, L] = {list(logprobs.shape)} like "
                         f"the logprobs, got shape {tuple(advantages.shape)}")
    return advantages


def zero_padding(values: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` as ``dtype`` where ``mask`` is set, exactly 0 elsewhere.

    Padded positions are zeroed *before* any arithmetic: a -inf or NaN there would otherwise turn into NaN
    gradients through exp() even though the mask drops its value.
    """
    return torch.where(mask, values.to(dtype), torch.zeros((), dtype=dtype, device=values.device))


def importance_weight_metrics(weight: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean, min and max of the (detached) off-policy weights over the tokens in the loss."""
    w_min, w_max = masked_min_max(weight, mask)
    return dict(is_weight_mean=masked_mean(weight, mask), is_weight_min=w_min, is_weight_max=w_max)


def surrogate_metrics(terms: SurrogateTerms, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Over the valid tokens: the ratio's mean, min and max, the fractions clipped below, above and by the dual
    clip, and the token count."""
    ratio = terms.ratio.detach()
    r_min, r_max = masked_min_max(ratio, mask)
    return dict(
        ratio_mean=masked_mean(ratio, mask), ratio_min=r_min, ratio_max=r_max,
        clip_frac_low=masked_mean(terms.clipped_low.to(ratio.dtype), mask),
        clip_frac_high=masked_mean(terms.clipped_high.to(ratio.dtype), mask),
        dual_clip_frac=masked_mean(terms.dual_clipped.to(ratio.dtype), mask),
        num_tokens=mask.sum().to(ratio.dtype),
    )
