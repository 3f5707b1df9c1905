"""Per-token logprobs (and entropy) of a causal LM's completion tokens, without a ``[B, T, V]`` log-softmax.

The naive way, ``model(ids).logits.log_softmax(-1).gather(...)``, materialises two ``[B, T, V]`` float tensors:
at vocab 151936 and T 4096 that is 5 GB for one sequence, and autograd keeps them for backward. Here the
backbone's hidden states are taken once, only the completion positions are kept, and the LM head is applied in
chunks of tokens: each chunk's logits live only while that chunk is reduced to ``logsumexp`` and the target's
logit. With gradients on, each chunk is wrapped in activation checkpointing, so backward recomputes one chunk's
logits at a time instead of keeping all of them.

Positions: row i of ``input_ids`` is ``prompt (prompt_lengths[i] tokens) + completion (completion_lengths[i]
tokens) + right padding``; the result's row i holds, at column j, ``log p(token at prompt_lengths[i] + j |
everything before it)`` computed from ``logits / temperature``.

Layout of the backbone's forward (``layout``): ``padded`` runs the ``[B, T]`` rows with an attention mask;
``packed`` concatenates the rows without their padding into one sequence with per-row position ids
(:mod:`shared.forward.packing`); ``auto`` picks per call (:func:`shared.forward.packing.choose_layout`). The results are the same.

Chunk size: :func:`default_chunk_bytes` per device, 128 MiB of fp32 logits on CPU and more on a GPU (where the
LM-head matmul needs bigger chunks to run at matmul speed, and memory allows them).

The LM head itself (the fused linear-head path with its hand-written backward) is in :mod:`shared.forward.lm_head`;
what each architecture's forward does to the head's output, probed on the model, in
:mod:`shared.forward.logit_transform`. Top-k next-token logprobs (inference only) are in
:mod:`ref_server.scoring.top_logprobs`, built on the same backbone pass (:func:`run_backbone`) and chunked head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shared.forward.extra_targets import logprobs_with_extra_targets
from shared.forward.lm_head import LinearHeadLogprobs, fused_head_weight
from shared.forward.logit_transform import final_logit_transform
from shared.forward.model_parts import head_vocab_size, split_model
from shared.forward.packing import PackingMode, choose_layout, pack_rows
from shared.forward.prefix_sharing import PrefixRows, shared_prefix_hidden
from shared.forward.row_lengths import RowLengths, ragged_positions, row_lengths
from shared.tensors.masks import completion_mask, lengths_to_mask

# Default working-set size of one chunk's fp32 logits on CPU. 128 MiB is 220 tokens at vocab 151936: big enough
# that the LM-head matmul stays efficient, small enough that a chunk's temporaries are a few hundred MB at most.
DEFAULT_CHUNK_BYTES = 128 * 2**20
# On a GPU: 512 MiB (883 tokens at vocab 151936). A GPU's matmul needs more rows to reach its speed, and each
# chunk costs a handful of kernel launches; capped at 1/32 of the free memory (a chunk's temporaries are ~3-4x
# its logits).
GPU_CHUNK_BYTES = 512 * 2**20


@dataclass
class TokenLogprobs:
    """Result of :func:`sequence_logprobs`: ``[B, L]`` left-aligned completion tensors, 0 at padding."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    completion_lengths: torch.Tensor
    extra_logprobs: torch.Tensor | None = None  # [B, L, k] with ``extra_targets`` (sequence_logprobs), else None

    @property
    def mask(self) -> torch.Tensor:
        return lengths_to_mask(self.completion_lengths, self.logprobs.shape[1])


