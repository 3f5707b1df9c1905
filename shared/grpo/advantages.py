"""Advantages from grouped rewards: GRPO, Dr. GRPO, batch-std scaling and RLOO.

The learner calls an estimator once on the whole train batch, as verl's trainer does: ``rewards`` is ``[N]`` (one
per completion) and ``group_index`` is ``[N]`` (which prompt's group each completion belongs to, ``0..P-1``).
Groups may differ in size. Every estimator returns one advantage per completion, ``[N]``; the learner broadcasts
it over the completion's tokens.

Estimators are registered by name in :data:`ADVANTAGE_ESTIMATORS`; a new one is one decorated function with the
signature ``fn(rewards: Tensor[N], group_index: Tensor[N], *, scale: str, eps: float, batch_std) -> Tensor[N]``.

Per-token advantages: :func:`process_advantages` (process supervision) and :func:`kl_in_reward_advantages` (the KL
penalty inside the reward, on the token rewards :func:`outcome_token_rewards` or :func:`step_token_rewards` place).
They return ``[N, T]``, left-aligned like every per-token tensor, 0 past each completion's length. The learner picks
them by ``algorithm.advantage.supervision`` (its registry ``learner.advantages.SUPERVISIONS``) and
``algorithm.kl.in_reward``.
"""

from __future__ import annotations

import math

import torch

from shared.grpo.kl import KL_ESTIMATORS, kl_k1, kl_k3, kl_penalty
from shared.registry import Registry
from shared.tensors.masks import lengths_to_mask

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


# ---- process supervision and the KL penalty in the reward (per-token advantages, [N, T]) ----


def _check_index(name: str, index: torch.Tensor) -> torch.Tensor:
    if index.dim() != 1 or index.is_floating_point() or index.dtype == torch.bool or index.is_complex():
        raise ValueError(f"{name} must be a 1-D integer tensor, got {index.dtype} of shape {tuple(index.shape)}")
    return index.long()


