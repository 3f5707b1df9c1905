"""Top-k wire fields of any shape, dtype and value (hypothesis): a train batch whose ``teacher_topk_ids`` /
``teacher_topk_logprobs`` were replaced by anything the wire can carry decodes to exactly what was sent or is
refused with a :class:`WireError` naming the fields, and a decoded batch is trainable (``batch_problem`` None)
iff every completion position holds ids in the vocabulary and finite logprobs at or below 0. Never another
exception. Oracle written from the layout's documentation (shared/protocol/teacher_topk.py), not from the code."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.protocol import teacher_topk
from shared.protocol.numbers import batch_problem
from shared.protocol.records import TrainBatch
from shared.protocol.wire import WireError, decode, encode

from .test_teacher_topk import _batch

VOCAB = 40
_, _, BATCH = _batch()           # 8 rows, 6 completion columns; completion lengths below
ROWS, WIDTH = tuple(BATCH.behaviour_logprobs.shape)
VALID = torch.arange(WIDTH) < BATCH.completion_lengths.long().unsqueeze(1)
TENSORS, FIELDS = decode(BATCH.to_bytes(), "train_batch/v2")

IDS_VALUES = st.integers(-3, VOCAB + 3)
LOGPROB_VALUES = st.one_of(st.floats(-30.0, 0.0), st.sampled_from([0.0, -0.0, 0.5, 1e-7, math.nan, -math.inf,
                                                                   math.inf, -1e30]))


def _tensor(draw, shape, values, dtype) -> torch.Tensor:
    """A tensor of ``shape``: a few drawn values spread over it by a drawn seed (cheap to draw, shrinks well)."""
    pool = draw(st.lists(values, min_size=1, max_size=5))
    picks = torch.randint(len(pool), shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**16))))
    if dtype.is_floating_point:
        return torch.tensor([float(v) for v in pool], dtype=torch.float64)[picks].to(dtype)
    return torch.tensor([int(max(min(v, 1e3), -1e3)) if math.isfinite(v) else 0 for v in pool], dtype=dtype)[picks]


SHAPES = {"rows - 1": lambda k: (ROWS - 1, WIDTH, k), "rows + 1": lambda k: (ROWS + 1, WIDTH, k),
          "width - 1": lambda k: (ROWS, WIDTH - 1, k), "width + 1": lambda k: (ROWS, WIDTH + 1, k),
          "k + 1": lambda k: (ROWS, WIDTH, k + 1), "k = 0": lambda k: (ROWS, WIDTH, 0), "2-D": lambda k: (ROWS, WIDTH)}
# every structural change, each with drawn values: (fields changed, how)
BREAKAGES = ([(), (("ids",), "absent"), (("logprobs",), "absent"), (("ids", "logprobs"), "absent")]
             + [(("ids",), dtype) for dtype in (torch.int64, torch.int16, torch.float32)]
             + [(("logprobs",), dtype) for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.int32)]
             + [(names, shape) for names in (("ids",), ("logprobs",), ("ids", "logprobs")) for shape in SHAPES])


@st.composite
def topk_fields(draw, breakage):
    """``(ids, logprobs)``: the documented layout [ROWS, WIDTH, k] (int32, float32) with drawn values, then
    ``breakage`` applied: fields left out, another dtype, or another shape (with drawn values) of one or both."""
    k = draw(st.integers(1, 3))
    names, how = breakage or ((), None)
    fields = {}
    for name, values, dtype in (("ids", IDS_VALUES, torch.int32), ("logprobs", LOGPROB_VALUES, torch.float32)):
        shape = SHAPES[how](k) if name in names and how in SHAPES else (ROWS, WIDTH, k)
        fields[name] = _tensor(draw, shape, values, dtype)
        if shape[:2] == (ROWS, WIDTH) and draw(st.booleans()):   # padding of its own values, out of range ones too
            fields[name][~VALID] = _tensor(draw, fields[name][~VALID].shape, values, dtype)
        if name in names and how == "absent":
            fields[name] = None
        elif name in names and isinstance(how, torch.dtype):
            fields[name] = fields[name].to(how)
    return fields["ids"], fields["logprobs"]


def _bytes(ids, logprobs) -> bytes:
    tensors = {k: v for k, v in TENSORS.items() if k not in (teacher_topk.IDS, teacher_topk.LOGPROBS)}
    tensors.update({name: value for name, value in ((teacher_topk.IDS, ids), (teacher_topk.LOGPROBS, logprobs))
                    if value is not None})
    return encode("train_batch/v2", tensors, FIELDS)


def _wire_ok(ids, logprobs) -> bool:
    """The documented layout: both or neither; int32 ids, float32 logprobs; both [ROWS, WIDTH, k >= 1]."""
    if ids is None or logprobs is None:
        return ids is None and logprobs is None
    return (ids.dtype == torch.int32 and logprobs.dtype == torch.float32 and ids.dim() == 3
            and tuple(ids.shape[:2]) == (ROWS, WIDTH) and ids.shape[2] >= 1 and ids.shape == logprobs.shape)


@pytest.mark.parametrize("breakage", BREAKAGES, ids=lambda b: "+".join(b[0]) + f" {b[1]}" if b else "as laid out")
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_any_topk_fields_round_trip_exactly_or_are_refused_with_a_reason(breakage, data):
    ids, logprobs = data.draw(topk_fields(breakage))
    wire = _bytes(ids, logprobs)
    if not _wire_ok(ids, logprobs):
        with pytest.raises(WireError, match="teacher_topk"):
            TrainBatch.from_bytes(wire)
        return
    batch = TrainBatch.from_bytes(wire)
    if ids is None:
        assert batch.teacher_topk_ids is None and batch.teacher_topk_logprobs is None
        assert batch_problem(batch, VOCAB) is None
        return
    assert torch.equal(batch.teacher_topk_ids, ids)
    assert torch.equal(batch.teacher_topk_logprobs.nan_to_num(7.0), logprobs.nan_to_num(7.0))
    read_ids, read_logprobs = ids[VALID], logprobs[VALID].double()   # padding is never read
    trainable = (bool(((read_ids >= 0) & (read_ids < VOCAB)).all())
                 and all(math.isfinite(v) and v <= 0.0 for v in read_logprobs.flatten().tolist()))
    problem = batch_problem(batch, VOCAB)
    assert (problem is None) == trainable, problem
    if problem is not None:
        assert "teacher_topk" in problem, problem
