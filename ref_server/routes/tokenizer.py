"""The model folder's tokenizer over HTTP, in the shapes vLLM serves and lm-evaluation-harness discovers.

``GET /tokenizer_info`` (special tokens, context), ``POST /tokenize`` ``{"prompt", "add_special_tokens"}`` ->
``{"tokens": [...]}`` and ``POST /detokenize`` ``{"tokens": [...]}`` -> ``{"prompt": "..."}``. lm-eval's
``local-completions`` model uses them (``tokenizer_backend=remote``, picked automatically when both answer) to
count context tokens exactly as the server does. Errors here and on ``/v1/completions`` use the OpenAI shape
``{"error": {"message", "type", "param", "code"}}`` (:class:`OpenAIError`), not FastAPI's ``{"detail": ...}``.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pydantic_core
from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from ref_server.routes.common import State, read_body
from ref_server.state import ServerState

log = logging.getLogger("grpo.ref_server.tokenizer")
router = APIRouter(tags=["tokenizer"])


class OpenAIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 422: "invalid_request_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    @classmethod
    def from_http(cls, exc: HTTPException) -> OpenAIError:
        return cls(exc.status_code, str(exc.detail), headers=exc.headers)

    def response(self) -> Response:
        body = {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}
        return json_response(body, self.status, self.headers)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """JSON bytes built in Rust (pydantic-core; non-finite floats become null), skipping FastAPI's encoder."""
    return Response(pydantic_core.to_json(body), status_code=status, headers=headers, media_type="application/json")


def openapi_body(model: type[BaseModel]) -> dict:
    """OpenAPI ``requestBody`` of a JSON endpoint that parses its body itself."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


async def parse_json_body(request: Request, state: ServerState, model: type[BaseModel]):
    """The body validated as ``model``; a 413 or 400 :class:`OpenAIError` naming the first problem otherwise."""
    try:
        body = await read_body(request, state.max_request_bytes)
    except HTTPException as exc:
        raise OpenAIError.from_http(exc) from None
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        param = str(first["loc"][0]) if first["loc"] else None
        if param == "prompt" and len(first["loc"]) > 1:  # a union: name the accepted shapes, not each branch
            message = "prompt: must be a text, a list of texts, a list of token ids or a list of token-id lists"
        else:
            message = f"{'.'.join(str(part) for part in first['loc']) or 'body'}: {first['msg']}"
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 and param != "prompt" else ""
        raise OpenAIError(400, message + more, param=param) from None


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


def served_tokenizer(state: ServerState) -> ServedTokenizer:
    if state.scorer is None:
        raise OpenAIError(503, "no model is loaded (beta = 0 mode)", headers={"Retry-After": "60"})
    if state.tokenizer is None:
        raise OpenAIError(503, "the model folder has no tokenizer that transformers can load")
    return state.tokenizer


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    prompt: StrictStr = Field(description="Text to tokenize.")
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens (BOS) like encode does.")
    model: str | None = Field(None, description="Ignored: the server has one model.")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tokens: list[StrictInt] = Field(description="Token ids to decode (special tokens kept).")
    model: str | None = Field(None, description="Ignored: the server has one model.")


@router.get("/tokenizer_info")
async def tokenizer_info(state: State) -> Response:
    """The tokenizer's special tokens and the model's context (what lm-eval's remote tokenizer reads)."""
    try:
        return json_response(served_tokenizer(state).info())
    except OpenAIError as exc:
        return exc.response()


@router.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest))
async def tokenize(request: Request, state: State) -> Response:
    """``{"prompt": "text"}`` -> ``{"tokens": [ids], "count": n, "max_model_len": context}``."""
    try:
        tokenizer = served_tokenizer(state)
        body = await parse_json_body(request, state, TokenizeRequest)
        tokens = tokenizer.encode([body.prompt], body.add_special_tokens)[0]
    except OpenAIError as exc:
        return exc.response()
    return json_response({"tokens": tokens, "count": len(tokens), "max_model_len": state.max_context})


@router.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest))
async def detokenize(request: Request, state: State) -> Response:
    """``{"tokens": [ids]}`` -> ``{"prompt": "text"}``."""
    try:
        tokenizer = served_tokenizer(state)
        body = await parse_json_body(request, state, DetokenizeRequest)
        bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise OpenAIError(400, f"tokens[{bad}] = {body.tokens[bad]} is outside [0, {tokenizer.vocab_size})",
                              param="tokens")
    except OpenAIError as exc:
        return exc.response()
    return json_response({"prompt": tokenizer.decode(body.tokens)})
