"""The engine interface: token-id prompts in; per prompt, n completions with behaviour logprobs out."""

from __future__ import annotations

from dataclasses import dataclass
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

    @property
    def env_failed(self) -> bool:
        return self.env_failure is not None


@dataclass
class SampledTurn:
    """One model turn of a multi-turn trajectory (generator/multiturn.py)."""

    token_ids: list[int]     # the turn's tokens, its EOS or the tokens completing its stop string included
    logprobs: list[float]    # as in SampledCompletion
    ended: str               # "eos", "stop_string" or "length" (max_tokens reached)


class Engine(Protocol):
    name: str

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, n: int,
                 seed: int | None = None) -> list[list[SampledCompletion]]:
        """For each prompt, ``n`` sampled completions (greedy when ``sampling.temperature == 0``)."""

    def load_weights(self, path: Path) -> None:
        """Load a safetensors file whose tensor names are the Hugging Face model's, in place."""

    def close(self) -> None:
        ...
