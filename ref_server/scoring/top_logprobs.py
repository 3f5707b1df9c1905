"""Top-k next-token logprobs of a causal LM (inference only), the chunked way :mod:`shared.forward.logprobs` computes
per-token logprobs: the backbone runs once, and the LM head's logits live one chunk of tokens at a time while they
are reduced to ``logsumexp``, the target's logit and ``topk``, never as a ``[B, T, V]`` tensor.

What the ref server's OpenAI-style ``/v1/completions`` (``logprobs``, ``echo``) answers with. Positions, layouts
(padded / packed) and chunk sizes are those of :func:`shared.forward.logprobs.sequence_logprobs`, and a target's logprob
comes from the same logits expression, so both endpoints agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shared.forward.lm_head import fused_head_weight
from shared.forward.logit_transform import final_logit_transform
from shared.forward.logprobs import chunk_tokens_for, run_backbone
from shared.forward.model_parts import head_vocab_size
from shared.forward.packing import PackingMode
from shared.tensors.masks import lengths_to_mask


@dataclass
class TopLogprobs:
    """Result of :func:`sequence_top_logprobs` (inference only, no autograd).

    ``logprobs [B, L]`` is laid out as in :class:`shared.forward.logprobs.TokenLogprobs`. ``top_logprobs``/``top_ids
    [B, L + 1, k]`` hold, at column j of row i, the k most likely next tokens (logprob, id; most likely first) of the
    distribution that predicts column j's completion token; column ``completion_lengths[i]`` is the distribution
    after the row's last token (the greedy continuation is ``top_ids[i, completion_lengths[i], 0]``). Padding
    columns are 0.
    """

    logprobs: torch.Tensor
    top_logprobs: torch.Tensor
    top_ids: torch.Tensor
    completion_lengths: torch.Tensor


def top_logprobs_from_hidden(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    targets: torch.Tensor,
    *,
    k: int,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    logit_transform=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunked ``log softmax(lm_head(hidden) / temperature)``: the targets' logprobs and the top ``k`` of each row.

    Returns fp32 ``[N]`` target logprobs, fp32 ``[N, k]`` top logprobs (descending) and int64 ``[N, k]`` their ids.
    Each chunk's logits are reduced to ``logsumexp``, the target's logit and ``topk`` while they live, so peak extra
    memory is a few ``[chunk, V]`` tensors, never ``[N, V]``. A target's logprob and the same token's top-k entry
    come from the same logits and the same subtraction, so they are bit-identical (a greedy token's logprob equals
    ``top[:, 0]`` exactly). ``k`` is capped at the vocabulary size. No gradients.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [N, H] and targets [N], got {tuple(hidden.shape)}, {tuple(targets.shape)}")
    weight = fused_head_weight(lm_head, logit_transform)
    vocab = head_vocab_size(lm_head)
    if vocab is None:
        raise TypeError(f"cannot tell the vocabulary size of {type(lm_head).__name__}")
    if chunk_tokens is None:
        chunk_tokens = chunk_tokens_for(vocab, device=hidden.device)
    k = min(k, vocab)
    transform = logit_transform or (lambda logits: logits)
    n = hidden.shape[0]
    logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
    top_values = torch.empty(n, k, dtype=torch.float32, device=hidden.device)
    top_ids = torch.empty(n, k, dtype=torch.long, device=hidden.device)
    with torch.no_grad():
        for start in range(0, n, chunk_tokens):
            end = min(start + chunk_tokens, n)
            h = hidden[start:end]
            # the same logits expression as the fused path of shared.forward.logprobs.logprobs_from_hidden, so that
            # /v1/logprobs agrees
            logits = (h @ weight.T).float() if weight is not None else transform(lm_head(h).float())
            if temperature != 1.0:
                logits.div_(temperature)
            lse = torch.logsumexp(logits, dim=-1)
            logp[start:end] = logits.gather(-1, targets[start:end, None]).squeeze(-1) - lse
            values, ids = logits.topk(k, dim=-1)
            top_values[start:end] = values - lse[:, None]
            top_ids[start:end] = ids
            del logits, values, ids
    return logp, top_values, top_ids


def sequence_top_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    prompt_lengths: torch.Tensor,
    completion_lengths: torch.Tensor | None = None,
    *,
    k: int,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    layout: PackingMode = "padded",
) -> TopLogprobs:
    """Completion tokens' logprobs plus the top ``k`` next tokens at each of them and after the row's last token.

    Same layout and positions as :func:`shared.forward.logprobs.sequence_logprobs` (see :class:`TopLogprobs` for the extra
    column). With ``prompt_lengths`` 1 every token but the first is scored: what an OpenAI-style ``echo`` with
    ``logprobs`` needs.
    """
    with torch.no_grad():
        out = run_backbone(model, input_ids, prompt_lengths, completion_lengths, layout)
    prompt_lengths, completion_lengths = out.prompt_lengths, out.completion_lengths
    seq_len = input_ids.shape[1]
    width = (int(completion_lengths.max()) if completion_lengths.numel() else 0) + 1
    rows, cols = lengths_to_mask(completion_lengths + 1, width).nonzero(as_tuple=True)
    positions = prompt_lengths[rows] + cols - 1               # the hidden state at p predicts the token at p + 1
    has_target = cols < completion_lengths[rows]
    targets = torch.where(has_target, input_ids[rows, (positions + 1).clamp(max=seq_len - 1)], 0)
    logp, top_values, top_ids = top_logprobs_from_hidden(
        out.hidden_at(rows, positions), out.head, targets, k=k, temperature=temperature, chunk_tokens=chunk_tokens,
        logit_transform=final_logit_transform(model))
    batch, k = input_ids.shape[0], top_values.shape[1]
    logprobs = logp.new_zeros(batch, width - 1).index_put((rows[has_target], cols[has_target]), logp[has_target])
    top = top_values.new_zeros(batch, width, k).index_put((rows, cols), top_values)
    ids = top_ids.new_zeros(batch, width, k).index_put((rows, cols), top_ids)
    return TopLogprobs(logprobs=logprobs, top_logprobs=top, top_ids=ids, completion_lengths=completion_lengths)
