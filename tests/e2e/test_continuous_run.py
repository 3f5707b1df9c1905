"""End to end with the continuous schedule (generator.schedule.mode: continuous): `grpo run` with the tiny model,
the transformers engine kept full, weights taken between decoding steps."""

import json
import os

import pytest

from tests import service_forks as forks
from tests.e2e.test_run import GRPO, free_port, stray_processes, write_config


def run_continuous(tmp_path, model_dir, max_steps: int, **learner) -> tuple[list[dict], str]:
    """`grpo run` of the tiny config on the continuous schedule: its metrics (one per step, checked) and the
    generator's log."""
    config = write_config(tmp_path, model_dir, free_port(), max_steps=max_steps, **learner)
    data = json.loads(config.read_text())
    data["ref_server"]["max_staleness"] = 2
    data["generator"]["sampling"]["max_tokens"] = 24   # long enough for versions to change mid-sequence
    data["generator"]["schedule"] = {"mode": "continuous", "max_in_flight": 8, "upload_interval_s": 0.1}
    config.write_text(json.dumps(data))
    result = forks.run([GRPO, "run", str(config)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, max_steps + 1)) and metrics[-1]["version"] == max_steps
    assert stray_processes(str(config)) == []
    return metrics, (tmp_path / "run" / "logs" / "gen-0.log").read_text()


@pytest.mark.slow
def test_grpo_run_with_the_continuous_schedule_trains_and_records_token_versions(tiny_model_dir, tmp_path):
    metrics, generator_log = run_continuous(tmp_path, tiny_model_dir, 6)
    # every token's lag is within the staleness bound the hub enforces on the row's oldest token
    assert all(0 <= m["token_version_lag_mean"] <= 2 and m["token_version_spread_max"] <= 2 for m in metrics)
    assert "continuous schedule:" in generator_log and "policy version 0 -> " in generator_log
    assert "grpo generator: error" not in generator_log   # the stop at the end (a full queue, the hub going) is not an error


@pytest.mark.slow
def test_grpo_run_with_lora_adapters_on_the_continuous_schedule_applies_each_version_in_flight(tiny_model_dir,
                                                                                                tmp_path):
    """learner.lora.publish: adapter: each adapter version reaches the transformers engine between decoding steps
    (applied onto its base, then the unfinished sequences continue on it) as full weights do."""
    _, generator_log = run_continuous(tmp_path, tiny_model_dir, 4, lr=5e-2,
                                      lora={"r": 4, "alpha": 16.0, "target_modules": ["q_proj", "v_proj"]})
    # over the relay or the learner's group alike, the adapter versions were taken between decoding steps
    assert "continuous schedule:" in generator_log and "policy version 0 -> " in generator_log
    assert "grpo generator: error" not in generator_log and "Traceback" not in generator_log
