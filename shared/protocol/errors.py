"""The error of a message whose fields are inconsistent, shared by the record modules (records, steps,
logprob_messages)."""

from __future__ import annotations


class ProtocolError(ValueError):
    """A message whose fields are inconsistent (wrong shapes, lengths out of range, unknown values)."""


def require(cond: bool, message: str) -> None:
    """Raise :class:`ProtocolError` with ``message`` unless ``cond``."""
    if not cond:
        raise ProtocolError(message)
