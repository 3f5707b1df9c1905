"""Layout.mismatch, the relay's check of a weights blob against the learner's registered layout: a header built
from the layout passes; any one change to it (a tensor renamed, dropped, added, another dtype or shape) is found
and named, as the first difference in layout order."""

import json

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.weight_sync.layout import Layout

names = st.text("abcdefgh.", min_size=1, max_size=8)
shapes = st.lists(st.integers(0, 5), max_size=3).map(tuple)
layouts = st.lists(st.tuples(names, shapes), min_size=1, max_size=6, unique_by=lambda t: t[0]).map(
    lambda rows: Layout.build(rows, torch.float32))


def header(layout: Layout) -> dict:
    return json.loads(layout.safetensors_header()[8:])


@settings(max_examples=200, deadline=None)
@given(layout=layouts, data=st.data())
def test_one_change_is_found_and_names_the_first_difference(layout, data):
    assert layout.mismatch(header(layout)) is None
    got = header(layout)
    i = data.draw(st.integers(0, len(layout.tensors) - 1))
    target = layout.tensors[i].name
    change = data.draw(st.sampled_from(["drop", "rename", "dtype", "shape", "extra"]))
    if change == "drop":
        del got[target]
    elif change == "rename":
        got[target + "~"] = got.pop(target)
    elif change == "dtype":
        got[target]["dtype"] = "BF16"
    elif change == "shape":
        got[target]["shape"] = got[target]["shape"] + [1]
    else:
        got["zz~extra"] = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
    problem = layout.mismatch(got)
    expected = {"drop": f"tensor '{target}' is missing", "rename": f"tensor '{target}' is missing",
                "dtype": f"tensor '{target}' is 'BF16', the model's is F32",
                "shape": f"tensor '{target}' has shape", "extra": "tensor 'zz~extra' is not in the model (1 such)"}
    assert problem is not None and problem.startswith(expected[change]), problem


def test_layouts_from_the_network_never_overflow_and_refuse_negative_sizes():
    assert Layout.from_json([["a", "F32", [2**40, 2**40]], ["b", "BF16", [3]]]).total_bytes == 2**82 + 6
    for rows, reason in (([["a", "F32", [-1]]], "negative dimension"), ([["a", "I64", [1]]], "unknown dtype")):
        try:
            Layout.from_json(rows)
        except ValueError as exc:
            assert reason in str(exc)
        else:
            raise AssertionError(f"{rows} was taken")
