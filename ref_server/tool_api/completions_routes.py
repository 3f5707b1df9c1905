"""``POST /v1/completions`` (OpenAI completions shape, for scoring) and ``GET /v1/models``.

What lm-evaluation-harness's ``local-completions`` model sends for log-likelihoods: ``{"prompt": [[ids], ...] or
texts, "echo": true, "logprobs": 1, "max_tokens": 1, "temperature": 0}``; it sums ``token_logprobs[ctxlen:-1]``
and checks greediness against ``max(top_logprobs[i].values())``. Every choice carries ``logprobs.tokens``,
``token_logprobs`` (``null`` first: nothing predicts the first token), ``top_logprobs`` (the ``logprobs`` most
likely tokens plus the chosen one) and ``text_offset`` for the prompt (with ``echo``) and for up to ``max_tokens``
greedily generated tokens. Logprobs are those of the model's own distribution (temperature 1), as vLLM reports
them. The rows go through the same micro-batching scorer as ``/v1/logprobs``; the top-k comes from the chunked LM
head (:func:`ref_server.scoring.top_logprobs.top_logprobs_from_hidden`), never a ``[B, T, V]`` tensor.

Generation is greedy only and re-scores the whole row per generated token (no KV cache): this endpoint is for
scoring and short answers, so ``max_tokens`` is capped at :data:`MAX_COMPLETION_TOKENS`.
"""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Union

import numpy as np
import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr
from starlette.concurrency import run_in_threadpool

from ref_server.http import State
from ref_server.scoring.scorer import Row, ScorerBusy, ScoringError, TopRow
from ref_server.state import ServerState
from ref_server.tool_api.openai_shape import (
    OpenAIError,
    json_response,
    openapi_body,
    parse_json_body,
    served_tokenizer,
)
from ref_server.tool_api.tokenizer import ServedTokenizer

router = APIRouter(tags=["openai"])

MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_TOKENS = 64
MAX_STOP_SEQUENCES = 4

Prompt = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]  # noqa: UP007 - pydantic union