def default_chunk_bytes(device: torch.device | str) -> int:
    """Bytes of one chunk's fp32 logits: :data:`DEFAULT_CHUNK_BYTES` on CPU, :data:`GPU_CHUNK_BYTES` on CUDA
    (less when free memory is short, never below the CPU size)."""
    device = torch.device(device)
    if device.type != "cuda":
        return DEFAULT_CHUNK_BYTES
    free, _total = torch.cuda.mem_get_info(device)
    return max(DEFAULT_CHUNK_BYTES, min(GPU_CHUNK_BYTES, free // 32))


def chunk_tokens_for(vocab_size: int, max_chunk_bytes: int | None = None, device: torch.device | str = "cpu") -> int:
    """Tokens per chunk so that one chunk's fp32 logits take at most ``max_chunk_bytes`` (default: the
    device's :func:`default_chunk_bytes`)."""
    if max_chunk_bytes is None:
        max_chunk_bytes = default_chunk_bytes(device)
    return max(1, max_chunk_bytes // (4 * vocab_size))


def logprobs_from_hidden(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int | None = None,
    logit_transform=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(lm_head(hidden) / temperature)[targets]`` for ``hidden [N, H]``, ``targets [N]``, in chunks.

    .. math::  \\log p(y_n) = z_{n,y_n} - \\log\\sum_v e^{z_{n,v}},\\quad z = \\mathrm{head}(h)/\\tau
    .. math::  H_n = \\log\\sum_v e^{z_{n,v}} - \\sum_v p_{n,v} z_{n,v}

    Returns fp32 ``[N]`` logprobs and, with ``with_entropy``, fp32 ``[N]`` entropies of the tempered distribution.
    Peak extra memory is a few chunk-sized ``[chunk, V]`` fp32 tensors, never ``[N, V]``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [N, H] and targets [N], got {tuple(hidden.shape)}, {tuple(targets.shape)}")
    if chunk_tokens is None:
        chunk_tokens = _head_chunk_tokens(lm_head, hidden.device)

    weight = fused_head_weight(lm_head, logit_transform)
    if weight is not None:
        logprobs, entropy = LinearHeadLogprobs.apply(hidden, weight, targets, float(temperature), chunk_tokens,
                                                      with_entropy)
        return logprobs, entropy if with_entropy else None
    transform = logit_transform or (lambda logits: logits)

    def reduce_chunk(h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tempered_logprobs(transform(lm_head(h).float()), y, temperature, with_entropy)

    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in lm_head.parameters())
    )
    logprobs, entropy = _reduce_in_chunks(reduce_chunk, hidden, targets, chunk_tokens, checkpointed=needs_grad)
    return logprobs, entropy if with_entropy else None


def _head_chunk_tokens(lm_head: nn.Module, device: torch.device) -> int:
    """Tokens per chunk for ``lm_head``'s vocabulary (its ``out_features``, its weight's rows, else 2^17)."""
    return chunk_tokens_for(head_vocab_size(lm_head) or 2**17, device=device)


def tempered_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                      with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each target and entropy of each row of ``logits [n, V]`` (fp32) divided by ``temperature``.

    .. math::  z = \\mathrm{logits}/\\tau,\\quad \\log p(y_n) = z_{n,y_n} - \\log\\sum_v e^{z_{n,v}},\\quad
               H_n = \\log\\sum_v e^{z_{n,v}} - \\sum_v \\mathrm{softmax}(z_n)_v\\, z_{n,v}

    Both ``[n]``; the entropy is zeros without ``with_entropy`` (not computed).
    """
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    probs = torch.softmax(logits, dim=-1)
    return logp, lse - (probs * logits).sum(dim=-1)


def _reduce_in_chunks(reduce_chunk, hidden: torch.Tensor, targets: torch.Tensor, chunk_tokens: int, *,
                      checkpointed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``reduce_chunk(hidden[i:j], targets[i:j])`` over chunks of ``chunk_tokens`` rows, concatenated (fp32 ``[N]``
    each, empty for no rows); ``checkpointed``: under activation checkpointing, so backward recomputes one chunk's
    logits at a time."""
    logps, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, y = hidden[start:start + chunk_tokens], targets[start:start + chunk_tokens]
        if checkpointed:
            logp, ent = checkpoint(reduce_chunk, h, y, use_reentrant=False)
        else:
            logp, ent = reduce_chunk(h, y)
        logps.append(logp)
        entropies.append(ent)
    empty = hidden.new_zeros(0, dtype=torch.float32)
    return (torch.cat(logps) if logps else empty), (torch.cat(entropies) if entropies else empty)


@dataclass
class _Backbone:
    """The backbone's output for a batch of rows: ``hidden_at(rows, positions)`` gives ``[N, H]`` hidden states
    of those (row, position in row) pairs whichever layout ran."""

    lengths: RowLengths
    hidden: torch.Tensor               # [B, T, H] padded, [N, H] packed
    head: nn.Module
    offsets: torch.Tensor | None       # packed: where each row starts in ``hidden``

    @property
    def prompt_lengths(self) -> torch.Tensor:
        return self.lengths.prompt_on_device

    @property
    def completion_lengths(self) -> torch.Tensor:
        return self.lengths.completion_on_device

    def hidden_at(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.offsets is None:
            return self.hidden[rows, positions]
        return self.hidden[self.offsets[rows] + positions]


def run_backbone(model: nn.Module, input_ids: torch.Tensor, prompt_lengths, completion_lengths,
                 layout: PackingMode = "padded") -> _Backbone:
    """Lengths checked (:func:`shared.forward.row_lengths.row_lengths`; completions default to the rest of each row), the
    backbone's last hidden states (padding masked out of attention, or removed by packing) and the LM head.

    Lengths given as lists are not read from the device at all; device tensors come to the host in one copy."""
    return _run_backbone(model, input_ids, row_lengths(input_ids, prompt_lengths, completion_lengths), layout)


def _run_backbone(model: nn.Module, input_ids: torch.Tensor, lengths: RowLengths, layout: PackingMode) -> _Backbone:
    body, head = split_model(model)
    totals = lengths.totals
    if layout != "padded" and choose_layout(model, totals, layout, body) == "packed":
        packed = pack_rows(input_ids, totals)
        # no attention mask and no cache: transformers then reads the row boundaries from the position ids
        hidden = body(input_ids=packed.input_ids, position_ids=packed.position_ids,
                      use_cache=False).last_hidden_state[0]
        return _Backbone(lengths, hidden, head, packed.offsets)
    # the mask from the device lengths (lengths_to_mask would read them back to check them: done on the host)
    on_device = lengths.prompt_on_device + lengths.completion_on_device
    attention_mask = completion_mask(on_device, input_ids.shape[1]).long()
    hidden = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    return _Backbone(lengths, hidden, head, None)


def sequence_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    prompt_lengths: torch.Tensor | Sequence[int],
    completion_lengths: torch.Tensor | Sequence[int] | None = None,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int | None = None,
    layout: PackingMode = "padded",
    prefix: PrefixRows | None = None,
    extra_targets: torch.Tensor | None = None,
) -> TokenLogprobs:
    """Per-token logprobs of each row's completion under ``model`` (see the module docstring for layout).

    ``completion_lengths`` defaults to ``T - prompt_lengths`` (no padding). Returns ``[B, max(completion)]``.
    Lengths given as lists (the learner's host copies) are never read from the device, so nothing here waits for a
    GPU; tensors on the device come to the host in one copy (:func:`shared.forward.row_lengths.row_lengths`).
    ``prefix`` (shared.forward.prefix_sharing.prefix_rows): rows that continue one prompt share one pass of it (exact; the
    layout is then padded). Gradients flow when autograd is on; wrap in ``torch.no_grad()`` for scoring.
    ``extra_targets`` ``[B, >= max(completion), k]`` int ids, left-aligned like the result: also the logprobs of
    those ``k`` ids at each completion position (the distribution that predicts that position's token), returned as
    ``extra_logprobs [B, max(completion), k]`` (0 at padding), from the same chunks
    (:mod:`shared.forward.extra_targets`; gradients flow through them too).
    """
    lengths = row_lengths(input_ids, prompt_lengths, completion_lengths)
    if prefix is not None:
        body, head = split_model(model)
        out = shared_prefix_hidden(body, head, input_ids, lengths, prefix)
    else:
        out = _run_backbone(model, input_ids, lengths, layout)
    # every completion token's (row, column), row by row, sized on the host: no read of a device value
    shape = (len(lengths.completion), max(lengths.completion, default=0))
    rows, cols = ragged_positions(lengths.completion, lengths.completion_on_device)
    # The token at position p is predicted by the hidden state at p - 1.
    target_positions = lengths.prompt_on_device[rows] + cols
    hidden, targets = out.hidden_at(rows, target_positions - 1), input_ids[rows, target_positions]
    extra = None
    if extra_targets is None:
        logp, entropy = logprobs_from_hidden(hidden, out.head, targets, temperature=temperature,
                                             with_entropy=with_entropy, chunk_tokens=chunk_tokens,
                                             logit_transform=final_logit_transform(model))
    else:
        if extra_targets.dim() != 3 or extra_targets.shape[0] != shape[0] or extra_targets.shape[1] < shape[1]:
            raise ValueError(f"extra_targets must be [B, >= L, k] = [{shape[0]}, >= {shape[1]}, k], got "
                             f"{tuple(extra_targets.shape)}")
        logp, entropy, extra = logprobs_with_extra_targets(
            hidden, out.head, targets, extra_targets[rows, cols], temperature=temperature, with_entropy=with_entropy,
            chunk_tokens=chunk_tokens or _head_chunk_tokens(out.head, hidden.device),
            logit_transform=final_logit_transform(model))
        extra = extra.new_zeros(*shape, extra.shape[1]).index_put((rows, cols), extra)
    logprobs = logp.new_zeros(shape).index_put((rows, cols), logp)
    entropies = entropy.new_zeros(shape).index_put((rows, cols), entropy) if entropy is not None else None
    return TokenLogprobs(logprobs=logprobs, entropy=entropies, completion_lengths=lengths.completion_on_device,
                         extra_logprobs=extra)


def naive_sequence_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    prompt_lengths: torch.Tensor,
    completion_lengths: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The reference the chunked path is tested against: full ``log_softmax`` over ``[B, T, V]`` + gather.

    Only for tests and benchmarks: it materialises the whole vocabulary distribution of every position.
    """
    prompt_lengths = torch.as_tensor(prompt_lengths)
    if completion_lengths is None:
        completion_lengths = input_ids.shape[1] - prompt_lengths
    completion_lengths = torch.as_tensor(completion_lengths)
    attention_mask = lengths_to_mask(prompt_lengths + completion_lengths, input_ids.shape[1]).long()
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()
    all_logprobs = (logits[:, :-1] / temperature).log_softmax(dim=-1)
    per_position = all_logprobs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [B, T-1]
    max_completion = int(completion_lengths.max()) if completion_lengths.numel() else 0
    out = torch.zeros(input_ids.shape[0], max_completion)
    for i, (p, c) in enumerate(zip(prompt_lengths.tolist(), completion_lengths.tolist())):
        out[i, :c] = per_position[i, p - 1:p - 1 + c]
    return out
