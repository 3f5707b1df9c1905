"""The wire format's JSON metadata (shared/protocol/wire.py) is read strictly: whatever string sits in ``grpo_json``,
decoding returns the fields or raises WireError with a short reason — never RecursionError, never NaN."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save as st_save

from shared.protocol.wire import FORMAT_KEY, JSON_KEY, WireError, decode, encode


def blob(metadata_json: str) -> bytes:
    return st_save({"x": torch.zeros(2)}, metadata={FORMAT_KEY: "k", JSON_KEY: metadata_json})


@pytest.mark.parametrize("text, reason", [
    ("[" * 100_000 + "]" * 100_000, "nested more than"),
    ('{"a": NaN}', "non-finite"),
    ('{"a": 1e400}', "non-finite"),
    ('{"a": -Infinity}', "non-finite"),
    ("[1, 2]", "not a JSON object"),
    ("{", "not strict JSON"),
])
def test_hostile_metadata_is_a_wire_error(text, reason):
    with pytest.raises(WireError, match=reason):
        decode(blob(text), "k")


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_any_metadata_string_decodes_or_is_a_wire_error(text):
    try:
        _, fields = decode(blob(text), "k")
    except WireError as exc:
        assert len(str(exc)) < 400  # a short reason, whatever came in
    else:
        assert isinstance(fields, dict) and fields == json.loads(text)


def test_the_encoder_refuses_non_finite_fields():
    with pytest.raises(ValueError):
        encode("k", {"x": torch.zeros(1)}, {"reward": float("nan")})
