"""The reference scorer: one model, one worker thread, requests from many clients micro-batched by tokens.

Requests (each a list of rows) are queued; the worker takes as many queued rows with the same temperature as fit
a token budget, pads them into one forward pass, and hands each request its rows back. An out-of-memory error on
a micro-batch is retried by splitting it in halves (down to single rows) rather than failing the requests.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from shared.logprobs import sequence_logprobs

log = logging.getLogger("grpo.ref_server.scorer")


class ScoringError(RuntimeError):
    """A request could not be scored (even a single row ran out of memory, or the model failed)."""


class ScorerBusy(RuntimeError):
    """The scorer's request queue is full; the caller should retry later (HTTP 503 with Retry-After)."""


@dataclass
class Row:
    input_ids: list[int]
    prompt_length: int

    @property
    def tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class _Request:
    rows: list[Row]
    temperature: float
    future: Future


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (isinstance(exc, RuntimeError) and "out of memory" in str(exc))


class ReferenceScorer:
    """Thread-safe front of a causal LM that returns per-token logprobs of completion tokens.

    ``forward`` is the function that scores one padded micro-batch; it defaults to the chunked
    :func:`shared.logprobs.sequence_logprobs` (tests pass a wrapper that simulates running out of memory).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        vocab_size: int,
        max_context: int,
        batch_tokens: int = 8192,
        max_queue_requests: int = 1024,
        forward: Callable[..., torch.Tensor] | None = None,
        on_batch: Callable[[int, int], None] | None = None,
    ) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.batch_tokens = batch_tokens
        self.device = next(model.parameters()).device
        self._forward = forward or self._default_forward
        self._on_batch = on_batch or (lambda rows, tokens: None)
        self._queue: queue.Queue[_Request | None] = queue.Queue(maxsize=max_queue_requests)
        self._pending: list[_Request] = []
        self._thread = threading.Thread(target=self._run, name="ref-scorer", daemon=True)
        self._stopped = threading.Event()
        self.oom_retries = 0
        self.forward_batches = 0
        self._thread.start()

    # -- public -------------------------------------------------------------------------------------------
    def submit(self, rows: list[Row], temperature: float = 1.0) -> Future:
        """Queue rows for scoring; the future resolves to one float32 tensor per row (completion tokens)."""
        future: Future = Future()
        if not rows:
            future.set_result([])
            return future
        try:
            self._queue.put_nowait(_Request(rows, temperature, future))
        except queue.Full:
            raise ScorerBusy(f"{self._queue.maxsize} scoring requests are already queued") from None
        return future

    def score(self, rows: list[Row], temperature: float = 1.0, timeout: float | None = None) -> list[torch.Tensor]:
        return self.submit(rows, temperature).result(timeout=timeout)

    def queue_depth(self) -> int:
        return self._queue.qsize() + len(self._pending)

    def close(self) -> None:
        self._stopped.set()
        self._queue.put(None)
        self._thread.join(timeout=10)

    # -- worker -------------------------------------------------------------------------------------------
    def _default_forward(self, input_ids, prompt_lengths, completion_lengths, temperature) -> torch.Tensor:
        with torch.inference_mode():
            return sequence_logprobs(self.model, input_ids, prompt_lengths, completion_lengths,
                                     temperature=temperature).logprobs

    def _take_batch(self) -> list[_Request]:
        """Requests of one temperature, oldest first, up to the token budget (a bigger request goes alone)."""
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
        temperature = self._pending[0].temperature
        batch, tokens, rest = [], 0, []
        for req in self._pending:
            req_tokens = sum(r.tokens for r in req.rows)
            if req.temperature == temperature and (not batch or tokens + req_tokens <= self.batch_tokens):
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
                results = self._score_rows(rows, batch[0].temperature)
            except Exception as exc:  # noqa: BLE001 - every failure must reach the waiting requests
                log.exception("scoring failed for %d rows", len(rows))
                for req in batch:
                    req.future.set_exception(exc if isinstance(exc, ScoringError) else ScoringError(str(exc)))
                continue
            start = 0
            for req in batch:
                req.future.set_result(results[start:start + len(req.rows)])
                start += len(req.rows)

    def _score_rows(self, rows: list[Row], temperature: float) -> list[torch.Tensor]:
        """Score rows in micro-batches of at most ``batch_tokens`` padded tokens; halve on OOM."""
        results: list[torch.Tensor] = []
        start = 0
        while start < len(rows):
            width, end = 0, start
            while end < len(rows):
                new_width = max(width, rows[end].tokens)
                if end > start and new_width * (end - start + 1) > self.batch_tokens:
                    break
                width, end = new_width, end + 1
            results += self._score_with_retry(rows[start:end], temperature)
            start = end
        return results

    def _score_with_retry(self, rows: list[Row], temperature: float) -> list[torch.Tensor]:
        try:
            return self._score_padded(rows, temperature)
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
            return self._score_with_retry(rows[:half], temperature) + self._score_with_retry(rows[half:], temperature)

    def _score_padded(self, rows: list[Row], temperature: float) -> list[torch.Tensor]:
        input_ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(r.input_ids, dtype=torch.long) for r in rows],
                                                    batch_first=True)
        prompt_lengths = torch.tensor([r.prompt_length for r in rows])
        completion_lengths = torch.tensor([r.tokens - r.prompt_length for r in rows])
        logprobs = self._forward(input_ids.to(self.device), prompt_lengths.to(self.device),
                                 completion_lengths.to(self.device), temperature).float().cpu()
        self.forward_batches += 1
        self._on_batch(len(rows), int(completion_lengths.sum()))
        return [logprobs[i, :int(c)].clone() for i, c in enumerate(completion_lengths)]
