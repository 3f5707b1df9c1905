"""The engine interface: token-id prompts in; per prompt, n completions with behaviour logprobs out."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from shared.protocol.records import SamplingParams


@dataclass
class SampledCompletion:
    token_ids: list[int]     # generated tokens, EOS included when the model emitted it
    logprobs: list[float]    # log softmax(logits / temperature) of each sampled token (temperature 1 if greedy)
    finish_reason: str       # "stop" (EOS) or "length" (max_tokens reached)


class Engine(Protocol):
    name: str

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, n: int,
                 seed: int | None = None) -> list[list[SampledCompletion]]:
        """For each prompt, ``n`` sampled completions (greedy when ``sampling.temperature == 0``)."""

    def load_weights(self, path: Path) -> None:
        """Load a safetensors file whose tensor names are the Hugging Face model's, in place."""

    def close(self) -> None:
        ...
