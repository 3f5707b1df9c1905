"""Advantages from grouped rewards: GRPO, Dr. GRPO, batch-std scaling and RLOO.

The learner calls an estimator once on the whole train batch, as verl's trainer does: ``rewards`` is ``[N]`` (one
per completion) and ``group_index`` is ``[N]`` (which prompt's group each completion belongs to, ``0..P-1``).
Groups may differ in size. Every estimator returns one advantage per completion, ``[N]``; the learner broadcasts
it over the completion's tokens.

Estimators are registered by name in :data:`ADVANTAGE_ESTIMATORS`; a new one is one decorated function with the
signature ``fn(rewards: Tensor[N], group_index: Tensor[N], *, scale: str, eps: float, batch_std) -> Tensor[N]``.
"""

from __future__ import annotations

import torch

from shared.registry import Registry

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")
SCALE_MODES = ("group", "batch", "none")


def _check(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    if rewards.dim() != 1 or group_index.shape != rewards.shape:
        raise ValueError(f"rewards and group_index must both be [N], got {tuple(rewards.shape)} and "
                         f"{tuple(group_index.shape)}")
    if rewards.numel() and int(group_index.min()) < 0:
        raise ValueError("group_index must be >= 0")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf")
    return rewards.to(torch.float64)  # sums over large groups of small rewards stay exact enough


def group_stats(rewards: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per completion: its group's size, mean, unbiased std, and whether the group's rewards are all equal.

    .. math::  n_g = |g|,\\quad \\bar r_g = \\frac{1}{n_g}\\sum_{i \\in g} r_i,\\quad
               \\sigma_g = \\sqrt{\\frac{1}{n_g - 1}\\sum_{i \\in g} (r_i - \\bar r_g)^2}

    "All equal" is tested with max == min, not std == 0: the float mean of equal values can differ from them in
    the last bit, which would turn "no signal" into a huge advantage after dividing by a tiny std.
    """
    groups = int(group_index.max()) + 1 if group_index.numel() else 0
    size = torch.zeros(groups, dtype=rewards.dtype).index_add_(0, group_index, torch.ones_like(rewards))
    mean = torch.zeros(groups, dtype=rewards.dtype).index_add_(0, group_index, rewards) / size.clamp(min=1)
    centered = rewards - mean[group_index]
    squares = torch.zeros(groups, dtype=rewards.dtype).index_add_(0, group_index, centered * centered)
    std = (squares / (size - 1).clamp(min=1)).sqrt()
    high = torch.full((groups,), -torch.inf, dtype=rewards.dtype).scatter_reduce_(0, group_index, rewards, "amax")
    low = torch.full((groups,), torch.inf, dtype=rewards.dtype).scatter_reduce_(0, group_index, rewards, "amin")
    constant = high == low
    return size[group_index], mean[group_index], std[group_index], constant[group_index]


def batch_std_of(rewards: torch.Tensor) -> float:
    """The unbiased std of all rewards (0 for fewer than two)."""
    return float(rewards.double().std()) if rewards.numel() > 1 else 0.0


@ADVANTAGE_ESTIMATORS.register("grpo")
def group_advantages(rewards: torch.Tensor, group_index: torch.Tensor, *, scale: str = "group", eps: float = 1e-6,
                     batch_std: float | None = None) -> torch.Tensor:
    """GRPO's group-relative advantage (DeepSeekMath, Shao et al. 2024, eq. 3; Dr. GRPO, Liu et al. 2025, for
    ``scale="none"``).

    .. math::  A_i = \\frac{r_i - \\bar r_{g(i)}}{\\sigma + \\epsilon}

    ``scale`` picks sigma:
      * ``"group"``: the unbiased std of the completion's group, as in GRPO;
      * ``"batch"``: the unbiased std of all rewards of the batch (the mean stays per group), as in
        "A Closer Look at GRPO"/Lite PPO; ``batch_std`` overrides it (the learner passes the std over every
        rank's rewards, so the batch is the global batch);
      * ``"none"``:  no division, ``A_i = r_i - mean`` (Dr. GRPO), which avoids up-weighting near-constant groups.

    A group whose rewards are all equal (or of size 1) gets advantage exactly 0, never NaN.
    Example: rewards ``[0,1,0,1,1,0]`` in one group give ``±0.9129``.
    """
    values = _check(rewards, group_index)
    if scale not in SCALE_MODES:
        raise ValueError(f"unknown advantage scale {scale!r}; known: {', '.join(SCALE_MODES)}")
    if not values.numel():
        return rewards.new_zeros(0, dtype=torch.float32)
    _, mean, std, constant = group_stats(values, group_index)
    centered = values - mean
    if scale == "group":
        advantages = centered / (std + eps)
    elif scale == "batch":
        advantages = centered / ((batch_std_of(values) if batch_std is None else batch_std) + eps)
    else:
        advantages = centered
    return torch.where(constant, torch.zeros_like(advantages), advantages).float()


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, *, scale: str = "none", eps: float = 1e-6,
                    batch_std: float | None = None) -> torch.Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): each sample's baseline is the mean of the *other* G-1
    rewards of its group.

    .. math::  A_i = r_i - \\frac{1}{G-1}\\sum_{j \\ne i} r_j = \\frac{G}{G-1}\\,(r_i - \\bar r)

    ``scale`` divides by the group's (``"group"``) or batch's (``"batch"``) unbiased std plus eps, as in
    :func:`group_advantages`; the RLOO default is ``"none"``. G = 1 or an all-equal group gives 0.
    """
    centered = group_advantages(rewards, group_index, scale=scale, eps=eps, batch_std=batch_std)
    if not centered.numel():
        return centered
    size, *_ = group_stats(rewards.double(), group_index)
    factor = torch.where(size > 1, size / (size - 1).clamp(min=1), torch.zeros_like(size))
    return (centered.double() * factor).float()


def compute_advantages(rewards: torch.Tensor, group_index: torch.Tensor, estimator: str = "grpo", *,
                       scale: str = "group", eps: float = 1e-6, batch_std: float | None = None) -> torch.Tensor:
    """Dispatch to the estimator registered under ``estimator`` (see :data:`ADVANTAGE_ESTIMATORS`)."""
    return ADVANTAGE_ESTIMATORS.get(estimator)(rewards, group_index, scale=scale, eps=eps, batch_std=batch_std)
