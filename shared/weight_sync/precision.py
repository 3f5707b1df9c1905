"""What an engine loses when it holds the learner's weights in a lower precision than the learner publishes.

A float32 learner publishes float32 weights; an engine in bfloat16 (or float16) rounds each version to its own
dtype when it loads it. The rounding of a fixed model costs little, but a training step moves every weight by
about the learning rate (Adam's update is near ``lr * sign(g)``), and that is below half a rounding step of
bfloat16 for most weights at the learning rates RL uses (bfloat16 keeps 8 significant bits: a weight of 0.03 is
a multiple of 1.2e-4): most of an update rounds away, and the part that crosses a rounding boundary arrives as a
whole step. The engine then samples from a policy the learner never had, and the learner's ``mismatch_kl`` of
rows sampled by its current version (lag 0) grows as soon as training starts (docs/off-policy.md "Precision").

A learner that computes in bfloat16 (``learner.precision: bf16``: its module holds bfloat16 copies of float32
master weights) publishes those copies, so a bfloat16 engine holds exactly the learner's weights; the warning is
for the other pairings, once per receiver.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from shared.protocol.safetensors_header import DTYPES

# significant bits (the stored mantissa plus the implicit one) of each floating dtype a version can be published in
SIGNIFICANT_BITS = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}


def rounding_note(published: torch.dtype | None, held: torch.dtype | None) -> str | None:
    """Why an engine holding ``held`` weights drifts from a learner publishing ``published`` ones, or None when it
    keeps every bit (same or wider dtype) or either dtype is unknown."""
    if published is None or held is None or published not in SIGNIFICANT_BITS or held not in SIGNIFICANT_BITS:
        return None
    kept, sent = SIGNIFICANT_BITS[held], SIGNIFICANT_BITS[published]
    if kept >= sent:
        return None
    step = 2.0 ** (1 - kept)  # the rounding step of a weight in [1, 2): relative precision of the held dtype
    remedy = f"generator.dtype {_name(published)}"
    if held == torch.bfloat16:
        remedy += (" or learner.precision: bf16 (the same weights on both sides); float16 keeps 11 bits and helps "
                   "only in part")
    return (f"the learner publishes {_name(published)} weights and this engine holds {_name(held)}: every version "
            f"is rounded to {kept} significant bits (steps of {100 * step:.2g}% of a weight's size), so most of an "
            "update smaller than that rounds away and the generator samples from a policy the learner never had; "
            "the learner's mismatch_kl/lag_0 grows with training (docs/off-policy.md#precision). To keep the two "
            f"in step: {remedy}")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def file_dtype(path: str | Path) -> torch.dtype | None:
    """The dtype of a version file's first floating tensor (a version is published in one dtype), from its header."""
    with safe_open(str(path), framework="pt") as fh:
        for name in fh.keys():
            dtype = DTYPES.get(fh.get_slice(name).get_dtype())
            if dtype is not None and dtype.is_floating_point:
                return dtype
    return None
