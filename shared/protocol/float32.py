"""Whether a Python float survives the cast to float32, without importing torch: the reward code (and so every
config load, which checks reward names) needs only this, and ``grpo check-config`` stays a second or two."""

from __future__ import annotations

import math

# A float64 of this magnitude or more becomes inf in float32: the midpoint between FLOAT32_MAX and 2^128 rounds to
# the even 2^128. Below it, a value rounds to a finite float32 (at most FLOAT32_MAX; tiny ones to 0 or a subnormal).
FLOAT32_OVERFLOW = 2.0**128 - 2.0**103


def finite_float32(value: float) -> bool:
    """Whether the Python float ``value`` is finite once cast to float32."""
    return math.isfinite(value) and abs(value) < FLOAT32_OVERFLOW
