"""The transformers engine on the continuous schedule (issue 38; the contract is base.py's ``ContinuousEngine``).

At most ``max_in_flight`` rows decode together, one token per ``step``, with one KV cache. Between steps finished
rows leave the batch (their cache rows are dropped) and queued sequences take the free slots: only the new rows are
prefilled, left-padded, and their cache is merged into the running one by left-padding the narrower of the two with
zero columns that no row attends to. ``weights_changed`` makes the next step re-prefill every unfinished row's
prompt and generated tokens with the new weights (AReaL's interruptible generation), so a greedy continuation
equals what the new version alone produces from that prefix.

A model whose cache layers are not plain ``DynamicLayer`` s (sliding window, linear attention) cannot have its
cache spliced; for it every change of the batch's rows rebuilds the cache by one prefill of all rows: correct,
slower.

A request's ``stops`` end it at the token completing one of them (a multi-turn environment's turn end), found as
``generate_turns`` finds it: over a window of the row's newest tokens decoded.

Sampling is ``sample_with_logprobs``'s: logprob = log_softmax(logits / T) of the sampled token over the whole
vocabulary (T = 1 when greedy), ``filter_logits`` for top-k/top-p. Requests may each have their own temperature,
top-k and top-p (the filters run once per distinct (top-k, top-p) among the sampled rows). A request with a seed
draws from its own ``torch.Generator`` (CPU, one uniform per token, turned into a token by the inverse CDF on the
model's device), so its tokens depend on its seed and logits only, whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from generator.engines.base import FinishedSequence, SequenceRequest, SequenceSoFar
from generator.engines.hf import TransformersEngine, filter_logits, left_padded, stop_string_end
from shared.protocol.records import SamplingParams


@dataclass
class _Row(SequenceSoFar):
    """One running sequence, with the random stream its tokens are drawn from."""

    generator: torch.Generator | None = None   # seeded with the request's seed; None: the global RNG


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), dtype=torch.float64, generator=generator))


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` [R, V] for the uniforms [R] in [0, 1): the first token whose cumulative
    probability exceeds u * total (u * total kept below the total). Never a token of probability 0: a parallel
    cumsum may round a flat stretch one ulp down, and a draw landing there takes the row's likeliest token."""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms.to(cdf)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    chosen = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)
    impossible = probs.gather(-1, chosen[:, None]).squeeze(-1) == 0
    return torch.where(impossible, probs.argmax(-1), chosen)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` [R, V], each row with its own sampling params and generator; returns the
    tokens [R] and their logprobs under log_softmax(logits / T) (T = 1 for greedy rows)."""
    device = logits.device
    temperatures = torch.tensor([p.temperature or 1.0 for p in params], dtype=torch.float32, device=device)
    scaled = logits.float() / temperatures[:, None]
    chosen = scaled.argmax(-1)
    by_filter: dict[tuple[int, float], list[int]] = {}
    for i, p in enumerate(params):
        if p.temperature != 0:
            by_filter.setdefault((p.top_k, p.top_p), []).append(i)
    for (top_k, top_p), rows in by_filter.items():
        index = torch.tensor(rows, device=device)
        probs = filter_logits(scaled[index], top_k, top_p).softmax(-1)
        uniforms = torch.tensor([_uniform(generators[i]) for i in rows], dtype=torch.float64)
        chosen[index] = inverse_cdf(probs, uniforms.to(device))
    logprobs = scaled.log_softmax(-1).gather(-1, chosen[:, None]).squeeze(-1)
    return chosen, logprobs


def splicable(cache) -> bool:
    """Whether the cache's rows can be selected, merged and trimmed column-wise (plain full-attention layers)."""
    return isinstance(cache, DynamicCache) and all(type(layer) is DynamicLayer for layer in cache.layers)


def _stacked_right_aligned(first: torch.Tensor, second: torch.Tensor, width: int) -> torch.Tensor:
    """Two caches' states [B, H, L, D] as one [B1 + B2, H, width, D], each right-aligned (zeros on the left),
    written once into one new tensor."""
    rows = first.shape[0]
    out = first.new_zeros((rows + second.shape[0], *first.shape[1:-2], width, first.shape[-1]))
    out[:rows, ..., width - first.shape[-2]:, :] = first
    out[rows:, ..., width - second.shape[-2]:, :] = second
    return out


def _left_mask(lengths: list[int], width: int, device: torch.device) -> torch.Tensor:
    """The attention mask of right-aligned rows: the last ``lengths[i]`` of ``width`` columns of row i."""
    starts = width - torch.tensor(lengths, device=device)
    return (torch.arange(width, device=device)[None, :] >= starts[:, None]).long()


class ContinuousTransformers:
    """``ContinuousEngine`` over a :class:`TransformersEngine` (its model, tokenizer, EOS, pad and device; weights
    are loaded through it, then the scheduler calls ``weights_changed``). ``merge_caches=False`` forces the
    rebuild-by-prefill path that models with non-plain cache layers take. Prefills (new rows, or every row after a
    weight change) run in chunks of at most ``prefill_tokens`` padded tokens, so a rebuild of long rows does not
    need a [rows, 1, L, L] attention mask at once. While a batch is running, queued sequences join it once
    ``admit_at_least`` slots are free (or as many as are queued, if fewer; default: an eighth of the slots): every
    admission costs a prefill and a copy of the whole cache, so a backlog joins a few rows at a time."""

    name = "transformers-continuous"

    def __init__(self, engine: TransformersEngine, max_in_flight: int, *, merge_caches: bool = True,
                 prefill_tokens: int = 16384, admit_at_least: int | None = None) -> None:
        if admit_at_least is None and type(max_in_flight) is int:
            admit_at_least = max(1, max_in_flight // 8)
        for key, value in (("max_in_flight", max_in_flight), ("prefill_tokens", prefill_tokens),
                           ("admit_at_least", admit_at_least)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
        if admit_at_least > max_in_flight:
            raise ValueError(f"admit_at_least ({admit_at_least}) must be at most max_in_flight ({max_in_flight})")
        self.engine = engine
        self.max_in_flight = max_in_flight
        self.prefill_tokens = prefill_tokens
        self.admit_at_least = admit_at_least
        self._queue: dict[str, _Row] = {}   # submitted, not started; insertion order = admission order
        self._rows: list[_Row] = []         # the decoding batch, in its order
        self._cache = None
        self._width = 0        # the cache's columns (host-side: sliding layers report other lengths)
        # whether the cache's rows can be selected, merged and trimmed (else: rebuilt when the rows change); one
        # token through the model tells the layer types
        with torch.no_grad():
            probe = engine.model(input_ids=torch.tensor([[engine.pad_id]], device=engine.device), use_cache=True)
        self._splice = merge_caches and splicable(probe.past_key_values)
        # [rows, V]: each row's next-token logits; None: the cache is stale and the next step re-prefills every row
        self._logits: torch.Tensor | None = None
        self._version = 0

    # -- the contract ------------------------------------------------------------------------------------------
    def submit(self, requests: list[SequenceRequest]) -> None:
        unfinished = set(self._queue) | {row.request.request_id for row in self._rows}
        rows = []
        for request in requests:
            name = f"request {request.request_id!r}"
            if request.request_id in unfinished:
                raise ValueError(f"{name}: its request_id is already unfinished in this engine")
            if not request.prompt_ids:
                raise ValueError(f"{name}: empty prompt")
            if request.sampling.max_tokens < 1:
                raise ValueError(f"{name}: max_tokens must be >= 1")
            generator = None
            if request.seed is not None:
                if type(request.seed) is not int or not 0 <= request.seed < 2**63:
                    raise ValueError(f"{name}: seed must be an integer in [0, 2**63), got {request.seed!r}")
                generator = torch.Generator().manual_seed(request.seed)
            unfinished.add(request.request_id)
            rows.append(_Row(request, generator=generator))
        for row in rows:
            self._queue[row.request.request_id] = row

    def num_unfinished(self) -> int:
        return len(self._queue) + len(self._rows)

    @property
    def in_flight(self) -> int:
        """Rows in the decoding batch now (at most ``max_in_flight``)."""
        return len(self._rows)

    def weights_changed(self, version: int, recompute: bool = True) -> None:
        self._version = version
        if recompute:
            self._drop_cache()

    def abort(self, request_ids: list[str]) -> None:
        dropped = set(request_ids)
        for request_id in dropped:
            self._queue.pop(request_id, None)
        keep = [i for i, row in enumerate(self._rows) if row.request.request_id not in dropped]
        if len(keep) < len(self._rows):
            self._select(keep)

    @torch.no_grad()
    def step(self) -> list[FinishedSequence]:
        admitted = self._admit()
        if not self._rows:
            return []
        if admitted and not self._splice:
            self._drop_cache()
        if self._logits is None:   # the first rows, a weight change, or a cache that cannot be spliced
            self._add_rows(self._rows)
        elif admitted:
            self._add_rows(admitted)
        chosen, logprobs = sample_rows(self._logits, [row.request.sampling for row in self._rows],
                                       [row.generator for row in self._rows])
        finished, keep = [], []
        eos = self.engine.eos_ids
        for i, (row, token, logprob) in enumerate(zip(self._rows, chosen.tolist(), logprobs.tolist())):
            row.tokens.append(token)
            row.logprobs.append(logprob)
            row.versions.append(self._version)
            if token in eos:
                finished.append(row.finished("stop"))
            elif row.request.stops and self._completes_stop(row):
                finished.append(row.finished("stop", "stop_string"))
            elif len(row.tokens) >= row.request.sampling.max_tokens:
                finished.append(row.finished("length"))
            else:
                keep.append(i)
        if len(keep) < len(self._rows):
            self._select(keep)
            chosen = chosen[torch.tensor(keep, dtype=torch.long, device=chosen.device)]
        if self._logits is not None:
            self._decode(chosen)
        return finished

    def _completes_stop(self, row: _Row) -> bool:
        """Whether the row's newest token completes one of its stop strings (as ``generate_turns`` ends a turn)."""
        decode = lambda ids: self.engine.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        return stop_string_end(decode, row.tokens, list(row.request.stops), start=len(row.tokens) - 1) is not None

    # -- the batch ---------------------------------------------------------------------------------------------
    def _admit(self) -> list[_Row]:
        free = self.max_in_flight - len(self._rows)
        if self._rows and free < min(self.admit_at_least, len(self._queue)):
            return []
        admitted = []
        while self._queue and len(self._rows) < self.max_in_flight:
            admitted.append(self._queue.pop(next(iter(self._queue))))
            self._rows.append(admitted[-1])
        return admitted

    def _drop_cache(self) -> None:
        self._cache, self._logits, self._width = None, None, 0

    def _select(self, keep: list[int]) -> None:
        """Keep only the rows ``keep`` (batch indices, in order): their cache rows, or a stale cache."""
        self._rows = [self._rows[i] for i in keep]
        if not self._rows or self._logits is None or not self._splice:
            self._drop_cache()
            return
        index = torch.tensor(keep, dtype=torch.long, device=self._logits.device)
        self._cache.batch_select_indices(index)
        self._logits = self._logits[index]

    def _add_rows(self, rows: list[_Row]) -> None:
        """Prefill ``rows`` (the last rows of the batch) and append them to the cache: in chunks of at most
        ``prefill_tokens`` padded tokens when the cache splices, else all at once into an empty cache."""
        contexts = [row.context for row in rows]
        if not self._splice:
            self._cache, self._logits, self._width = self._prefill(contexts)
            return
        start = 0
        while start < len(contexts):
            end, width = start + 1, len(contexts[start])
            while end < len(contexts) and (end + 1 - start) * max(width, len(contexts[end])) <= self.prefill_tokens:
                width = max(width, len(contexts[end]))
                end += 1
            self._merge(*self._prefill(contexts[start:end]))
            start = end

    def _prefill(self, contexts: list[list[int]]):
        """Left-padded contexts through the model as ``sample_with_logprobs`` encodes a prompt: their cache, the
        logits of each one's next token [B, V] and the cache's width."""
        engine = self.engine
        input_ids, attention = left_padded(contexts, engine.pad_id)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        out = engine.model(input_ids=input_ids.to(engine.device), attention_mask=attention.to(engine.device),
                           position_ids=positions.to(engine.device), use_cache=True, logits_to_keep=1)
        return out.past_key_values, out.logits[:, -1, :], input_ids.shape[1]

    def _merge(self, cache, logits: torch.Tensor, width: int) -> None:
        """Append the rows of a newly prefilled ``cache`` to the running one (the narrower padded on the left)."""
        if self._cache is None:
            self._cache, self._logits, self._width = cache, logits, width
            return
        merged = max(width, self._width)
        for running, new in zip(self._cache.layers, cache.layers, strict=True):
            running.keys = _stacked_right_aligned(running.keys, new.keys, merged)
            running.values = _stacked_right_aligned(running.values, new.values, merged)
        self._logits = torch.cat([self._logits, logits])
        self._width = merged

    def _decode(self, tokens: torch.Tensor) -> None:
        """Feed each row its newest token; the cache first loses the left columns that no row attends to."""
        lengths = [len(row.request.prompt_ids) + len(row.tokens) for row in self._rows]   # the new token included
        unused = self._width - (max(lengths) - 1)
        if unused > 0 and self._splice:
            for layer in self._cache.layers:
                layer.keys = layer.keys[:, :, unused:, :]
                layer.values = layer.values[:, :, unused:, :]
            self._width -= unused
        device = self.engine.device
        out = self.engine.model(input_ids=tokens[:, None], attention_mask=_left_mask(lengths, self._width + 1, device),
                                position_ids=torch.tensor(lengths, device=device)[:, None] - 1,
                                past_key_values=self._cache, use_cache=True)
        self._cache, self._logits = out.past_key_values, out.logits[:, -1, :]
        self._width += 1
