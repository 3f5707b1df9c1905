"""The policy losses: what each token of a completion contributes before the off-policy weight, the KL term and the
aggregation (:mod:`shared.grpo.losses`). Each takes ``log_ratio = log pi_theta - log pi_old`` (``[B, L]``, the gradient
flowing through ``log pi_theta``), the advantages ``A`` (``[B, L]``), the valid-token mask and the loss config, and
returns :class:`SurrogateTerms`, chosen by ``algorithm.loss.policy_loss`` from :data:`POLICY_LOSSES`:

* ``grpo``: PPO's clipped surrogate, one ratio per token (DeepSeekMath);
* ``gspo``: the same with one ratio per sequence (GSPO);
* ``cispo``: the clipped importance-sampling weight as a constant on every token's policy gradient (MiniMax-M1);
* ``sapo``: a soft, temperature-controlled gate in place of the hard clip (SAPO).

At ``pi_theta = pi_old`` (one update per batch) all four give the same gradient, ``-A grad log pi_theta``; they
differ in how they treat a token whose ratio has moved away from 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.config.schema import LossConfig
from shared.registry import Registry
from shared.tensors.masks import masked_mean

POLICY_LOSSES: Registry = Registry("policy loss")

# exp() of a log-ratio beyond this overflows float32 to inf, and inf * 0 in backward is NaN. Clamping there
# changes nothing a clipped loss would use: such ratios are far outside any clip range.
_MAX_LOG_RATIO = 20.0


@dataclass
class SurrogateTerms:
    """Per-token pieces of a clipped surrogate, all ``[B, L]``."""

    loss: torch.Tensor
    ratio: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor
    dual_clipped: torch.Tensor


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
) -> SurrogateTerms:
    """PPO's pessimistic clipped surrogate with clip-higher (DAPO) and optional dual clip.

    .. math::
        \\ell = \\max\\big(-\\rho A,\\; -\\mathrm{clip}(\\rho, 1-\\epsilon_{low}, 1+\\epsilon_{high}) A\\big)

    With dual clip ``c > 1`` (Ye et al. 2020), for ``A < 0``: ``\\ell = \\min(\\ell, -c A)``, which bounds the
    loss when a negative-advantage token's ratio has grown very large.

    Example: A ``[1,-1,2]``, rho ``[0.5,1,1.5]``, eps 0.2 give ``[-0.5, 1, -2.4]`` (token mean -0.6333);
    A ``[1,-1,-4]``, rho ``[0.5,1,10]``, c 3 give ``[-0.5, 1, 12]``.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    # A clip is "active" when the clipped branch wins, i.e. the gradient through rho is cut off there.
    clipped_low = (ratio < 1.0 - eps_low) & (advantages < 0)
    clipped_high = (ratio > 1.0 + eps_high) & (advantages > 0)
    dual_clipped = torch.zeros_like(clipped_low)
    if dual_clip is not None:
        bound = -dual_clip * advantages
        dual_clipped = (advantages < 0) & (loss > bound)
        loss = torch.where(dual_clipped, bound, loss)
    return SurrogateTerms(loss, ratio, clipped_low, clipped_high, dual_clipped)


@POLICY_LOSSES.register("grpo", "vanilla")
def token_ratio_loss(
    log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cfg: LossConfig
) -> SurrogateTerms:
    """GRPO / PPO: one ratio per token, ``rho_{i,t} = exp(log pi_theta(o_t) - log pi_old(o_t))``."""
    ratio = torch.exp(log_ratio.clamp(max=_MAX_LOG_RATIO))
    return clipped_surrogate(ratio, advantages, eps_low=cfg.eps_low, eps_high=cfg.eps_high, dual_clip=cfg.dual_clip)


@POLICY_LOSSES.register("gspo")
def sequence_ratio_loss(
    log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cfg: LossConfig
) -> SurrogateTerms:
    """GSPO: one ratio per sequence, the geometric mean of its token ratios.

    .. math::  s_i = \\exp\\Big(\\frac{1}{|o_i|}\\sum_t \\log\\frac{\\pi_\\theta(o_{i,t})}{\\pi_{old}(o_{i,t})}\\Big)

    Written in GSPO's token form ``s_{i,t} = sg[s_i] * pi_theta(o_t) / sg[pi_theta(o_t)]``: every token carries
    the value s_i (so the whole sequence is clipped or not together) and the gradient
    ``s_i * A * grad log pi_theta(o_t)``, which also allows per-token advantages.
    """
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1).clamp(max=_MAX_LOG_RATIO)
    token_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + (log_ratio - log_ratio.detach())
    ratio = torch.exp(token_log_ratio)
    return clipped_surrogate(ratio, advantages, eps_low=cfg.eps_low, eps_high=cfg.eps_high, dual_clip=cfg.dual_clip)


