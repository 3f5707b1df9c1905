"""Sampling settings shared by the generator, the hub and the learner, and the temperature check every temperature
that crosses a process boundary goes through (rollout groups, logprob requests, scorer jobs)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.protocol import numbers
from shared.protocol.errors import ProtocolError
from shared.protocol.errors import require as _require

# Sampling temperatures below this make logits / T overflow float32 (1e-300 gives inf logprobs, not an error).
MIN_TEMPERATURE = 1e-3


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_temperature(value: object) -> float:
    """A sampling/scoring temperature: a finite number >= MIN_TEMPERATURE (else ProtocolError naming it)."""
    _require(_is_number(value), f"temperature must be a number, got {value!r}")
    try:
        temperature = float(value)
    except OverflowError:
        raise ProtocolError(f"temperature {value} is out of range") from None
    _require(math.isfinite(temperature) and MIN_TEMPERATURE <= temperature <= numbers.FLOAT32_MAX,
             f"temperature must be a finite float32 >= {MIN_TEMPERATURE}, got {value!r}")
    return temperature


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings; the ref server and learner must use the same temperature (and top-p/top-k)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    max_tokens: int = 64

    def validate(self) -> SamplingParams:
        check_temperature(self.temperature)
        _require(_is_number(self.top_p) and 0 < float(self.top_p) <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _require(type(self.top_k) is int and self.top_k >= -1, f"top_k must be an integer >= -1, got {self.top_k!r}")
        _require(type(self.max_tokens) is int and 1 <= self.max_tokens <= 2**31,
                 f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        return self
