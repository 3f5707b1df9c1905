"""Padding-free batches: rows packed into one sequence, and micro-batches cut by a token budget.

A padded micro-batch of rows with lengths ``l_1..l_B`` costs ``B x max(l)`` token positions in every linear layer;
packed, the rows are concatenated into one ``[1, sum(l)]`` sequence whose position ids restart at 0 for each row.
Transformers (5.x, ``masking_utils``) reads row boundaries from such position ids when no attention mask and no
KV cache are given: flash-attention 2/3 run a variable-length kernel over the rows, flex attention a block-sparse
mask, and SDPA / eager a dense ``[N, N]`` block-diagonal causal mask. So packing is exact for every
implementation, but with a dense mask attention costs ``N^2`` instead of ``sum(B x max(l)^2)``: packing pays
off there only when the linear layers dominate, which :func:`choose_layout` estimates per micro-batch.

Whether a model honours packed position ids is probed once per model (:func:`supports_packing`): two copies of
the same short row packed together must give the same hidden states; a model whose mask ignores position ids
(or that forces a KV cache) lets the second copy attend to the first and fails the probe, and then every batch
is padded. Each layout is logged (INFO) the first time a model uses it.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from shared.forward.model_parts import probing, split_model
from shared.forward.row_lengths import ragged_positions
from shared.tensors.transfers import host_values, to_device

log = logging.getLogger("grpo.packing")

PackingMode = Literal["auto", "packed", "padded"]
Layout = Literal["packed", "padded"]

# attention implementations whose packed path touches only each row's own (query, key) pairs
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3", "flex_attention")

_support: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
_logged_layouts: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


@dataclass
class PackedRows:
    """``B`` right-padded rows as one sequence: ``input_ids``/``position_ids`` ``[1, N]`` with ``N = sum(lengths)``;
    row i occupies ``offsets[i] : offsets[i] + lengths[i]``."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    offsets: torch.Tensor
    lengths: torch.Tensor

    def index(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat indices in the packed sequence of ``(row, position within the row)`` pairs."""
        return self.offsets[rows] + positions


def pack_rows(input_ids: torch.Tensor, lengths: torch.Tensor | Sequence[int]) -> PackedRows:
    """Concatenate the first ``lengths[i]`` tokens of each row of ``input_ids [B, T]``; positions restart per row.

    With ``lengths`` a list (host values) nothing is read back from the device: the packed size is their sum and
    the token indices are built there with that size (:func:`shared.forward.row_lengths.ragged_positions`); a tensor comes
    to the host once."""
    (host,) = host_values(lengths)
    width = input_ids.shape[1]
    if any(n < 0 or n > width for n in host):
        raise ValueError(f"row lengths must be within 0..{width} (the rows' width), got {host}")
    on_device = to_device(lengths if torch.is_tensor(lengths) else host, input_ids.device)
    rows, positions = ragged_positions(host, on_device)
    offsets = torch.cumsum(on_device, 0) - on_device
    return PackedRows(input_ids=input_ids.reshape(-1)[rows * width + positions][None], position_ids=positions[None],
                      offsets=offsets, lengths=on_device)


def attention_implementation(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    return str(getattr(config, "_attn_implementation", None) or "eager")


def _is_varlen(implementation: str) -> bool:
    return any(name in implementation for name in VARLEN_ATTENTION) or "flash" in implementation


def supports_packing(model: nn.Module, body: nn.Module | None = None) -> bool:
    """Whether ``model`` keeps packed rows apart (probed once per model, then cached).

    The probe: the same 4-token row twice in one packed sequence; the second copy's hidden states must equal
    the first's (to 2% of their scale, which bf16 meets and attending to the other copy does not)."""
    if model in _support:
        return _support[model]
    if body is None:
        body = split_model(model)[0]
    param = next(model.parameters())
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)
    row = (torch.arange(4, device=param.device) * 7 + 3) % max(vocab, 2)
    ids = row.repeat(2)[None]
    positions = torch.arange(4, device=param.device).repeat(2)[None]
    try:
        with probing(model):
            hidden = body(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state[0].float()
    except (TypeError, ValueError, RuntimeError) as exc:
        log.warning("packed rows: probe forward failed (%s); batches stay padded", exc)
        supported = False
    else:
        first, second = hidden[:4], hidden[4:]
        scale = first.abs().max().clamp_min(1e-6)
        supported = bool(((first - second).abs().max() / scale) < 0.02)
    log.info("packed rows: %s with %s attention", "supported" if supported else "NOT supported (padding instead)",
             attention_implementation(model))
    _support[model] = supported
    return supported


def linear_flops_per_token(model: nn.Module) -> float:
    """~2 x the parameters a token passes through in the body (embeddings excluded: a lookup, not a matmul)."""
    config = getattr(model, "config", None)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3: the full size
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = head is not None and head.weight is getattr(model.get_input_embeddings(), "weight", None)
    body = total - vocab * hidden * (1 if tied else 2)
    return 2.0 * max(body, 1)


def attention_flops_per_pair(model: nn.Module) -> float:
    """~4 x layers x (heads x head dim): QK^T and AV for one (query, key) pair."""
    config = getattr(model, "config", None)
    layers = int(getattr(config, "num_hidden_layers", 1) or 1)
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    head_dim = getattr(config, "head_dim", None) or int(getattr(config, "hidden_size", 1) or 1) // heads
    return 4.0 * layers * heads * int(head_dim)


def layout_costs(model: nn.Module, lengths: list[int]) -> dict[Layout, float]:
    """Estimated forward FLOPs of the padded and packed layouts (the LM head is the same in both)."""
    batch, width, total = len(lengths), max(lengths, default=0), sum(lengths)
    per_token, per_pair = linear_flops_per_token(model), attention_flops_per_pair(model)
    if _is_varlen(attention_implementation(model)):
        packed_pairs = sum(n * n for n in lengths)
    else:
        packed_pairs = total * total  # dense block-diagonal mask: every pair is computed, most masked out
    return {"padded": batch * width * per_token + batch * width * width * per_pair,
            "packed": total * per_token + packed_pairs * per_pair}


def choose_layout(model: nn.Module, lengths: list[int], mode: PackingMode, body: nn.Module | None = None) -> Layout:
    """``packed`` or ``padded`` for one micro-batch of rows with these token lengths.

    ``padded``: always padded. ``packed``: packed whenever the model supports it. ``auto``: packed when the model
    supports it and the estimate says it is cheaper (always with flash/flex attention when there is padding to
    save; with SDPA/eager only when the rows differ enough in length that the saved linear-layer work outweighs
    the dense mask's extra attention)."""
    if mode == "padded" or len(lengths) < 2 or min(lengths) == max(lengths):
        layout: Layout = "padded"  # nothing to remove (a single row, or rows of one length)
    elif not supports_packing(model, body):
        layout = "padded"
    elif mode == "packed":
        layout = "packed"
    else:
        costs = layout_costs(model, lengths)
        layout = "packed" if costs["packed"] < costs["padded"] else "padded"
    logged = _logged_layouts.setdefault(model, set())
    if layout not in logged:
        log.info("attention layout: %s rows (%s attention, packing mode %s; logged once per layout)", layout,
                 attention_implementation(model), mode)
        logged.add(layout)
    return layout


def micro_batch_cost(lengths: list[int], packed: bool) -> int:
    """Token positions a micro-batch of rows occupies: their sum packed, rows x longest row padded."""
    if not lengths:
        return 0
    return sum(lengths) if packed else len(lengths) * max(lengths)


def split_by_token_budget(lengths: list[int], budget: int | None, *, packed: bool, min_parts: int = 1,
                          parts: int | None = None) -> list[list[int]]:
    """Row indices of micro-batches, each at most ``budget`` token positions (:func:`micro_batch_cost`).

    First-fit over the rows from longest to shortest (a row longer than the budget goes alone), then, while there
    are fewer than ``min_parts`` (or exactly ``parts``, when given: every rank must run the same number of
    micro-batches) micro-batches, the costliest one with two or more rows is split in two halves balanced by
    tokens. Every row lands in exactly one micro-batch; within one, rows keep their original order."""
    if budget is not None and budget < 1:
        raise ValueError(f"the token budget must be >= 1, got {budget}")
    target = max(min_parts, parts or 0, 1)
    if target > len(lengths):
        raise ValueError(f"cannot split {len(lengths)} rows into {target} micro-batches")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    for i in order:
        for members in bins:
            if budget is None or micro_batch_cost([lengths[j] for j in members + [i]], packed) <= budget:
                members.append(i)
                break
        else:
            bins.append([i])
    if parts is not None and len(bins) > parts:
        raise ValueError(f"{len(bins)} micro-batches are needed to stay within {budget} tokens, more than the "
                         f"{parts} asked for")
    while len(bins) < target:
        splittable = [b for b in bins if len(b) > 1]
        biggest = max(splittable, key=lambda b: micro_batch_cost([lengths[j] for j in b], packed))
        bins.remove(biggest)
        halves: tuple[list[int], list[int]] = ([], [])
        for j in biggest:  # longest first: each row to the half with fewer tokens so far
            lighter = min(halves, key=lambda h: sum(lengths[k] for k in h))
            lighter.append(j)
        bins += [h for h in halves if h]
    return [sorted(b) for b in sorted(bins, key=min)]
