"""A causal LM as its two parts: the transformer body (hidden states) and the LM head.

The chunked logprobs run the body once and the head chunk by chunk; packing asks the body whether it reads row
boundaries from position ids. Both need the split, so it lives below both.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


def split_model(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The transformer body (returns hidden states) and the LM head of a Hugging Face causal LM."""
    head = model.get_output_embeddings()
    body = model.get_decoder() if hasattr(model, "get_decoder") else None
    if body is None or body is model:
        body = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if head is None or body is None:
        raise TypeError(f"{type(model).__name__} does not expose a decoder body and an LM head")
    return body, head


def head_vocab_size(head: nn.Module) -> int | None:
    """The LM head's vocabulary: its ``out_features``, else its weight's rows (None: it has neither)."""
    weight = getattr(head, "weight", None)
    return getattr(head, "out_features", None) or (weight.shape[0] if weight is not None else None)


@contextmanager
def probing(model: nn.Module) -> Iterator[None]:
    """A probe forward of ``model``: eval mode (no dropout) and no gradients, its training mode given back after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)
