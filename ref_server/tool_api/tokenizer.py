"""The model folder's tokenizer as the server serves it: :class:`ServedTokenizer` (text prompts of
``/v1/completions``, ``/tokenize`` and ``/detokenize``, token texts in logprob answers)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np

log = logging.getLogger("grpo.ref_server.tokenizer")


class ServedTokenizer:
    """The model folder's Hugging Face tokenizer plus a per-id text table for building logprob answers.

    ``pieces[id]`` is the text of token ``id`` decoded alone (special tokens kept), for every id below the model's
    vocabulary size (ids the tokenizer does not know decode to ""). Answers index it with numpy arrays of ids, so
    no Python loop runs per token. For byte-level BPE and SentencePiece vocabularies a piece decoded alone can
    differ from its text in context (a byte of a multi-byte character, a dropped leading space), as in other
    servers' token lists; ``text`` in answers is always decoded whole.
    """

    def __init__(self, tokenizer, vocab_size: int, max_context: int | None) -> None:
        self.hf = tokenizer
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.eos_token_id: int | None = tokenizer.eos_token_id
        self._lock = threading.Lock()
        self._pieces: np.ndarray | None = None
        self._piece_lengths: np.ndarray | None = None

    @classmethod
    def load(cls, folder: str, vocab_size: int, max_context: int | None) -> ServedTokenizer | None:
        """The folder's tokenizer, or None (logged) when it has none that ``AutoTokenizer`` can load."""
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(Path(folder))
        except (OSError, ValueError, TypeError) as exc:
            log.warning("no tokenizer in %s (%s): /v1/completions and /tokenize answer 503", folder, exc)
            return None
        return cls(tokenizer, vocab_size, max_context)

    def _build_table(self) -> None:
        ids = [[i] for i in range(self.vocab_size)]
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is not None:  # one call into Rust
            texts = backend.decode_batch(ids, skip_special_tokens=False)
        else:
            texts = self.hf.batch_decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        pieces = np.empty(self.vocab_size, dtype=object)
        pieces[:] = texts
        self._piece_lengths = np.fromiter((len(t) for t in texts), dtype=np.int64, count=self.vocab_size)
        self._pieces = pieces

    def pieces(self, ids: np.ndarray) -> np.ndarray:
        """Token texts of ``ids`` (any shape) as an object array of the same shape."""
        if self._pieces is None:
            with self._lock:
                if self._pieces is None:
                    self._build_table()
        return self._pieces[ids]

    def piece_lengths(self, ids: np.ndarray) -> np.ndarray:
        self.pieces(ids[:0])
        return self._piece_lengths[ids]

    def encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        return self.hf(texts, add_special_tokens=add_special_tokens, return_attention_mask=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def info(self) -> dict:
        hf = self.hf
        info = {"tokenizer_class": type(hf).__name__, "eos_token": hf.eos_token, "bos_token": hf.bos_token,
                "pad_token": hf.pad_token, "unk_token": hf.unk_token, "eos_token_id": hf.eos_token_id,
                "bos_token_id": hf.bos_token_id, "vocab_size": self.vocab_size,
                "model_max_length": self.max_context}
        if getattr(hf, "chat_template", None):
            info["chat_template"] = hf.chat_template
        return info
