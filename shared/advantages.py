"""Advantages from grouped rewards: GRPO, Dr. GRPO, batch-std, RLOO, and process (per-step) rewards.

Rewards arrive as ``[P, G]``: P prompts, G completions per prompt. Every estimator returns one advantage per
completion ``[P, G]`` (the learner broadcasts it over the completion's tokens), except
:func:`process_advantages`, which returns one per token.

Estimators are registered by name in :data:`ADVANTAGE_ESTIMATORS`; a new one is one decorated function with the
signature ``fn(rewards: Tensor[P, G], *, scale: str, eps: float) -> Tensor[P, G]``.
"""

from __future__ import annotations

import torch

from shared.masks import lengths_to_mask
from shared.registry import Registry

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")
SCALE_MODES = ("group", "batch", "none")


def _check_rewards(rewards: torch.Tensor) -> torch.Tensor:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf")
    return rewards.to(torch.float32) if not rewards.is_floating_point() else rewards


def _constant_groups(rewards: torch.Tensor) -> torch.Tensor:
    """``[P, 1]`` bool: groups whose rewards are all equal (or of size 1), which carry no learning signal.

    Tested with max == min rather than std == 0 because the float mean of equal values can differ from them in
    the last bit, which would turn "no signal" into a huge advantage after dividing by a tiny std.
    """
    return (rewards.max(dim=1, keepdim=True).values == rewards.min(dim=1, keepdim=True).values)


@ADVANTAGE_ESTIMATORS.register("grpo")
def group_advantages(rewards: torch.Tensor, *, scale: str = "group", eps: float = 1e-6) -> torch.Tensor:
    """GRPO's group-relative advantage (DeepSeekMath eq. 3; Dr. GRPO for ``scale="none"``).

    .. math::  A_i = \\frac{r_i - \\mathrm{mean}(r_{1..G})}{\\sigma + \\epsilon}

    ``scale`` picks sigma:
      * ``"group"``: the unbiased std of the group (``torch.std``), as in GRPO;
      * ``"batch"``: the unbiased std of all rewards in the batch (the mean stays per group);
      * ``"none"``:  no division, ``A_i = r_i - mean`` (Dr. GRPO), which avoids up-weighting near-constant
        groups.

    A group whose rewards are all equal (or with G = 1) gets advantage exactly 0, never NaN.
    Example (seed 000): rewards ``[0,1,0,1,1,0]`` give ``±0.9129``.
    """
    rewards = _check_rewards(rewards)
    if scale not in SCALE_MODES:
        raise ValueError(f"unknown advantage scale {scale!r}; known: {', '.join(SCALE_MODES)}")
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == "group":
        std = rewards.std(dim=1, keepdim=True) if rewards.shape[1] > 1 else torch.zeros_like(rewards[:, :1])
        advantages = centered / (std + eps)
    elif scale == "batch":
        std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
        advantages = centered / (std + eps)
    else:
        advantages = centered
    return torch.where(_constant_groups(rewards), torch.zeros_like(advantages), advantages)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(rewards: torch.Tensor, *, scale: str = "none", eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE leave-one-out: each sample's baseline is the mean of the *other* G-1 rewards.

    .. math::  A_i = r_i - \\frac{1}{G-1}\\sum_{j \\ne i} r_j = \\frac{G}{G-1}\\,(r_i - \\bar r)

    ``scale`` divides by the group's (``"group"``) or batch's (``"batch"``) unbiased std plus eps, as in
    :func:`group_advantages`; the RLOO default is ``"none"``. G = 1 or an all-equal group gives 0.
    """
    rewards = _check_rewards(rewards)
    group_size = rewards.shape[1]
    if group_size < 2:
        return torch.zeros_like(rewards)
    centered = group_advantages(rewards, scale=scale, eps=eps)
    return centered * (group_size / (group_size - 1))


def compute_advantages(
    rewards: torch.Tensor, estimator: str = "grpo", *, scale: str = "group", eps: float = 1e-6
) -> torch.Tensor:
    """Dispatch to the estimator registered under ``estimator`` (see :data:`ADVANTAGE_ESTIMATORS`)."""
    return ADVANTAGE_ESTIMATORS.get(estimator)(rewards, scale=scale, eps=eps)


def process_advantages(
    step_rewards: torch.Tensor,
    step_ends: torch.Tensor,
    num_steps: torch.Tensor,
    completion_len: int,
    *,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-token advantages from process (per-step) rewards for ONE group (DeepSeekMath §4.1.3, seed 003).

    Completion i of the group has ``K_i = num_steps[i]`` steps; step j ends at completion-token index
    ``step_ends[i, j]`` and gets reward ``step_rewards[i, j]`` (both ``[G, S]``, padded past ``K_i``).
    Rewards are normalised over *all* steps of the group, and a token's advantage is the sum of the normalised
    rewards of the steps that end at or after it:

    .. math::  \\tilde r_i^{(j)} = \\frac{r_i^{(j)} - \\mathrm{mean}(R)}{\\mathrm{std}(R) + \\epsilon},\\qquad
               A_{i,t} = \\sum_{\\mathrm{index}(j) \\ge t} \\tilde r_i^{(j)}

    where R is the set of all valid step rewards of the group (unbiased std). Tokens after a completion's last
    step get 0. If all step rewards of the group are equal, every advantage is 0.
    Returns ``[G, completion_len]``.
    """
    if step_rewards.shape != step_ends.shape or step_rewards.dim() != 2:
        raise ValueError("step_rewards and step_ends must both be [G, S]")
    valid = lengths_to_mask(num_steps, step_rewards.shape[1])
    if bool(valid.any()) and int(step_ends[valid].max()) >= completion_len:
        raise ValueError(f"a step ends at token {int(step_ends[valid].max())} >= completion_len {completion_len}")
    rewards = step_rewards.to(torch.float32)
    values = rewards[valid]
    if values.numel() < 2 or bool(values.max() == values.min()):
        return torch.zeros(step_rewards.shape[0], completion_len)
    normalised = torch.where(valid, (rewards - values.mean()) / (values.std() + eps), torch.zeros_like(rewards))
    token_positions = torch.arange(completion_len)
    # covers[i, j, t] = step j of completion i ends at or after token t
    covers = step_ends.unsqueeze(-1) >= token_positions.view(1, 1, -1)
    return (normalised.unsqueeze(-1) * covers).sum(dim=1)
