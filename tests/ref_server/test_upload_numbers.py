"""Binary uploads to a live hub, by class: a group holding a value ``x`` (in F64, F32, F16 or BF16) is accepted iff
``x`` is finite in the learner's float32 (and a log-probability where it is one); otherwise a 4xx naming the field,
alone in a batch upload; never a 5xx."""

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.protocol.numbers import MAX_LOGPROB, MIN_LOGPROB
from shared.protocol.wire import encode_messages

from .helpers import group_bytes

pytestmark = pytest.mark.slow  # a live uvicorn server

OCTET = {"Content-Type": "application/octet-stream"}
OVERFLOW = 2.0**128 - 2.0**103
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
values = st.one_of(st.sampled_from([1e39, 1e300, -1e300, 3.4028234663852886e38, OVERFLOW, 5e-324, 1e-310, -0.0,
                                    math.inf, math.nan, -1e4, -1.0001e4, 0.01, 0.02]), st.floats(width=64))
FIELDS = {"rewards": "rewards", "reward/correct": "reward component 'correct'",
          "behaviour_logprobs": "behaviour_logprobs"}


def acceptable(field: str, sent: float) -> bool:
    if not (math.isfinite(sent) and abs(sent) < OVERFLOW):
        return False
    as32 = float(torch.tensor(sent, dtype=torch.float64).float())
    return field != "behaviour_logprobs" or MIN_LOGPROB <= as32 <= MAX_LOGPROB


def test_uploads_are_accepted_iff_finite_in_float32_never_5xx(server_factory):
    live = server_factory(model=False, queue_capacity=4096)
    ids = itertools.count()

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
    @given(x=values, dtype=st.sampled_from(sorted(DTYPES)), field=st.sampled_from(sorted(FIELDS)),
           batched=st.booleans())
    def check(x, dtype, field, batched):
        data, sent = group_bytes(field, x, DTYPES[dtype], group_id=f"g{next(ids)}")
        good, _ = group_bytes("rewards", 1.0, torch.float32, group_id=f"g{next(ids)}")
        if batched:
            response = live.post("/v1/rollouts/batch", data=encode_messages([good, data, good]), headers=OCTET)
            assert response.status_code == 200
            first, answer, again = response.json()["answers"]
            assert first["accepted"] and again.get("duplicate")            # the good one, queued once
            accepted, detail = answer["accepted"], answer.get("refused", "")
            assert accepted or answer["status"] == 422
        else:
            response = live.post("/v1/rollouts", data=data, headers=OCTET)
            assert response.status_code in (200, 422)
            accepted, detail = response.status_code == 200, response.json().get("detail", "")
        assert accepted == acceptable(field, sent), (x, sent, detail)
        if not accepted:
            assert detail.startswith(FIELDS[field]) and len(detail) < 200

    check()
    assert live.get("/v1/hub/stats").json()["rejected"] >= 1
