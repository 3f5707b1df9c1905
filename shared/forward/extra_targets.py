"""The chunked LM head with extra target ids per position: ``log softmax(head(h) / T)`` at the sampled token *and* at
``k`` more ids of each position, with gradients, never as an ``[N, V]`` tensor.

What top-k logit distillation (``algorithm.distill.mode: topk_forward_kl``, :mod:`shared.grpo.distill`) needs from
the student: its logprobs at the teacher's top-k ids of every completion position, ``[N, k]``, differentiable. Like
the checkpointed path of :func:`shared.forward.logprobs.logprobs_from_hidden`, each chunk of ``chunk_tokens``
positions has its logits built, reduced to ``logsumexp`` and gathered at ``[target, extra ids...]`` and dropped;
with gradients on, each chunk runs under activation checkpointing, so the backward recomputes one chunk's logits at a
time: peak extra memory stays a few ``[chunk, V]`` fp32 tensors whatever ``N`` and ``k`` are.

The logits expression is the fused path's (``hidden @ W.T`` in fp32 for a plain bias-free linear head, the head's
own forward plus the architecture's logit transform otherwise), so the sampled token's logprob here equals
:func:`shared.forward.logprobs.logprobs_from_hidden`'s up to float rounding of the reduction order.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shared.forward.lm_head import fused_head_weight


def _chunk_reducer(lm_head: nn.Module, weight: torch.Tensor | None, transform, temperature: float,
                   with_entropy: bool):
    """``reduce(h [n, H], ids [n, 1 + k]) -> (logprobs [n, 1 + k], entropy [n])`` of one chunk."""

    def reduce(h: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = (h @ weight.T).float() if weight is not None else transform(lm_head(h).float())
        if temperature != 1.0:
            logits = logits / temperature
        lse = torch.logsumexp(logits, dim=-1)
        logp = logits.gather(-1, ids) - lse[:, None]
        if not with_entropy:
            return logp, torch.zeros_like(lse)
        return logp, lse - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)

    return reduce


def logprobs_with_extra_targets(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    targets: torch.Tensor,
    extra_targets: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool,
    chunk_tokens: int,
    logit_transform=None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(logprobs [N], entropy [N] or None, extra_logprobs [N, k])`` of ``hidden [N, H]`` at ``targets [N]`` and
    ``extra_targets [N, k]`` (int ids in ``[0, V)``), all fp32, from ``log softmax(lm_head(hidden) / temperature)``.

    Gradients flow into ``hidden`` and the head through all three outputs (checkpointed per chunk when autograd
    needs them). ``chunk_tokens``: positions per chunk."""
    if extra_targets.dim() != 2 or extra_targets.shape[0] != hidden.shape[0]:
        raise ValueError(f"extra_targets must be [N, k] = [{hidden.shape[0]}, k], got {tuple(extra_targets.shape)}")
    weight = fused_head_weight(lm_head, logit_transform)
    reduce = _chunk_reducer(lm_head, weight, logit_transform or (lambda logits: logits), float(temperature),
                            with_entropy)
    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in lm_head.parameters()))
    ids = torch.cat([targets.long()[:, None], extra_targets.long()], dim=1)
    logps, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, y = hidden[start:start + chunk_tokens], ids[start:start + chunk_tokens]
        logp, ent = checkpoint(reduce, h, y, use_reentrant=False) if needs_grad else reduce(h, y)
        logps.append(logp)
        entropies.append(ent)
    k = extra_targets.shape[1]
    both = torch.cat(logps) if logps else hidden.new_zeros(0, 1 + k, dtype=torch.float32)
    entropy = (torch.cat(entropies) if entropies else hidden.new_zeros(0, dtype=torch.float32)) if with_entropy \
        else None
    return both[:, 0], entropy, both[:, 1:]
