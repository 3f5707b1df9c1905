"""The engine interface: token-id prompts in; per prompt, n completions with behaviour logprobs out."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from generator.failures import Failure
from shared.protocol.records import SamplingParams


@dataclass
class SampledCompletion:
    token_ids: list[int]     # generated tokens, EOS included when the model emitted it
    logprobs: list[float]    # log softmax(logits / temperature) of each sampled token (temperature 1 if greedy)
    finish_reason: str       # "stop" (EOS) or "length" (max_tokens reached)
    # multi-turn (generator/multiturn.py): 1 = the model wrote the token, 0 = the environment did; None: all model
    mask: list[int] | None = None
    env_reward: float | None = None   # the sum of the environment's step rewards (None: it gave none)
    env_failure: Failure | None = None   # what failed this trajectory in its environment (it ended there)
    unusable: str | None = None       # why no group holding it can be trained on (no room for a model token)
    # the policy version that sampled each token (continuous schedule: weights change in flight); None: every
    # token was sampled with the version the loop records for the whole group
    versions: list[int] | None = None
    # an agent's step rewards (generator/agent/): (index of the step's last token, reward); None: outcome only
    token_steps: list[tuple[int, float]] | None = None

    @property
    def env_failed(self) -> bool:
        return self.env_failure is not None


@dataclass
class SampledTurn:
    """One model turn of a multi-turn trajectory (generator/multiturn.py)."""

    token_ids: list[int]     # the turn's tokens, its EOS or the tokens completing its stop string included
    logprobs: list[float]    # as in SampledCompletion
    ended: str               # "eos", "stop_string" or "length" (max_tokens reached)
    versions: list[int] | None = None   # the policy version of each token (continuous engines); None: one version


class Engine(Protocol):
    name: str

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, n: int,
                 seed: int | None = None) -> list[list[SampledCompletion]]:
        """For each prompt, ``n`` sampled completions (greedy when ``sampling.temperature == 0``)."""

    def load_weights(self, path: Path) -> None:
        """Load a safetensors file whose tensor names are the Hugging Face model's, in place."""

    def close(self) -> None:
        ...


@dataclass(frozen=True)
class SequenceRequest:
    """One sequence for a continuous engine: a prompt (token ids) and how to sample its completion."""

    request_id: str              # unique among the engine's unfinished requests
    prompt_ids: list[int]
    sampling: SamplingParams     # max_tokens caps this completion
    seed: int | None = None      # this sequence's sampling seed (engines that can seed per request)
    # strings that end it at the token completing one (a multi-turn environment's turn end; that token included)
    stops: tuple[str, ...] = ()


@dataclass
class FinishedSequence:
    request_id: str
    completion: SampledCompletion   # its ``versions`` say which policy version sampled each token
    ended: str = "eos"              # as SampledTurn.ended: "eos", "stop_string" or "length"


@dataclass
class SequenceSoFar:
    """A continuous engine's record of one unfinished sequence: its request and what it has sampled so far, each
    token with its logprob and the policy version that sampled it."""

    request: SequenceRequest
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    @property
    def context(self) -> list[int]:
        """The prompt and the completion so far: what the next token is sampled after."""
        return self.request.prompt_ids + self.tokens

    def finished(self, reason: str, ended: str | None = None) -> FinishedSequence:
        """``reason``: "stop" or "length"; ``ended`` (default "eos" for "stop"): "stop_string" for a stop string."""
        return FinishedSequence(self.request.request_id,
                                SampledCompletion(self.tokens, self.logprobs, reason, versions=self.versions),
                                ended or ("eos" if reason == "stop" else "length"))


class ContinuousEngine(Protocol):
    """The continuous schedule (generator/continuous/): sequences are submitted one by one and come back as each
    finishes, so the engine never waits for the longest completion of a call. ``step`` is synchronous: between two
    calls no forward pass runs, which is the safe point where the loop swaps weights (through the base engine's
    ``load_weights`` / ``apply_adapter`` / ``receive_weight_version``) and then calls ``weights_changed``."""

    name: str

    def submit(self, requests: list[SequenceRequest]) -> None:
        """Queue sequences; the engine starts them at its next steps, up to its capacity."""

    def step(self) -> list[FinishedSequence]:
        """Advance every running sequence by (about) one decoding step, admitting queued ones; returns the
        sequences that finished (EOS, the token completing one of its ``stops``, or ``max_tokens``)."""

    def num_unfinished(self) -> int:
        """Sequences submitted and not yet returned by ``step`` (queued or running)."""

    def weights_changed(self, version: int, recompute: bool = True) -> None:
        """The model's weights are now ``version``: unfinished sequences continue with them, and every token sampled
        from now on carries ``version`` (version 0 before the first call). ``recompute``: the keys and values of
        their prefix are recomputed, so a greedy continuation equals what ``version`` alone would produce from that
        prefix (AReaL's interruptible generation); False: they are kept as the old weights computed them (vLLM's
        ``pause(mode="keep")``), which costs no prefill; engines that cannot attribute tokens exactly that way
        refuse it."""

    def abort(self, request_ids: list[str]) -> None:
        """Drop unfinished sequences; they are never returned."""