def _check_rows(group_index: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    group_index, lengths = _check_index("group_index", group_index), _check_index("lengths", lengths)
    if group_index.shape != lengths.shape:
        raise ValueError(f"group_index and lengths must both be [N], got {tuple(group_index.shape)} and "
                         f"{tuple(lengths.shape)}")
    if group_index.numel() and int(group_index.min()) < 0:
        raise ValueError("group_index must be >= 0")
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError("lengths must be >= 0")
    return group_index, lengths


def _check_step_rows(name: str, values: torch.Tensor, step_index: torch.Tensor,
                     rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step ``values`` (as float64) and ``step_index`` (as long), each ``[S]``, the rows in ``[0, rows)``."""
    step_index = _check_index("step_index", step_index)
    if values.dim() != 1 or step_index.shape != values.shape:
        raise ValueError(f"{name} and step_index must both be [S], got {tuple(values.shape)} and "
                         f"{tuple(step_index.shape)}")
    if not torch.isfinite(values).all():
        raise ValueError(f"{name} contain NaN or inf")
    if step_index.numel() and (int(step_index.min()) < 0 or int(step_index.max()) >= rows):
        raise ValueError(f"step_index must be in [0, {rows}) (a completion row), got values in "
                         f"[{int(step_index.min())}, {int(step_index.max())}]")
    return values.to(torch.float64), step_index


def _check_step_ends(step_index: torch.Tensor, step_end: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``step_end`` as long: each inside its completion, strictly increasing within a completion (in given order)."""
    step_end = _check_index("step_end", step_end)
    if step_end.shape != step_index.shape:
        raise ValueError(f"step_end must be [S] like step_index, got {tuple(step_end.shape)} and "
                         f"{tuple(step_index.shape)}")
    outside = ((step_end < 0) | (step_end >= lengths[step_index])).nonzero()
    if outside.numel():
        k = int(outside[0])
        raise ValueError(f"step_end[{k}] = {int(step_end[k])} is outside completion {int(step_index[k])}'s "
                         f"{int(lengths[step_index[k]])} tokens")
    order = torch.sort(step_index, stable=True).indices
    rows_sorted, ends_sorted = step_index[order], step_end[order]
    unordered = ((rows_sorted[1:] == rows_sorted[:-1]) & (ends_sorted[1:] <= ends_sorted[:-1])).nonzero()
    if unordered.numel():
        k = int(order[int(unordered[0]) + 1])
        raise ValueError(f"step ends must be strictly increasing within a completion: step_end[{k}] = "
                         f"{int(step_end[k])} of completion {int(step_index[k])} is not after its previous step's end")
    return step_end


def _normalise(values: torch.Tensor, step_group: torch.Tensor, scale: str, eps: float,
               batch_std: float | None) -> torch.Tensor:
    """r~ in float64 (see :func:`normalised_step_rewards`); ``values`` already checked."""
    if scale not in SCALE_MODES:
        raise ValueError(f"unknown advantage scale {scale!r}; known: {', '.join(SCALE_MODES)}")
    if not values.numel():
        return values
    _, mean, std, constant = group_stats(values, step_group)
    centered = values - mean
    if scale == "group":
        normalised = centered / (std + eps)
    elif scale == "batch":
        normalised = centered / ((batch_std_of(values) if batch_std is None else batch_std) + eps)
    else:
        normalised = centered
    return torch.where(constant, torch.zeros_like(normalised), normalised)


def normalised_step_rewards(step_rewards: torch.Tensor, step_index: torch.Tensor, group_index: torch.Tensor, *,
                            scale: str = "group", eps: float = 1e-6, batch_std: float | None = None) -> torch.Tensor:
    """Each step's reward normalised over every step reward ``R`` of its group (DeepSeekMath §4.1.3), ``[S]``.

    .. math::  \\tilde r_{ij} = \\frac{r_{ij} - \\mathrm{mean}(R)}{\\mathrm{std}(R) + \\epsilon}

    with the unbiased std, as for outcome advantages. ``scale="none"`` gives ``r_ij - mean(R)`` (Dr. GRPO);
    ``scale="batch"`` divides by the std of every step reward of the batch (``batch_std`` overrides it: the
    learner passes the std over every rank's step rewards). A group whose ``R`` has fewer than two values or
    only equal values gets 0. The group of step k is ``group_index[step_index[k]]``.
    Example: one group, R = ``[1, 0, 1]`` gives ``[0.57735, -1.1547, 0.57735]``.
    """
    group_index = _check_index("group_index", group_index)
    if group_index.numel() and int(group_index.min()) < 0:
        raise ValueError("group_index must be >= 0")
    values, step_index = _check_step_rows("step_rewards", step_rewards, step_index, group_index.numel())
    return _normalise(values, group_index[step_index], scale, eps, batch_std).float()


def _place(values: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A float64 ``[N, T]`` of zeros with ``values[k]`` added at ``(rows[k], columns[k])``."""
    placed = torch.zeros(shape, dtype=torch.float64, device=values.device)
    return placed.index_put_((rows, columns), values.to(torch.float64), accumulate=True)


def _returns_to_go(rewards: torch.Tensor) -> torch.Tensor:
    """``A[:, t] = sum_{s >= t} rewards[:, s]``: a reversed cumulative sum over the last dimension."""
    return rewards.flip(-1).cumsum(-1).flip(-1)


def _width(lengths: torch.Tensor, width: int | None) -> int:
    longest = int(lengths.max()) if lengths.numel() else 0
    if width is None:
        return longest
    if width < longest:
        raise ValueError(f"width {width} is shorter than the longest completion ({longest} tokens)")
    return width


def process_advantages(step_rewards: torch.Tensor, step_index: torch.Tensor, step_end: torch.Tensor,
                       group_index: torch.Tensor, lengths: torch.Tensor, *, scale: str = "group", eps: float = 1e-6,
                       batch_std: float | None = None) -> torch.Tensor:
    """GRPO with process supervision (DeepSeekMath §4.1.3): each token's advantage is the sum of the normalised
    rewards of the steps that end at or after it, ``[N, max(lengths)]``.

    .. math::  A_{i,t} = \\sum_{j:\\, e_{ij} \\ge t} \\tilde r_{ij}

    ``step_rewards[k]`` is the reward of a step of completion ``step_index[k]`` whose last token is
    ``step_end[k]`` (0-based among the completion's tokens; strictly increasing within a completion); r~ is
    :func:`normalised_step_rewards` (``scale``, ``eps``, ``batch_std`` as there). Tokens after a completion's
    last step, positions past its length, and completions without steps get 0.
    Example: G = 2, lengths ``[5, 3]``, steps (row 0, end 1, reward 1), (row 0, end 3, reward 0),
    (row 1, end 2, reward 1): ``A_0 = [-0.57735, -0.57735, -1.1547, -1.1547, 0]``, ``A_1 = [0.57735] * 3``.
    """
    group_index, lengths = _check_rows(group_index, lengths)
    values, step_index = _check_step_rows("step_rewards", step_rewards, step_index, lengths.numel())
    step_end = _check_step_ends(step_index, step_end, lengths)
    normalised = _normalise(values, group_index[step_index], scale, eps, batch_std)
    placed = _place(normalised, step_index, step_end, (lengths.numel(), _width(lengths, None)))
    advantages = _returns_to_go(placed)
    return torch.where(lengths_to_mask(lengths, placed.shape[1]), advantages, 0.0).float()


def outcome_token_rewards(advantages: torch.Tensor, lengths: torch.Tensor, *, width: int | None = None) -> torch.Tensor:
    """``token_rewards`` for :func:`kl_in_reward_advantages` under outcome supervision: ``advantages[i]`` (the
    completion's normalised outcome advantage) at its last token ``lengths[i] - 1``, 0 elsewhere; ``[N, width]``
    (``width`` defaults to ``max(lengths)``). A completion of length 0 has no token to carry it."""
    lengths = _check_index("lengths", lengths)
    if advantages.shape != lengths.shape:
        raise ValueError(f"advantages and lengths must both be [N], got {tuple(advantages.shape)} and "
                         f"{tuple(lengths.shape)}")
    if not torch.isfinite(advantages).all():
        raise ValueError("advantages contain NaN or inf")
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError("lengths must be >= 0")
    rows = (lengths > 0).nonzero().flatten()
    shape = (lengths.numel(), _width(lengths, width))
    return _place(advantages[rows], rows, lengths[rows] - 1, shape).float()


def step_token_rewards(normalised: torch.Tensor, step_index: torch.Tensor, step_end: torch.Tensor,
                       lengths: torch.Tensor, *, width: int | None = None) -> torch.Tensor:
    """``token_rewards`` for :func:`kl_in_reward_advantages` under process supervision: each step's r~
    (:func:`normalised_step_rewards`) at its end token ``step_end[k]`` of row ``step_index[k]``; ``[N, width]``."""
    lengths = _check_index("lengths", lengths)
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError("lengths must be >= 0")
    values, step_index = _check_step_rows("normalised", normalised, step_index, lengths.numel())
    step_end = _check_step_ends(step_index, step_end, lengths)
    return _place(values, step_index, step_end, (lengths.numel(), _width(lengths, width))).float()


def _check_token_inputs(token_rewards: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                        lengths: torch.Tensor, beta: float, estimator: str) -> torch.Tensor:
    """The mask of real tokens, ``[N, T]``, after checking shapes, lengths, beta, estimator and finiteness."""
    if token_rewards.dim() != 2 or old_logprobs.shape != token_rewards.shape or ref_logprobs.shape != token_rewards.shape:
        raise ValueError(f"token_rewards, old_logprobs and ref_logprobs must all be [N, T], got "
                         f"{tuple(token_rewards.shape)}, {tuple(old_logprobs.shape)} and {tuple(ref_logprobs.shape)}")
    lengths = _check_index("lengths", lengths)
    if lengths.shape != token_rewards.shape[:1]:
        raise ValueError(f"lengths must be [N] = [{token_rewards.shape[0]}], got {tuple(lengths.shape)}")
    mask = lengths_to_mask(lengths, token_rewards.shape[1])  # raises for a length < 0 or > T
    if not (isinstance(beta, int | float) and math.isfinite(beta) and beta >= 0):
        raise ValueError(f"beta must be a finite number >= 0, got {beta!r}")
    if estimator not in KL_ESTIMATORS or KL_ESTIMATORS.get(estimator) not in (kl_k1, kl_k3):
        raise ValueError(f"unknown KL-in-reward estimator {estimator!r}; known: k1 (alias kl), k3 (alias low_var_kl)")
    for name, values in (("token_rewards", token_rewards), ("old_logprobs", old_logprobs),
                         ("ref_logprobs", ref_logprobs)):
        if not torch.isfinite(values.detach()[mask]).all():
            raise ValueError(f"{name} contain NaN or inf within the completions' lengths")
    return mask


def kl_in_reward_advantages(token_rewards: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                            lengths: torch.Tensor, *, beta: float, estimator: str = "k1") -> torch.Tensor:
    """The KL penalty inside the reward (``kl.in_reward: true``; OpenRLHF's semantics): per token a reward of
    minus beta times the KL estimate plus the placed task reward, and the advantage is its return to go, ``[N, T]``.

    .. math::  r_t = -\\beta\\, k(t) + p_t, \\qquad A_t = \\sum_{s \\ge t} r_s

    ``token_rewards`` holds p: the outcome advantage at the last token (:func:`outcome_token_rewards`) or each
    step's r~ at its end (:func:`step_token_rewards`), else 0. ``k`` is ``k1 = log pi_old - log pi_ref`` (the
    default) or ``k3 = r - 1 - log r`` with ``log r = log pi_ref - log pi_old`` (:func:`shared.grpo.kl.kl_penalty`),
    from the behaviour (old) and reference logprobs, without gradient. Positions past ``lengths`` are 0 (and may
    hold anything, -inf included). Example: p = ``[0, 0, 1]``, old = ``[-1, -1, -1]``, ref = ``[-2, -1, -3]``,
    beta 0.1, k1 = ``[1, 0, 2]``: r = ``[-0.1, 0, 0.8]``, A = ``[0.7, 0.8, 0.8]``.
    """
    mask = _check_token_inputs(token_rewards, old_logprobs, ref_logprobs, lengths, beta, estimator)
    zero = torch.zeros((), dtype=torch.float64, device=token_rewards.device)
    old = torch.where(mask, old_logprobs.detach().to(torch.float64), zero)
    ref = torch.where(mask, ref_logprobs.detach().to(torch.float64), zero)
    placed = torch.where(mask, token_rewards.detach().to(torch.float64), zero)
    rewards = torch.where(mask, placed - beta * kl_penalty(old, ref, estimator), zero)
    return torch.where(mask, _returns_to_go(rewards), zero).float()
