"""On-policy distillation: the per-token reward that pulls the student towards a teacher on the student's own samples.

The student samples a completion; the teacher scores those same tokens (the hub's teacher scorer, like reference
logprobs); each model token gets the negative per-token reverse KL estimate as its reward (Agarwal et al., GKD;
Thinking Machines' "On-policy distillation"; slime ``--use-opd``, verl):

.. math::  r_t = -c\\,(\\log \\pi_{student}(o_t) - \\log \\pi_{teacher}(o_t))

``log pi_student - log pi_teacher`` at the sampled token is the k1 estimate of KL(student || teacher) at that
position: a token the teacher finds likelier than the student is rewarded, one it finds unlikelier is penalised.
The learner adds ``r_t`` to the token's advantage without a return to go (discount 0, as those implementations do:
each token is graded on its own next-token choice), see :mod:`learner.advantages`.
"""

from __future__ import annotations

import math

import torch

from shared.tensors.masks import completion_mask, lengths_to_mask, model_token_mask
from shared.tensors.transfers import to_device


def distill_token_rewards(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, lengths: torch.Tensor, *,
                          coef: float, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``-coef * (student_logprobs - teacher_logprobs)`` on the model's tokens, float32 ``[N, T]``.

    ``student_logprobs`` and ``teacher_logprobs`` are ``[N, T]`` logprobs of the sampled tokens, left-aligned;
    ``lengths`` ``[N]`` the completion lengths (``<= T``); ``loss_mask`` ``[N, >= T]`` (1 = the model wrote the
    token, 0 = the environment did; None: all the model's). Positions at or past a row's length and environment
    tokens get 0, whatever they hold (-inf and NaN included). No gradient flows: the result is a reward.

    Example: student ``[[-1, -2, -0.5]]``, teacher ``[[-0.5, -3, -0.5]]``, lengths ``[2]``, coef 1:
    student - teacher = ``[-0.5, 1, 0]`` and the rewards are ``[[0.5, -1, 0]]`` (the third token is past the
    length); with ``loss_mask`` ``[[1, 0, 1]]`` they are ``[[0.5, 0, 0]]``.
    """
    if student_logprobs.dim() != 2 or teacher_logprobs.shape != student_logprobs.shape:
        raise ValueError(f"student_logprobs and teacher_logprobs must both be [N, T], got "
                         f"{tuple(student_logprobs.shape)} and {tuple(teacher_logprobs.shape)}")
    if not (isinstance(coef, int | float) and math.isfinite(coef) and coef >= 0):
        raise ValueError(f"coef must be a finite number >= 0, got {coef!r}")
    lengths = torch.as_tensor(lengths, device=student_logprobs.device)
    if lengths.shape != student_logprobs.shape[:1] or lengths.dtype.is_floating_point:
        raise ValueError(f"lengths must be [N] = [{student_logprobs.shape[0]}] integers, got "
                         f"{tuple(lengths.shape)} {lengths.dtype}")
    mask = lengths_to_mask(lengths.long(), student_logprobs.shape[1])  # raises for a length < 0 or > T
    if loss_mask is not None:
        if loss_mask.dim() != 2 or loss_mask.shape[0] != mask.shape[0] or loss_mask.shape[1] < mask.shape[1]:
            raise ValueError(f"loss_mask must be [N, >= T] = [{mask.shape[0]}, >= {mask.shape[1]}], got "
                             f"{tuple(loss_mask.shape)}")
        mask = model_token_mask(loss_mask, mask)
    zero = torch.zeros((), dtype=torch.float64, device=student_logprobs.device)
    student = torch.where(mask, student_logprobs.detach().to(torch.float64), zero)
    teacher = torch.where(mask, teacher_logprobs.detach().to(torch.float64), zero)
    if not (torch.isfinite(student).all() and torch.isfinite(teacher).all()):
        raise ValueError("student_logprobs or teacher_logprobs contain NaN or inf at a model token")
    return torch.where(mask, -coef * (student - teacher), zero).float()


def centred_token_rewards(rewards: torch.Tensor, lengths: torch.Tensor,
                          loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``rewards - b`` on the model's tokens (0 elsewhere), ``b`` the mean of ``rewards`` over every model token of
    the batch: a baseline for :func:`distill_token_rewards` (``algorithm.distill.baseline: mean``).

    .. math::  \\tilde r_t = r_t - \\frac{1}{|M|}\\sum_{(i, s) \\in M} r_{i, s}

    Any baseline that does not depend on the token's own choice leaves the policy gradient's expectation unchanged
    (``E[grad log pi(o_t)] = 0``); the batch mean depends on it through one term in ``|M|`` (a bias of order
    ``1/|M|``). Why it matters: when the teacher finds most of the student's samples unlikely (a sharp teacher),
    every ``r_t`` is negative, and without a baseline each update pushes down every sampled token; with it, tokens
    the teacher agrees with more than the batch's average are pushed up and the rest down.

    Example: rewards ``[[0.5, -1, 0], [-2, 0, 0]]``, lengths ``[2, 1]`` (model tokens 0.5, -1, -2; mean -5/6) give
    ``[[4/3, -1/6, 0], [-7/6, 0, 0]]``."""
    mask = model_token_mask(loss_mask, lengths_to_mask(torch.as_tensor(lengths).long(), rewards.shape[1]))
    count = int(mask.sum())
    if count == 0:
        return torch.zeros_like(rewards)
    mean = rewards.double()[mask].sum() / count
    return torch.where(mask, rewards.double() - mean, 0.0).to(rewards.dtype)


def reverse_kl_mean(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, lengths: torch.Tensor,
                    loss_mask: torch.Tensor | None = None) -> float:
    """The mean over the model's tokens of ``student - teacher`` (the k1 estimate of KL(student || teacher) per
    token): the ``distill_reverse_kl`` metric, ``distill_token_rewards`` with coef 1 negated and averaged."""
    mask = model_token_mask(loss_mask, lengths_to_mask(torch.as_tensor(lengths).long(), student_logprobs.shape[1]))
    rewards = distill_token_rewards(student_logprobs, teacher_logprobs, lengths, coef=1.0, loss_mask=loss_mask)
    count = int(mask.sum())
    return float(-rewards.double().sum() / count) if count else 0.0


def topk_forward_kl_loss_terms(student_topk_logprobs: torch.Tensor, teacher_topk_logprobs: torch.Tensor,
                               lengths: torch.Tensor, *, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-position forward KL from the teacher's top-k distribution to the student (top-k logit distillation,
    ``algorithm.distill.mode: topk_forward_kl``), float32 ``[N, T]`` with the student's gradient.

    .. math::  \\tilde p_T(v) = \\frac{e^{\\ell_T(v)}}{\\sum_{u \\in K_t} e^{\\ell_T(u)}},\\qquad
               D_t = \\sum_{v \\in K_t} \\tilde p_T(v)\\,\\bigl(\\log \\tilde p_T(v) - \\log p_S(v)\\bigr)

    ``K_t`` the teacher's k most likely next tokens at completion position t, ``l_T`` its logprobs there
    (``teacher_topk_logprobs [N, T, k]``), ``log p_S`` the student's full-vocabulary logprobs at the same ids
    (``student_topk_logprobs [N, T, k]``, shared.forward's ``extra_targets``). The choice: the teacher is
    renormalised over its top-k (its mass outside them, unknown to the learner, is dropped, as top-k KD
    implementations do), the student is not (its logprobs keep their full-softmax normaliser). So
    ``D_t = KL(p~_T || p_S restricted and renormalised to K_t) - log Z_S >= 0`` with ``Z_S`` the student's mass on
    ``K_t``: minimising it pulls the student's mass into the teacher's top-k, in the teacher's proportions. It is 0
    exactly when the student's logprobs at ``K_t`` equal ``log p~_T``; a student equal to the teacher gets
    ``-log Z_T`` (the teacher's own mass outside its top-k, in nats), small when k covers the teacher's mass.
    Its gradient in the student's logits z is ``p_S - p~_T`` on the vocabulary (``p~_T`` 0 outside ``K_t``).

    ``lengths [N]``: completion lengths (``<= T``); ``loss_mask [N, >= T]`` (1 = the model wrote the token, 0 = the
    environment did; None: all the model's). Positions past a length and environment tokens are exactly 0 (their
    inputs, -inf and NaN included, never reach the arithmetic). Teacher entries of -inf (an id the teacher gives no
    mass) contribute 0.

    Example (k = 2): teacher ``log [0.6, 0.2]`` (Z_T = 0.8, so p~_T = [0.75, 0.25]), student ``log [0.5, 0.25]``:
    ``D = 0.75 log(0.75/0.5) + 0.25 log(0.25/0.25) = 0.75 log 1.5 = 0.3041``.
    """
    if student_topk_logprobs.dim() != 3 or teacher_topk_logprobs.shape != student_topk_logprobs.shape:
        raise ValueError(f"student_topk_logprobs and teacher_topk_logprobs must both be [N, T, k], got "
                         f"{tuple(student_topk_logprobs.shape)} and {tuple(teacher_topk_logprobs.shape)}")
    n, width, _ = student_topk_logprobs.shape
    mask = _host_checked_mask(lengths, n, width, student_topk_logprobs.device)
    if loss_mask is not None:
        if loss_mask.dim() != 2 or loss_mask.shape[0] != n or loss_mask.shape[1] < width:
            raise ValueError(f"loss_mask must be [N, >= T] = [{n}, >= {width}], got {tuple(loss_mask.shape)}")
        mask = model_token_mask(loss_mask.to(mask.device), mask)
    keep = mask[..., None]
    teacher = torch.where(keep, teacher_topk_logprobs.detach().float(), 0.0)
    log_p = teacher - torch.logsumexp(teacher, dim=-1, keepdim=True)        # log p~_T, renormalised over the top-k
    p = log_p.exp()
    student = torch.where(keep, student_topk_logprobs.float(), 0.0)
    terms = torch.where(p > 0, p * (log_p - student), 0.0).sum(dim=-1)
    return torch.where(mask, terms, 0.0)


def _host_checked_mask(lengths, n: int, width: int, device: torch.device) -> torch.Tensor:
    """``[n, width]`` validity from ``lengths``, checked on the host (a length < 0 or > width raises); host lengths
    (a list: the learner's) reach the device without waiting for it (:func:`shared.tensors.transfers.to_device`)."""
    host = torch.as_tensor(lengths)
    if host.shape != (n,) or host.dtype.is_floating_point:
        raise ValueError(f"lengths must be [N] = [{n}] integers, got {tuple(host.shape)} {host.dtype}")
    if host.device.type != "cpu":
        return lengths_to_mask(host.long(), width).to(device)
    lengths_to_mask(host.long(), width)  # the checks
    return completion_mask(to_device(host.long(), device), width)


def forward_kl_mean(terms: torch.Tensor, lengths: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The mean of :func:`topk_forward_kl_loss_terms` over the model's tokens (a detached 0-d tensor; 0 for none):
    the ``distill_forward_kl`` metric, before coef."""
    mask = model_token_mask(loss_mask, _host_checked_mask(lengths, terms.shape[0], terms.shape[1], terms.device))
    return (terms.detach().double().sum() / mask.sum().clamp(min=1)).float()