class CompletionRequest(BaseModel):
    """Body of ``POST /v1/completions``. Unknown fields (``seed``, ``user``, ...) are ignored."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = Field(None, description="Echoed in the answer; the server has one model.")
    prompt: Prompt = Field(description="A text, a list of texts, token ids, or a list of token-id lists.")
    max_tokens: int | None = Field(16, ge=0, le=MAX_COMPLETION_TOKENS,
                                   description="Tokens to generate greedily after each prompt (null: 16).")
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False,
                                      description="Only 0 (greedy) when max_tokens > 0; logprobs are at 1.")
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False, description="Ignored (greedy).")
    n: int = Field(1, ge=1, le=1, description="Choices per prompt: 1.")
    best_of: int | None = Field(None, ge=1, le=1, description="1 or null.")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                 description="Return logprobs with this many most likely tokens per position.")
    echo: bool = Field(False, description="Include the prompt's tokens (and their logprobs) in each choice.")
    stop: StrictStr | list[StrictStr] | None = Field(None, description="Up to 4 strings that end generation.")
    stream: bool | None = Field(False, description="Streaming is not supported: false or null.")
    suffix: str | None = Field(None, description="Not supported: null.")
    presence_penalty: float | None = Field(0, ge=0, le=0, description="0 only.")
    frequency_penalty: float | None = Field(0, ge=0, le=0, description="0 only.")
    logit_bias: dict[str, float] | None = Field(None, max_length=0, description="Empty or null only.")
    add_special_tokens: bool = Field(True, description="Text prompts: add the tokenizer's special tokens (vLLM's "
                                                       "default). Token-id prompts are used as sent.")

    @property
    def tokens_to_generate(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens  # null means the OpenAI default


class _Prompt:
    """One prompt: its ids, its text when it was sent as text, and what generation added."""

    def __init__(self, ids: list[int], text: str | None) -> None:
        self.ids = ids
        self.text = text
        self.generated: list[int] = []
        self.finish_reason = "length"
        self.scored: TopRow | None = None
        self.stop_at: int | None = None  # cut of the generated text at a stop string

    @property
    def all_ids(self) -> list[int]:
        return self.ids + self.generated


def _check(req: CompletionRequest) -> list[str]:
    if req.stream:
        raise OpenAIError(400, "stream is not supported", param="stream")
    if req.suffix is not None:
        raise OpenAIError(400, "suffix is not supported", param="suffix")
    if req.tokens_to_generate > 0 and req.temperature not in (None, 0):
        raise OpenAIError(400, f"temperature {req.temperature}: this server only decodes greedily; send temperature "
                          "0 (or max_tokens 0 to only score the prompt)", param="temperature")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOP_SEQUENCES or any(not s for s in stops):
        raise OpenAIError(400, f"stop takes at most {MAX_STOP_SEQUENCES} non-empty strings", param="stop")
    return stops


def _prompts(req: CompletionRequest, state: ServerState, tokenizer: ServedTokenizer) -> list[_Prompt]:
    raw = req.prompt
    if isinstance(raw, str):
        raw = [raw]
    if not raw:
        raise OpenAIError(400, "prompt is empty", param="prompt")
    if isinstance(raw[0], int):
        prompts = [_Prompt(list(raw), None)]
    elif isinstance(raw[0], str):
        prompts = [_Prompt(ids, text) for ids, text in zip(tokenizer.encode(raw, req.add_special_tokens), raw)]
    else:
        prompts = [_Prompt(ids, None) for ids in raw]
    max_tokens = req.tokens_to_generate
    lengths = np.fromiter((len(p.ids) for p in prompts), dtype=np.int64, count=len(prompts))
    if int(lengths.min()) == 0:
        raise OpenAIError(400, f"prompt {int(np.argmin(lengths))} has no tokens", param="prompt")
    total = int(lengths.sum()) + max_tokens * len(prompts)
    if total > state.max_request_tokens:
        raise OpenAIError(413, f"request holds {total} tokens (prompts + max_tokens), more than the "
                          f"{state.max_request_tokens}-token budget", param="prompt")
    if state.max_context is not None and int(lengths.max()) + max_tokens > state.max_context:
        i = int(np.argmax(lengths))
        raise OpenAIError(400, f"prompt {i} has {int(lengths[i])} tokens; with max_tokens {max_tokens} that exceeds "
                          f"the model's context of {state.max_context}", param="prompt",
                          code="context_length_exceeded")
    vocab = state.vocab_size or 0
    try:  # numpy: one C pass, single-threaded reductions (see routes/scoring.validate_tensor_rows)
        flat = np.fromiter(itertools.chain.from_iterable(p.ids for p in prompts), dtype=np.int64,
                           count=int(lengths.sum()))
    except (OverflowError, ValueError):  # a Python int beyond int64 is no token id
        raise OpenAIError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt") from None
    if int(flat.min()) < 0 or int(flat.max()) >= vocab:
        bad = int(np.flatnonzero((flat < 0) | (flat >= vocab))[0])
        row = int(np.searchsorted(np.cumsum(lengths), bad, side="right"))
        raise OpenAIError(400, f"prompt {row}: token id {int(flat[bad])} is outside [0, {vocab})", param="prompt")
    return prompts


async def _score(state: ServerState, rows: list[Row], k: int) -> list[TopRow]:
    try:
        future = state.scorer.submit(rows, 1.0, top_k=k)
    except ScorerBusy as exc:
        raise OpenAIError(503, str(exc), headers={"Retry-After": "1"}) from None
    try:
        return await state.scorer.result(future)
    except ScoringError as exc:  # NoScorer too: no joined scorer answered within ref_server.scorer_wait_s
        raise OpenAIError(503, f"scoring failed: {exc}", headers={"Retry-After": "5"}) from None


async def _run(state: ServerState, tokenizer: ServedTokenizer, prompts: list[_Prompt], max_tokens: int, k: int,
               stops: list[str], request: Request) -> None:
    """Greedy generation, one scoring pass per token; each prompt keeps its last pass (everything but the last
    generated token, whose logprob and top-k are the pass's final column)."""
    active = list(prompts)
    for _ in range(max(max_tokens, 1)):
        results = await _score(state, [Row(p.all_ids, 1) for p in active], k)
        request.app.state.metrics.tokens_scored.inc(sum(r.logprobs.numel() for r in results))
        still = []
        for p, scored in zip(active, results):
            p.scored = scored
            if max_tokens == 0:
                continue
            token = int(scored.top_ids[-1, 0])
            if token == tokenizer.eos_token_id:
                p.finish_reason = "stop"
                continue
            p.generated.append(token)
            if stops:
                text = tokenizer.decode(p.generated)
                cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
                if cuts:
                    p.stop_at, p.finish_reason = min(cuts), "stop"
                    continue
            if len(p.generated) < max_tokens:
                still.append(p)
        active = still
        if not active:
            return


def _choice(index: int, p: _Prompt, req: CompletionRequest, tokenizer: ServedTokenizer) -> dict:
    gen_text = tokenizer.decode(p.generated) if p.generated else ""
    if p.stop_at is not None:
        gen_text = gen_text[:p.stop_at]
    prompt_text = (p.text if p.text is not None else tokenizer.decode(p.ids)) if req.echo else ""
    choice = {"index": index, "text": prompt_text + gen_text, "logprobs": None, "finish_reason": p.finish_reason}
    if req.logprobs is None:
        return choice
    ids = np.asarray(p.all_ids, dtype=np.int64)
    scored = p.scored
    # scored row: every token but possibly the last generated one, which is the greedy top-1 of the final column
    n_scored = scored.logprobs.numel() + 1
    token_lp = scored.logprobs
    if ids.size > n_scored:
        token_lp = torch.cat([token_lp, scored.top_logprobs[-1, :1]])
    top_lp, top_ids = scored.top_logprobs[:ids.size - 1], scored.top_ids[:ids.size - 1]
    first = 0 if req.echo else len(p.ids)
    pieces = tokenizer.pieces(ids)
    offsets = np.concatenate([[0], np.cumsum(tokenizer.piece_lengths(ids))[:-1]])
    if p.stop_at is not None:  # drop generated tokens that start after the stop string's cut
        keep = offsets < offsets[len(p.ids)] + p.stop_at
        keep[:len(p.ids)] = True
        ids, pieces, offsets = ids[keep], pieces[keep], offsets[keep]
    end = ids.size
    values = [None, *token_lp[:end - 1].tolist()]
    kk = req.logprobs
    top_keys = tokenizer.pieces(top_ids[:end - 1, :kk].numpy()).tolist()
    top_vals = top_lp[:end - 1, :kk].tolist()
    token_keys = pieces.tolist()
    tops: list[dict | None] = [None]
    for j in range(1, end):
        entry = dict(zip(top_keys[j - 1], top_vals[j - 1]))
        entry.setdefault(token_keys[j], values[j])
        tops.append(entry)
    base = 0 if req.echo else int(offsets[first]) if first < end else 0
    choice["logprobs"] = {"tokens": token_keys[first:end], "token_logprobs": values[first:end],
                          "top_logprobs": tops[first:end], "text_offset": (offsets[first:end] - base).tolist()}
    return choice


@router.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
async def completions(request: Request, state: State) -> Response:
    """OpenAI-style completions for scoring: prompt logprobs with ``echo``, top-k, a few greedy tokens."""
    try:
        tokenizer = served_tokenizer(state)
        req = await parse_json_body(request, state, CompletionRequest)
        stops = _check(req)
        # tokenising and building the answer take long for big prompts: in the thread pool, off the event loop
        prompts = await run_in_threadpool(_prompts, req, state, tokenizer)
        max_tokens = req.tokens_to_generate
        if max_tokens > 0 or req.logprobs is not None:
            await _run(state, tokenizer, prompts, max_tokens, max(1, req.logprobs or 0), stops, request)
    except OpenAIError as exc:
        return exc.response()
    return await run_in_threadpool(_answer, req, state, tokenizer, prompts)


def _answer(req: CompletionRequest, state: ServerState, tokenizer: ServedTokenizer, prompts: list[_Prompt]):
    choices = [_choice(i, p, req, tokenizer) for i, p in enumerate(prompts)]
    prompt_tokens = sum(len(p.ids) for p in prompts)
    completion_tokens = sum(len(p.generated) for p in prompts)
    return json_response({
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
        "model": req.model or state.model_name or "reference", "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    })


def _model_cards(state: ServerState) -> list[dict]:
    if state.scorer is None:
        return []
    return [{"id": state.model_name or "reference", "object": "model", "created": 0, "owned_by": "grpo-stack",
             "max_model_len": state.max_context}]


@router.get("/v1/models")
async def models(state: State) -> Response:
    """The one model this server scores with (none in beta = 0 mode)."""
    return json_response({"object": "list", "data": _model_cards(state)})


@router.get("/v1/models/{model:path}")
async def model(model: str, state: State) -> Response:
    """One model by id (what ``openai.OpenAI().models.retrieve(id)`` asks); 404 in OpenAI's shape for any other."""
    card = next((c for c in _model_cards(state) if c["id"] == model), None)
    if card is None:
        served = ", ".join(c["id"] for c in _model_cards(state)) or "none (beta = 0 mode)"
        return OpenAIError(404, f"the model {model!r} does not exist here; served: {served}", param="model",
                           code="model_not_found").response()
    return json_response(card)
