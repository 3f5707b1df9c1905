"""Strict JSON for everything that arrives over the network: request bodies and the JSON inside binary headers.

Python's ``json.loads`` takes ``NaN``, ``Infinity`` and ``-Infinity`` literals, turns ``1e400`` into ``inf``, recurses
until a ``RecursionError`` on deep nesting, and raises a plain ``ValueError`` (not a ``JSONDecodeError``) for an
integer of more than 4300 digits: each of these has reached a handler as a 500 or as a non-finite number. :func:`loads`
refuses all of them with one exception type, :class:`StrictJSONError` (a ``ValueError``) whose message is short and
never quotes the input:

* no ``NaN`` / ``Infinity`` literals, and no number literal that overflows a float64 to infinity;
* integers within int64 (every id, length, count and version of the protocol is one);
* nesting at most :data:`MAX_DEPTH` arrays/objects deep (pydantic-core's parser stops there; it never recurses in
  Python).

Parsing is pydantic-core's Rust parser (about 2.5x faster than ``json.loads``); the walk that checks magnitudes runs
only when the text holds a literal that could break them (20+ digits in a row, or a 3-digit exponent).
"""

from __future__ import annotations

import math
import re
from typing import Any

import pydantic_core

MAX_DEPTH = 200  # pydantic-core's recursion limit: deeper input is refused while parsing
INT_LIMIT = 2**63  # integers must lie in [-2**63, 2**63)
_MAYBE_OUT_OF_RANGE = re.compile(rb"\d{19,}|[eE][+]?\d{3,}")


class StrictJSONError(ValueError):
    """Input that is not strict JSON; the message says what is wrong without quoting the input."""


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """The JSON value of ``data`` (UTF-8 bytes or text), or :class:`StrictJSONError`."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    try:
        value = pydantic_core.from_json(raw, allow_inf_nan=False, cache_strings=False)
    except ValueError as exc:
        raise StrictJSONError(f"not strict JSON: {_reason(str(exc), raw)}") from None
    if _MAYBE_OUT_OF_RANGE.search(raw):
        _check_numbers(value)
    return value


def _reason(message: str, raw: bytes) -> str:
    """pydantic-core's message (``<what> at line L column C``), bounded, with a hint for the common cases."""
    message = message[:200]
    if message.startswith("recursion limit exceeded"):
        return f"nested more than {MAX_DEPTH} levels deep ({message})"
    if message.startswith(("expected value", "invalid number")) and (b"NaN" in raw or b"Infinity" in raw):
        return f"{message} (NaN and Infinity are not JSON numbers)"
    return message


def _check_numbers(value: Any) -> None:
    """Refuse floats that overflowed to infinity and integers outside int64 (iteratively: no recursion)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise StrictJSONError("not strict JSON: a number literal overflows a 64-bit float")
        elif isinstance(item, int) and not isinstance(item, bool) and not -INT_LIMIT <= item < INT_LIMIT:
            raise StrictJSONError("not strict JSON: an integer is outside the 64-bit range")
