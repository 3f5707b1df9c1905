"""The one safetensors header module: its dtype table, header writing and checks, and that every user of the
format (rollout wire, weight layout, weight file export, relay store) goes through it."""

import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from shared.protocol import safetensors_header as sth
from shared.protocol import wire
from shared.weight_sync import export, layout, relay_store
from shared.weight_sync.layout import Layout

ALL = ["BOOL", "U8", "I8", "I16", "I32", "I64", "F16", "BF16", "F32", "F64"]


@pytest.mark.parametrize("name", ALL)
def test_every_dtype_round_trips_name_to_torch_to_name(name):
    dtype = sth.torch_dtype(name)
    assert sth.dtype_name(dtype) == name
    assert sth.itemsize(name) == dtype.itemsize == torch.empty(0, dtype=dtype).element_size()
    # the table agrees with safetensors itself
    header = sth.read_header(save({"t": torch.zeros(3, dtype=dtype)}), ALL)
    assert header["t"]["dtype"] == name


def test_the_table_is_one_to_one_and_unknown_dtypes_are_refused():
    assert sorted(sth.DTYPES) == sorted(ALL)
    assert {sth.NAMES[dtype]: dtype for dtype in sth.NAMES} == sth.DTYPES
    with pytest.raises(ValueError, match="no dtype"):
        sth.dtype_name(torch.complex64)


def test_wire_layout_export_and_relay_use_the_one_table_and_header_helpers():
    assert layout.DTYPES is sth.DTYPES and layout.NAMES is sth.NAMES
    assert layout.encode_header is sth.encode_header and export.encode_header is sth.encode_header
    assert export.dtype_name is sth.dtype_name
    assert relay_store.read_header is sth.read_header and relay_store.check_data_offsets is sth.check_data_offsets
    assert wire.safetensors_header is sth
    # each use keeps its own allow-list, all names of the one table
    assert wire.ALLOWED_DTYPES == relay_store.RELAY_DTYPES == set(ALL)
    assert layout.WEIGHT_DTYPES == {"F32", "F16", "BF16", "F64"}
    assert export.FILE_DTYPES == set(ALL) - {"I16"}


def test_layout_and_export_write_the_same_header_for_the_same_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    spec = Layout.build([(n, tuple(p.shape)) for n, p in model.named_parameters()], torch.float32)
    header, data_size = export.header_for(model, metadata={"grpo_version": "4"})
    assert header == spec.safetensors_header({"grpo_version": "4"})
    assert data_size == spec.total_bytes and len(header) % 8 == 0
    parsed = sth.read_header(header + bytes(data_size), ALL)
    assert sth.check_data_offsets(parsed) == data_size


def _raw(header: dict) -> bytes:
    body = json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body


def test_read_header_keeps_every_check():
    with pytest.raises(sth.HeaderError, match="shorter than its 8-byte header size"):
        sth.read_header(b"1234", ALL)
    with pytest.raises(sth.HeaderError, match="does not fit"):
        sth.read_header(struct.pack("<Q", sth.MAX_HEADER_BYTES + 1) + b" " * 64, ALL)
    with pytest.raises(sth.HeaderError, match="does not fit"):
        sth.read_header(struct.pack("<Q", 100) + b"{}", ALL)
    with pytest.raises(sth.HeaderError, match="not JSON"):
        sth.read_header(struct.pack("<Q", 3) + b"{{{", ALL)
    with pytest.raises(sth.HeaderError, match="not a JSON object"):
        sth.read_header(_raw([1, 2]), ALL)
    f16 = _raw({"t": {"dtype": "F16", "shape": [1], "data_offsets": [0, 2]}})
    assert sth.read_header(f16, ALL)["t"]["dtype"] == "F16"
    with pytest.raises(sth.HeaderError, match="unsupported or missing dtype"):
        sth.read_header(f16, {"F32"})  # a narrower allow-list refuses it
    with pytest.raises(wire.WireError, match="unsupported or missing dtype"):  # the wire's form of the same check
        wire.read_header(_raw({"t": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}))


