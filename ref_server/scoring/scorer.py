"""The reference scorer: one model, one worker thread, requests from many clients micro-batched by tokens.

Requests (each a list of rows) are queued; the worker takes as many queued rows with the same temperature as fit
a token budget, runs them as one forward pass (packed into one sequence without padding, or padded: ``packing``,
see :mod:`shared.forward.packing`), and hands each request its rows back. An out-of-memory error on
a micro-batch is retried by splitting it in halves (down to single rows) rather than failing the requests.

Two threads: the worker runs forwards and starts each result's device-to-host copy (non-blocking, into pinned
memory on a GPU); the finisher waits for those copies, cuts the results per row and resolves the requests. So the
next micro-batch's forward runs while the previous one's results are copied and handed out (and, on the event
loop, encoded into responses).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from ref_server.scoring.top_logprobs import sequence_top_logprobs
from shared.forward.logprobs import sequence_logprobs
from shared.forward.packing import PackingMode, micro_batch_cost
from shared.forward.prefix_sharing import shared_prefixes
from shared.tensors.transfers import to_device

log = logging.getLogger("grpo.ref_server.scorer")


class ScoringError(RuntimeError):
    """A request could not be scored (even a single row ran out of memory, or the model failed)."""


class ScorerBusy(RuntimeError):
    """The scorer's request queue is full; the caller should retry later (HTTP 503 with Retry-After)."""


@dataclass
class Row:
    """One sequence: ``input_ids`` (a list or a 1-D integer tensor) whose tokens after ``prompt_length`` are scored."""

    input_ids: list[int] | torch.Tensor
    prompt_length: int

    @property
    def tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class TopRow:
    """A row scored with ``top_k``: its completion tokens' logprobs ``[C]`` and the top-k next tokens ``[C + 1, k]``
    at each of them and after the last token (see :class:`ref_server.scoring.top_logprobs.TopLogprobs`)."""

    logprobs: torch.Tensor
    top_logprobs: torch.Tensor
    top_ids: torch.Tensor


@dataclass
class _Request:
    rows: list[Row]
    temperature: float
    future: Future
    top_k: int = 0

    @property
    def key(self) -> tuple[float, int]:
        return self.temperature, self.top_k