@POLICY_LOSSES.register("cispo")
def clipped_is_weight_loss(
    log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cfg: LossConfig
) -> SurrogateTerms:
    """CISPO (MiniMax-M1, Chen et al. 2025, eq. 4-5): clip the importance-sampling weight, not the update.

    .. math::
        \\ell_{i,t} = -\\,\\mathrm{sg}(w_{i,t})\\, A_{i,t}\\, \\Big(1 + \\log\\frac{\\pi_\\theta(o_{i,t})}{\\pi_{old}(o_{i,t})}\\Big),
        \\qquad w_{i,t} = \\mathrm{clip}(\\rho_{i,t},\\, 1-\\epsilon^{IS}_{low},\\, 1+\\epsilon^{IS}_{high})

    Its gradient is the paper's, ``-sg(w) A grad log pi_theta``, on EVERY token: a token whose ratio left the range
    keeps its gradient with a bounded weight, where PPO's clip gives it none (the rare "fork" tokens of long
    reasoning). ``cispo_eps_low`` null: no lower bound (the paper tunes only the upper one). The value differs
    from the paper's ``-sg(w) A log pi_theta`` by a constant, so that it reads ``-A`` at ``pi_theta = pi_old`` as
    every policy loss here does (``pg_loss`` stays comparable). ``clipped_low`` / ``clipped_high`` count the tokens
    whose weight was truncated.

    Example: rho ``[0.5, 1, 6]``, A ``[1, -1, 2]``, eps_low null, eps_high 3: weights ``[0.5, 1, 4]``, losses
    ``[-0.1534, 1, -22.3341]``, gradients with respect to ``log pi_theta`` ``[-0.5, 1, -8]``.
    """
    safe = log_ratio.clamp(max=_MAX_LOG_RATIO)
    ratio = torch.exp(safe.detach())
    low = 0.0 if cfg.cispo_eps_low is None else 1.0 - cfg.cispo_eps_low
    high = 1.0 + cfg.cispo_eps_high
    weight = ratio.clamp(min=low, max=high)
    loss = -weight * advantages * (1.0 + safe)
    none = torch.zeros_like(mask)
    return SurrogateTerms(loss, ratio, (ratio < low) & mask, (ratio > high) & mask, none)


@POLICY_LOSSES.register("sapo")
def soft_gate_loss(
    log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cfg: LossConfig
) -> SurrogateTerms:
    """SAPO (Soft Adaptive Policy Optimization, Gao et al. 2025, arXiv 2511.20347): a smooth gate in place of the clip.

    .. math::
        \\ell_{i,t} = -\\big(f_{i,t}(\\rho_{i,t}) - f_{i,t}(1) + 1\\big)\\,A_{i,t}, \\qquad
        f_{i,t}(x) = \\frac{4}{\\tau_{i,t}}\\,\\sigma\\big(\\tau_{i,t}(x - 1)\\big), \\qquad
        \\tau_{i,t} = \\tau_{pos} \\text{ if } A_{i,t} > 0 \\text{ else } \\tau_{neg}

    The paper's objective is ``f(rho) A``; the constant ``1 - f(1) = 1 - 2 / tau`` makes the value read ``-A`` at
    ``rho = 1`` like the other losses. Its gradient is ``-4 s (1 - s) rho A grad log pi_theta`` with
    ``s = sigma(tau (rho - 1))``: exactly the policy gradient at ``rho = 1`` (``4 s (1 - s) = 1``), fading
    smoothly as the ratio moves away instead of stopping at a clip boundary. ``tau_neg > tau_pos`` makes
    negative-advantage tokens fade faster (the paper: they destabilise training more). Nothing is clipped: the
    clip fractions stay 0.

    Example: rho ``[1, 2]``, A ``[1, -1]``, tau_pos 1, tau_neg 1.05: losses ``[-1, 1.9172]``, gradients with respect
    to ``rho`` ``[-1, 4 sigma(1.05) (1 - sigma(1.05))]`` = ``[-1, 0.7681]``.
    """
    ratio = torch.exp(log_ratio.clamp(max=_MAX_LOG_RATIO))
    tau = torch.where(advantages > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) - 2.0 / tau + 1.0
    none = torch.zeros_like(mask)
    return SurrogateTerms(-gate * advantages, ratio, none, none, none)