@pytest.mark.parametrize(("tensors", "message"), [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}, "no valid data_offsets"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8.0]}}, "no valid data_offsets"),
    ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, "no valid shape"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 6]}}, "do not match its dtype F32"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, "do not match"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}, "starts at byte 8, expected 4"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, "starts at byte 4, expected 8"),
])
def test_data_offsets_must_tile_the_data_section(tensors, message):
    with pytest.raises(sth.HeaderError, match=message):  # the types by read_header, the ranges by check_data_offsets
        sth.check_data_offsets(sth.read_header(_raw({"__metadata__": {"format": "pt"}, **tensors}), ALL))


def test_data_offsets_of_a_valid_file_give_its_data_size():
    blob = save({"a": torch.zeros(2, 3), "b": torch.zeros(5, dtype=torch.int64), "c": torch.zeros(0)})
    header = sth.read_header(blob, ALL)
    header_size = struct.unpack("<Q", blob[:8])[0]
    assert 8 + header_size + sth.check_data_offsets(header) == len(blob)


# -- any JSON in any field: a HeaderError naming it, never another exception (a list as dtype was a 500) -----------
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False,
                    allow_infinity=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=12)
FIELD = st.sampled_from(["dtype", "shape", "data_offsets"])


@pytest.mark.parametrize(("entry", "message"), [
    ({"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}, r"dtype \(a JSON array\)"),
    ({"dtype": {"F32": 1}, "shape": [1], "data_offsets": [0, 4]}, r"dtype \(a JSON object\)"),
    ({"dtype": 7, "shape": [1], "data_offsets": [0, 4]}, r"dtype \(a JSON number\)"),
    ({"shape": [1], "data_offsets": [0, 4]}, r"dtype \(a JSON null\)"),
    ({"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}, "no valid shape"),
    ({"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}, "no valid shape"),
    ({"dtype": "F32", "shape": [1], "data_offsets": {"0": 4}}, "no valid data_offsets"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}, "no valid data_offsets"),
    (["F32", [1], [0, 4]], "entry is a JSON array, not an object"),
])
def test_every_field_of_the_wrong_json_type_is_named(entry, message):
    with pytest.raises(sth.HeaderError, match=message):
        sth.read_header(_raw({"t": entry}), ALL)
    with pytest.raises(wire.WireError, match=message):   # the rollout wire's form (every route's parser)
        wire.decode_messages(_raw({"__metadata__": {"grpo_format": "rollout_groups/v1"}, "message/0": entry}), 4)


@settings(max_examples=300, deadline=None)
@given(header=st.dictionaries(st.text(max_size=6), JSON, max_size=3) | JSON,
       entry=st.dictionaries(FIELD, JSON, max_size=3), field=FIELD, value=JSON)
def test_arbitrary_json_headers_are_rejected_cleanly_or_read(header, entry, field, value):
    """Whatever JSON a header holds (any value in any field of a tensor entry, in the metadata, or as the whole
    header), reading it either succeeds with every field of its type or raises HeaderError: never TypeError,
    KeyError, AttributeError... (each a 500 on the routes that read headers)."""
    valid = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
    for candidate in (header, {"t": entry}, {"t": {**valid, field: value}}, {"__metadata__": value, "t": valid}):
        blob = _raw(candidate) + bytes(64)
        for allowed in (ALL, wire.ALLOWED_DTYPES, {"F32"}):
            try:
                parsed = sth.read_header(blob, allowed)
                sth.check_data_offsets(parsed)
            except sth.HeaderError:
                continue
            for name, spec in parsed.items():
                if name != sth.METADATA:
                    assert spec["dtype"] in allowed and all(type(d) is int for d in spec["shape"])
        try:
            wire.decode(blob, "rollout_group/v1")
        except wire.WireError:
            pass
