"""shared/protocol/strict_json.py: strict JSON for network input, by property (hypothesis) and at its bounds."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.protocol import strict_json
from shared.protocol.strict_json import MAX_DEPTH, StrictJSONError, loads

INTS = st.integers(-(2**70), 2**70)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | INTS | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=30)


@settings(max_examples=100, deadline=None)
@given(JSON_VALUES)
def test_every_strict_json_value_round_trips(value):
    assert loads(json.dumps(value)) == value
    assert loads(json.dumps(value).encode()) == value


@settings(max_examples=60, deadline=None)
@given(JSON_VALUES, st.sampled_from(["NaN", "Infinity", "-Infinity"]))
def test_nan_and_infinity_literals_are_refused_wherever_they_are(value, literal):
    text = json.dumps([value])[:-1] + ', {"x": [' + literal + "]}]"
    assert isinstance(json.loads(text), list)  # what Python's json accepts ...
    with pytest.raises(StrictJSONError, match=r"non-finite number at \[1\]\.x\[0\]") as info:
        loads(text)  # ... is refused, naming where
    assert info.value.path == (1, "x", 0)


@pytest.mark.parametrize("literal", ["1e400", "-1e309", "1" + "0" * 400 + ".5", "2.5E+999"])
def test_float_literals_that_overflow_to_infinity_are_refused(literal):
    assert math.isinf(json.loads(literal))
    with pytest.raises(StrictJSONError, match="non-finite number at .a.1.") as info:
        loads('{"a": [1, ' + literal + "]}")
    assert info.value.path == ("a", 1)


@pytest.mark.parametrize("literal, ok", [(str(2**63), True), ("9" * 4300, True), ("9" * 4301, False),
                                         ("9" * 400, True), ("1e308", True), ("1e-400", True), ("1.7e308", True)])
def test_numbers_at_the_edges(literal, ok):
    if ok:
        assert loads(f"[{literal}]") == [json.loads(literal)]
    else:
        with pytest.raises(StrictJSONError):  # 5000 digits: Python's json raises a bare ValueError here
            loads(f"[{literal}]")


@pytest.mark.parametrize("open_, close", [("[", "]"), ('{"k":', "}")])
def test_nesting_is_bounded_at_max_depth(open_, close):
    assert loads(open_ * MAX_DEPTH + "1" + close * MAX_DEPTH) is not None
    for depth in (MAX_DEPTH + 1, 100_000):
        with pytest.raises(StrictJSONError, match=f"nested more than {MAX_DEPTH} levels"):
            loads(open_ * depth + "1" + close * depth)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_any_bytes_give_a_value_or_a_short_strict_json_error(data):
    try:
        loads(data)
    except StrictJSONError as exc:
        assert len(str(exc)) < 400
    # nothing else escapes: no RecursionError, UnicodeDecodeError or bare ValueError of another type


def test_errors_never_quote_the_input():
    secret = "k" * 40 + "SECRET" + "x" * 10_000  # a key is named by its first 40 characters at most
    for text in (f'{{"{secret}": NaN}}', f'["{secret}", 1e999]', f'["{secret}" 1]', "[" * 300 + f'"{secret}"'):
        with pytest.raises(StrictJSONError) as info:
            loads(text)
        assert "SECRET" not in str(info.value) and len(str(info.value)) < 400


def test_the_magnitude_walk_runs_only_when_a_literal_could_break_it(monkeypatch):
    walked = []
    monkeypatch.setattr(strict_json, "_non_finite_path", walked.append)
    loads('{"ids": [1, 2, 3], "t": 0.5, "e": 1e10}')
    assert walked == []
    loads('{"e": 1e300}')
    assert walked == [{"e": 1e300}]
