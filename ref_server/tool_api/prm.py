"""A local process reward model in vLLM's ``/pooling`` shape: :class:`PRMScorer` (for tests and for users
without a GPU; generator/rewards/prm.py is the client, docs/process-rewards.md the guide).

It holds a transformers ``AutoModelForTokenClassification`` (2 labels for Qwen2.5-Math-PRM's layout) whose
tokenizer has the step tag as one token. For each input it runs one forward pass, softmaxes each token's logits
and keeps the rows at the step tag's positions (``per_token=False``: what vLLM 0.32.0's STEP pooling answers with
``step_tag_id`` set) or every token's row (``per_token=True``: STEP pooling without ``step_tag_id``). Inputs are
text prompts or one chat rendered with the tokenizer's chat template, as vLLM's pooling chat request is.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from shared.errors import UsageError


class PRMLoadError(UsageError):
    """The PRM folder is missing, unreadable or its tokenizer lacks the step tag; the message says which."""


class PRMInputError(ValueError):
    """An input the stand-in refuses (too many, too long, no chat template); ``status`` is the HTTP code."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class PRMScorer:
    """A token-classification model and its tokenizer, pooled at the step tag like vLLM's STEP pooler."""

    def __init__(self, model, tokenizer, *, name: str, step_tag: str = "<extra_0>", per_token: bool = False,
                 max_inputs: int = 256, max_tokens: int = 262144, max_request_bytes: int = 64 * 2**20) -> None:
        tag_ids = tokenizer.encode(step_tag, add_special_tokens=False)
        if len(tag_ids) != 1:
            raise PRMLoadError(f"the PRM tokenizer encodes the step tag {step_tag!r} as {len(tag_ids)} tokens "
                               f"{tag_ids}; it must be one (add it as a special token)")
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.step_tag, self.step_tag_id, self.per_token = step_tag, tag_ids[0], per_token
        self.max_inputs, self.max_tokens, self.max_request_bytes = max_inputs, max_tokens, max_request_bytes
        self.max_context = getattr(model.config, "max_position_embeddings", None) or 2**31
        self.device = next(model.parameters()).device
        self._lock = threading.Lock()  # one forward at a time: requests run in FastAPI's thread pool

    @classmethod
    def load(cls, folder: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
             **kwargs) -> PRMScorer:
        from transformers import AutoModelForTokenClassification, AutoTokenizer

        if not (Path(folder) / "config.json").is_file():
            raise PRMLoadError(f"PRM folder {folder!r} has no config.json")
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder)
            model = AutoModelForTokenClassification.from_pretrained(folder, dtype=dtype)
        except (OSError, ValueError) as exc:
            raise PRMLoadError(f"cannot load the PRM from {folder!r}: {exc}") from None
        model.to(device).eval().requires_grad_(False)
        return cls(model, tokenizer, name=str(folder), **kwargs)

    def encode_text(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self.tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
        """One chat through the tokenizer's chat template (vLLM's pooling chat request: one conversation)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise PRMInputError(400, "messages: the PRM's tokenizer has no chat template; send 'input' text")
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 - a template error is the request's fault: 400 with its text
            raise PRMInputError(400, f"messages: the chat template failed: {exc}") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check(self, ids: list[list[int]]) -> None:
        """A 413 naming the limit when the inputs are too many or too long, a 400 when one is empty."""
        if len(ids) > self.max_inputs:
            raise PRMInputError(413, f"input: {len(ids)} inputs exceed the limit of {self.max_inputs}")
        total = sum(len(row) for row in ids)
        if total > self.max_tokens:
            raise PRMInputError(413, f"input: {total} tokens exceed the limit of {self.max_tokens} per request")
        for i, row in enumerate(ids):
            if not row:
                raise PRMInputError(400, f"input[{i}] is empty")
            if len(row) > self.max_context:
                raise PRMInputError(413, f"input[{i}] has {len(row)} tokens; the model's context is "
                                    f"{self.max_context}")

    @torch.no_grad()
    def pool(self, ids: list[list[int]], activation: bool = True) -> list[list[list[float]]]:
        """Per input: class probabilities (logits without ``activation``) at each step tag, or at every token
        with ``per_token``."""
        self.check(ids)
        out = []
        with self._lock:
            for row in ids:  # one at a time: no padding, so the numbers equal a plain forward of the row
                tokens = torch.tensor([row], device=self.device)
                logits = self.model(input_ids=tokens).logits[0].float()
                probs = logits.softmax(-1) if activation else logits
                if not self.per_token:
                    probs = probs[tokens[0] == self.step_tag_id]
                out.append(probs.cpu().tolist())
        return out
