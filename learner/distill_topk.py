"""Top-k logit distillation in the learner's loss (``algorithm.distill.mode: topk_forward_kl``, docs/distillation.md).

The hub's batch carries the teacher's top-k next tokens at every completion position (``teacher_topk_ids`` /
``teacher_topk_logprobs`` ``[B, L, k]``, :mod:`shared.protocol.teacher_topk`). Each micro-batch's training forward
also gathers the student's logprobs at those ids (:func:`shared.forward.logprobs.sequence_logprobs`'
``extra_targets``, inside the LM head's chunks, with gradients), and the loss gains

.. math::  \\mathcal{L} \\mathrel{+}= c \\cdot \\mathrm{agg}_t\\, D_t

``D_t`` the per-position forward KL of :func:`shared.grpo.distill.topk_forward_kl_loss_terms`, ``c`` =
``algorithm.distill.coef`` and ``agg`` the policy loss's own token aggregation (``algorithm.loss.aggregation``) with
its global normalisers, over the same tokens (the model's, within the loss lengths: ``learner.mask_truncated``
applies). It is a supervised term on the teacher's distribution at the student's own prefixes, so it takes no
importance ratio and no off-policy correction (a masking correction's dropped tokens still count here). It combines
with the outcome advantages (GRPO + distillation) or stands alone (``algorithm.advantage.supervision: none``: every
advantage 0, the policy-gradient term 0). ``distill_forward_kl`` (the mean ``D_t`` per model token, before ``c``)
is logged every step.
"""

from __future__ import annotations

from functools import partial

import torch

from shared.config.schema import LossConfig
from shared.grpo.distill import forward_kl_mean, topk_forward_kl_loss_terms
from shared.grpo.losses import AGGREGATIONS, PolicyLossOutput
from shared.protocol.records import TrainBatch
from shared.tensors.masks import completion_mask, model_token_mask
from shared.tensors.transfers import to_device


def micro_batch_topk(batch: TrainBatch, rows: torch.Tensor, width: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(ids, logprobs)`` ``[b, width, k]`` of the batch's teacher top-k for ``rows``, on ``device`` (None when the
    batch has none)."""
    if batch.teacher_topk_ids is None:
        return None
    ids = batch.teacher_topk_ids[rows, :width].to(device, dtype=torch.long)
    return ids, batch.teacher_topk_logprobs[rows, :width].to(device)


def require_topk(batch: TrainBatch) -> None:
    """A batch without the teacher's top-k cannot be trained under topk_forward_kl: say why and what to do."""
    if batch.teacher_topk_ids is None:
        raise ValueError(f"algorithm.distill.mode topk_forward_kl needs the teacher's top-k per token, but batch "
                         f"{batch.batch_id!r} has none: the ref server must be started with the same config "
                         "(ref_server.teacher_model and algorithm.distill)")


def add_forward_kl(result: PolicyLossOutput, student_topk: torch.Tensor, teacher_topk: torch.Tensor,
                   loss_lengths: list[int], loss_mask: torch.Tensor | None, cfg: LossConfig, *, coef: float,
                   num_tokens: float | torch.Tensor, num_seqs: float | torch.Tensor) -> None:
    """``result.loss += coef * agg(D)`` (in place) and the ``distill_forward_kl`` metric: the micro-batch's mean
    ``D_t`` over its model tokens (the step averages it over micro-batches weighted by their tokens).

    ``student_topk`` ``[b, w, k]`` with its gradient, ``teacher_topk`` the teacher's logprobs there, ``loss_lengths``
    the host lengths in the loss, ``loss_mask`` the model-token mask (None: all)."""
    terms = topk_forward_kl_loss_terms(student_topk, teacher_topk, loss_lengths, loss_mask=loss_mask)
    mask = model_token_mask(loss_mask, completion_mask(to_device(loss_lengths, terms.device), terms.shape[1]))
    aggregate = partial(AGGREGATIONS.get(cfg.aggregation), num_tokens=num_tokens, num_seqs=num_seqs,
                        norm_len=cfg.norm_len)
    term = aggregate(terms.to(result.loss.dtype), mask)
    result.loss = result.loss + coef * term
    result.metrics["distill_forward_kl"] = forward_kl_mean(terms, loss_lengths, loss_mask)
