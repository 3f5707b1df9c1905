"""The LM head applied outside the model's ``forward`` (shared.forward.logprobs and the ref server's top-k take
the backbone's hidden states and apply the head themselves, in chunks): the fused chunked logprob of a plain linear
head with its hand-written backward. What an architecture's ``forward`` does to the head's output is found in
:mod:`shared.forward.logit_transform`.
"""

from __future__ import annotations

import torch
from torch import nn


class LinearHeadLogprobs(torch.autograd.Function):
    """Chunked ``log softmax(hidden @ W.T / T)[targets]`` (+ entropy) with a hand-written backward.

    Forward keeps only the per-token ``logsumexp`` (and entropy); backward recomputes one chunk's logits at a time,
    turns them in place into ``dL/dz`` and accumulates the weight gradient into a single buffer with ``addmm_``.
    Compared with checkpointing each chunk, this avoids a second full ``[V, H]`` weight-gradient temporary per
    chunk and one of the recomputed matmuls.

    With z = logits / T, p = softmax(z), H = -sum p log p:
      d log p_y / dz = onehot(y) - p,     dH / dz = -p * (log p + H),     d/dlogits = (d/dz) / T.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, with_entropy):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            logits = (hidden[start:end] @ weight.T).float()
            if temperature != 1.0:
                logits.div_(temperature)
            chunk_lse = torch.logsumexp(logits, dim=-1)
            lse[start:end] = chunk_lse
            logp[start:end] = logits.gather(-1, targets[start:end, None]).squeeze(-1) - chunk_lse
            if with_entropy:
                probs = (logits - chunk_lse[:, None]).exp_()
                entropy[start:end] = chunk_lse - (probs * logits).sum(-1)
                del probs
            del logits
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        use_entropy = ctx.with_entropy and grad_entropy is not None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            h, g = hidden[start:end], grad_logp[start:end].float()
            logits = (h @ weight.T).float()
            if temperature != 1.0:
                logits.div_(temperature)
            log_probs = logits.sub_(lse[start:end, None])           # in place: z - lse = log p
            grad_z = log_probs.exp()                                  # p
            if use_entropy:
                ge = grad_entropy[start:end].float()
                # the log_probs buffer becomes the entropy term: -ge * p * (log p + H)
                log_probs.add_(entropy[start:end, None]).mul_(grad_z).mul_(-ge[:, None])
                grad_z.mul_(-g[:, None]).add_(log_probs)
            else:
                grad_z.mul_(-g[:, None])                               # -g * p
            grad_z.scatter_add_(-1, targets[start:end, None], g[:, None])  # + g * onehot(y)
            del log_probs, logits
            if temperature != 1.0:
                grad_z.div_(temperature)
            if weight.dtype == torch.float32:
                if grad_hidden is not None:
                    torch.mm(grad_z, weight, out=grad_hidden[start:end])
                if grad_weight is not None:
                    grad_weight.addmm_(grad_z.T, h.float())
            else:
                # bf16/fp16 weights: both matmuls in the weight's dtype (what autograd through the model's own
                # head does) instead of fp32 ones, which run at a fraction of a GPU's bf16 speed; the weight
                # gradient is still summed over chunks in fp32
                grad_z = grad_z.to(weight.dtype)
                if grad_hidden is not None:
                    torch.mm(grad_z, weight, out=grad_hidden[start:end])
                if grad_weight is not None:
                    grad_weight.add_(torch.mm(grad_z.T, h))
            del grad_z
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def fused_head_weight(lm_head: nn.Module, logit_transform) -> torch.Tensor | None:
    """The weight for the fused path: a bias-free ``nn.Linear`` and no architecture-specific logit transform.
    None means: use the checkpointed path.

    A ZeRO-3 partition of a trained head takes the checkpointed path (its hooks gather it for the forward and
    again for the recompute in backward). A partitioned *frozen* head (LoRA) is gathered here once and a full,
    detached copy returned (the head gets no gradient, so the fused backward needs no parameter): under the
    checkpointed path the backward's recompute met the partitioned frozen weight and failed
    (``CheckpointError: Recomputed values ... have different metadata``, docs/lora.md)."""
    if logit_transform is not None or type(lm_head) is not nn.Linear or lm_head.bias is not None:
        return None
    weight = lm_head.weight
    if hasattr(weight, "ds_id"):
        if weight.requires_grad:
            return None
        import deepspeed

        with deepspeed.zero.GatheredParameters([weight]):
            full = weight.detach().clone()
        return full if full.dim() == 2 else None
    if weight.dim() != 2:
        return None
    return weight
