"""The learner's step-time breakdown: contiguous parts that sum to the wall time between two logged steps."""

import json
import time

import pytest

from learner.metrics import COMPUTE_PARTS, STEP_PARTS, StepClock
from tests.live_server import LiveServer, make_config

from .test_publish_resume import fill_hub, learner_config, run_learner


def test_laps_charge_every_moment_to_one_part_and_start_again_after_take():
    clock = StepClock()
    time.sleep(0.02)
    clock.lap("wait")
    time.sleep(0.01)
    clock.lap("forward_backward")
    clock.lap("forward_backward")
    time.sleep(0.01)
    clock.lap("publish")
    record = clock.take()
    assert record["time_wait_s"] >= 0.02 and record["time_forward_backward_s"] >= 0.01
    assert record["time_step_s"] == pytest.approx(sum(record[f"time_{p}_s"] for p in STEP_PARTS), abs=1e-12)
    assert record["time_compute_s"] == pytest.approx(record["time_forward_backward_s"], abs=1e-12)
    assert record["time_overhead_s"] == pytest.approx(record["time_step_s"] - record["time_compute_s"], abs=1e-12)
    assert record["time_optimizer_s"] == 0.0  # every part is in every record
    assert clock.take()["time_step_s"] == 0.0
    with pytest.raises(KeyError, match="unknown step part"):
        clock.lap("lunch")


@pytest.mark.slow
def test_a_learner_run_logs_parts_that_sum_to_the_time_between_its_records(tiny_model_dir, tmp_path):
    with LiveServer(make_config(tmp_path, max_staleness=100)) as live:
        fill_hub(live.url, tiny_model_dir, 12)
        config = learner_config(tmp_path, live.url, tiny_model_dir, beta=0.0, max_steps=5, checkpoint_every=None,
                                old_logprobs="recompute")
        result = run_learner(config)
        assert result.returncode == 0, result.stderr[-3000:]
        # the learner stopped with a batch prefetched: it was handed back, not left leased for the lease timeout
        assert live.state.hub.leased_depth() == 0 and live.state.hub.depth() == 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for r in records:
        parts = [r[f"time_{p}_s"] for p in STEP_PARTS]
        assert min(parts) >= 0 and r["time_step_s"] == pytest.approx(sum(parts), abs=1e-9)
        assert r["time_compute_s"] == pytest.approx(sum(r[f"time_{p}_s"] for p in COMPUTE_PARTS), abs=1e-9)
        assert r["time_forward_backward_s"] > 0 and r["time_optimizer_s"] > 0 and r["time_old_logprobs_s"] > 0
        assert r["time_publish_s"] > 0  # publish_every 1
        assert r["time_fetch_background_s"] > 0 and r["time_decode_background_s"] > 0
    for before, after in zip(records, records[1:]):
        between = after["time"] - before["time"]  # wall clock between the two records, taken when each was written
        assert after["time_step_s"] == pytest.approx(between, abs=0.02, rel=0.05)
        assert after["time_metrics_s"] > 0  # writing the previous record