class _Pending:
    """One micro-batch's results on their way to the host: ``rows()`` waits for the copy and cuts them per row."""

    def __init__(self, outputs: tuple[torch.Tensor, ...], completion_lengths: list[int]) -> None:
        self.completion_lengths = completion_lengths
        self.event = None
        if outputs[0].device.type == "cuda":
            self.host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in outputs)
            for dst, src in zip(self.host, outputs):
                dst.copy_(src, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tuple(t.cpu() for t in outputs)

    def rows(self) -> list[torch.Tensor] | list[TopRow]:
        if self.event is not None:
            self.event.synchronize()
        lengths = self.completion_lengths
        if len(self.host) == 1:
            logprobs = self.host[0]
            return [logprobs[i, :c].clone() for i, c in enumerate(lengths)]
        logprobs, top, ids = self.host
        return [TopRow(logprobs[i, :c].clone(), top[i, :c + 1].clone(), ids[i, :c + 1].clone())
                for i, c in enumerate(lengths)]


def _pad(rows: list[list[int] | torch.Tensor]) -> torch.Tensor:
    """Right-padded ``[B, max length]`` int64 ids; list rows go through numpy (``torch.tensor(list)`` is several
    times slower per token)."""
    return torch.nn.utils.rnn.pad_sequence(
        [ids.long() if isinstance(ids, torch.Tensor) else torch.from_numpy(np.asarray(ids, dtype=np.int64))
         for ids in rows], batch_first=True)


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (isinstance(exc, RuntimeError) and "out of memory" in str(exc))


class ReferenceScorer:
    """Thread-safe front of a causal LM that returns per-token logprobs of completion tokens.

    ``forward`` is the function that scores one padded micro-batch; it defaults to the chunked
    :func:`shared.forward.logprobs.sequence_logprobs` (tests pass a wrapper that simulates running out of memory).
    ``top_forward`` does the same with top-k next tokens (:func:`ref_server.scoring.top_logprobs.sequence_top_logprobs`).
    ``packing`` is the forward's layout (``ref_server.packing``); unless it is ``padded``, ``batch_tokens`` counts
    a micro-batch's tokens summed over its rows, otherwise rows x longest row. ``prefix_sharing``
    (``ref_server.prefix_sharing``): rows continuing one prompt share one pass of it (the default forward only).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        vocab_size: int,
        max_context: int,
        batch_tokens: int = 8192,
        packing: PackingMode = "auto",
        prefix_sharing: str = "off",
        max_queue_requests: int = 1024,
        forward: Callable[..., torch.Tensor] | None = None,
        top_forward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
        on_batch: Callable[[int, int], None] | None = None,
    ) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.batch_tokens = batch_tokens
        self.packing = packing
        self.prefix_sharing = prefix_sharing
        self.device = next(model.parameters()).device
        self._forward = forward or self._default_forward
        self._top_forward = top_forward or self._default_top_forward
        self._on_batch = on_batch or (lambda rows, tokens: None)
        self._queue: queue.Queue[_Request | None] = queue.Queue(maxsize=max_queue_requests)
        self._pending: list[_Request] = []
        self._thread = threading.Thread(target=self._run, name="ref-scorer", daemon=True)
        # finished forwards whose results are still being copied to the host, in order; bounded so that the
        # worker cannot run far ahead of the copies (each holds a micro-batch's outputs)
        self._done: queue.Queue[tuple[list[_Request], list[_Pending]] | None] = queue.Queue(maxsize=4)
        self._finisher = threading.Thread(target=self._finish, name="ref-scorer-results", daemon=True)
        self._stopped = threading.Event()
        self.oom_retries = 0
        self.forward_batches = 0
        self._thread.start()
        self._finisher.start()

    # -- public -------------------------------------------------------------------------------------------
    def submit(self, rows: list[Row], temperature: float = 1.0, top_k: int = 0) -> Future:
        """Queue rows for scoring; the future resolves to one float32 tensor per row (completion tokens), or with
        ``top_k >= 1`` to one :class:`TopRow` per row."""
        future: Future = Future()
        if not rows:
            future.set_result([])
            return future
        try:
            self._queue.put_nowait(_Request(rows, temperature, future, top_k))
        except queue.Full:
            raise ScorerBusy(f"{self._queue.maxsize} scoring requests are already queued") from None
        return future

    def score(self, rows: list[Row], temperature: float = 1.0, timeout: float | None = None,
              top_k: int = 0) -> list[torch.Tensor] | list[TopRow]:
        return self.submit(rows, temperature, top_k).result(timeout=timeout)

    def queue_depth(self) -> int:
        return self._queue.qsize() + len(self._pending)

    def close(self) -> None:
        self._stopped.set()
        self._queue.put(None)
        self._thread.join(timeout=10)
        self._done.put(None)
        self._finisher.join(timeout=10)

    # -- worker -------------------------------------------------------------------------------------------
    def _default_forward(self, input_ids, prompt_lengths, completion_lengths, temperature) -> torch.Tensor:
        prefix = shared_prefixes(self.prefix_sharing, input_ids, prompt_lengths, self.packing)
        with torch.inference_mode():
            return sequence_logprobs(self.model, input_ids, prompt_lengths, completion_lengths,
                                     temperature=temperature, layout=self.packing, prefix=prefix).logprobs

    def _default_top_forward(self, input_ids, prompt_lengths, completion_lengths, temperature, k):
        with torch.inference_mode():
            out = sequence_top_logprobs(self.model, input_ids, prompt_lengths, completion_lengths, k=k,
                                        temperature=temperature, layout=self.packing)
        return out.logprobs, out.top_logprobs, out.top_ids

    def _take_batch(self) -> list[_Request]:
        """Requests of one temperature and top-k, oldest first, up to the token budget (a bigger one goes alone)."""
        while True:
            try:
                item = self._queue.get(timeout=0.5) if not self._pending else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                break
            self._pending.append(item)
            if sum(r.tokens for req in self._pending for r in req.rows) >= self.batch_tokens:
                break
        if not self._pending:
            return []
        key = self._pending[0].key
        batch, tokens, rest = [], 0, []
        for req in self._pending:
            req_tokens = sum(r.tokens for r in req.rows)
            if req.key == key and (not batch or tokens + req_tokens <= self.batch_tokens):
                batch.append(req)
                tokens += req_tokens
            else:
                rest.append(req)
        self._pending = rest
        return batch

    def _run(self) -> None:
        while not self._stopped.is_set():
            batch = self._take_batch()
            if not batch:
                continue
            rows = [row for req in batch for row in req.rows]
            try:
                pending = self._score_rows(rows, *batch[0].key)
            except Exception as exc:  # noqa: BLE001 - every failure must reach the waiting requests
                log.exception("scoring failed for %d rows", len(rows))
                self._fail(batch, exc)
                continue
            self._done.put((batch, pending))

    def _finish(self) -> None:
        while True:
            item = self._done.get()
            if item is None:
                return
            batch, pending = item
            try:
                results = [row for part in pending for row in part.rows()]
            except Exception as exc:  # noqa: BLE001 - an error surfacing at the copy still fails only its requests
                log.exception("copying results failed")
                self._fail(batch, exc)
                continue
            start = 0
            for req in batch:
                req.future.set_result(results[start:start + len(req.rows)])
                start += len(req.rows)

    @staticmethod
    def _fail(batch: list[_Request], exc: Exception) -> None:
        for req in batch:
            req.future.set_exception(exc if isinstance(exc, ScoringError) else ScoringError(str(exc)))

    def _score_rows(self, rows: list[Row], temperature: float, top_k: int = 0) -> list[_Pending]:
        """Score rows, in order, in micro-batches of at most ``batch_tokens`` tokens (a longer row alone); halve
        on OOM."""
        packed = self.packing != "padded"
        results: list[_Pending] = []
        start = 0
        while start < len(rows):
            lengths, end = [], start
            while end < len(rows):
                lengths.append(rows[end].tokens)
                if end > start and micro_batch_cost(lengths, packed) > self.batch_tokens:
                    break
                end += 1
            results += self._score_with_retry(rows[start:end], temperature, top_k)
            start = end
        return results

    def _score_with_retry(self, rows: list[Row], temperature: float, top_k: int) -> list[_Pending]:
        try:
            return [self._score_padded(rows, temperature, top_k)]
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not _is_oom(exc):
                raise
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            if len(rows) == 1:
                raise ScoringError(f"out of memory on a single row of {rows[0].tokens} tokens") from exc
            self.oom_retries += 1
            half = len(rows) // 2
            log.warning("out of memory on %d rows; retrying as %d + %d", len(rows), half, len(rows) - half)
            return (self._score_with_retry(rows[:half], temperature, top_k)
                    + self._score_with_retry(rows[half:], temperature, top_k))

    def _score_padded(self, rows: list[Row], temperature: float, top_k: int) -> _Pending:
        input_ids = _pad([r.input_ids for r in rows])
        completion = [r.tokens - r.prompt_length for r in rows]
        # queued copies (a blocking one to a GPU waits for its queue); sequence_logprobs reads both back in one copy
        prompt_lengths = to_device([r.prompt_length for r in rows], self.device)
        completion_lengths = to_device(completion, self.device)
        input_ids = input_ids.to(self.device, non_blocking=True)
        if top_k:
            logprobs, top, ids = self._top_forward(input_ids, prompt_lengths, completion_lengths, temperature, top_k)
            outputs = (logprobs.float(), top.float(), ids)
        else:
            outputs = (self._forward(input_ids, prompt_lengths, completion_lengths, temperature).float(),)
        self.forward_batches += 1
        self._on_batch(len(rows), sum(completion))
        return _Pending(outputs, completion)
