"""Loading the reference model behind a :class:`ref_server.scoring.scorer.ReferenceScorer`: for the hub's own scoring
(``ref_server.server``) and for a joined scorer (``grpo scorer``, which imports nothing of the HTTP server)."""

from __future__ import annotations

from pathlib import Path

import torch

from ref_server.scoring.scorer import ReferenceScorer
from shared.config.schema import RefServerConfig
from shared.devices import default_dtype, resolve_device
from shared.errors import UsageError
from shared.forward.logit_transform import final_logit_transform


class ModelLoadError(UsageError):
    """The reference model folder is missing or unreadable; the message names the folder."""


def load_reference_model(path: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"reference model folder {path!r} has no config.json")
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load reference model from {path!r}: {exc}") from None
    model.to(device).eval().requires_grad_(False)
    final_logit_transform(model)  # probed now: an architecture whose logits cannot be reproduced fails the start
    return model


def load_reference_scorer(cfg: RefServerConfig, device: str | None = None, *,
                          model_dir: str | None = None) -> tuple[ReferenceScorer, int | None]:
    """ref_server.model (or ``model_dir``: the teacher, ref_server.teacher_model) loaded on ``device`` (default
    ref_server.device) behind a micro-batching ReferenceScorer (the hub's own with local scoring, or a joined
    scorer's: ``grpo scorer``), and the model's context (None: unknown)."""
    torch_device = resolve_device(device or cfg.device)
    model = load_reference_model(model_dir or cfg.model, torch_device, default_dtype(cfg.dtype, torch_device))
    text_config = model.config.get_text_config()
    max_context = getattr(text_config, "max_position_embeddings", None)
    scorer = ReferenceScorer(model, vocab_size=text_config.vocab_size, max_context=max_context or 2**31,
                             batch_tokens=cfg.batch_tokens, packing=cfg.packing, prefix_sharing=cfg.prefix_sharing)
    return scorer, max_context
