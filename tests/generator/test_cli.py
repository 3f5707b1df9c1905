import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.protocol.client import HubClient
from tests import service_forks as forks
from tests.live_server import LiveServer, make_config

GRPO = str(Path(sys.executable).parent / "grpo")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def write_config(tmp_path, url, model_dir, **generator):
    lines = [f"  {k}: {v}" for k, v in generator.items()]
    config = tmp_path / "gen.yaml"
    config.write_text("\n".join([
        "generator:", f"  model: {model_dir}", f"  hub_url: {url}", "  engine: transformers", "  group_size: 3",
        "  prompts_per_batch: 2", f"  weights_dir: {tmp_path / 'gw'}", "  sampling: {max_tokens: 6}",
        *lines]) + "\n")
    return config


@pytest.mark.slow
def test_generator_command_uploads_then_exits(tmp_path, tiny_model_dir):
    with LiveServer(make_config(tmp_path)) as live:
        config = write_config(tmp_path, live.url, tiny_model_dir)
        result = forks.run([GRPO, "generator", "--config", str(config), "--max-groups", "3", "--id", "cli-gen"],
                                capture_output=True, text=True, timeout=300, env=ENV)
        assert result.returncode == 0, result.stderr[-2000:]
        batch = HubClient(live.url).get_batch(3, wait_s=10)
    assert batch.generator_ids == ["cli-gen"] * 3 and batch.batch_size == 9
    assert "3 groups uploaded" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_sigterm_finishes_cleanly(tmp_path, tiny_model_dir):
    with LiveServer(make_config(tmp_path)) as live:
        config = write_config(tmp_path, live.url, tiny_model_dir)
        proc = forks.popen([GRPO, "generator", "--config", str(config)], stderr=subprocess.PIPE, text=True,
                                env=ENV)
        deadline = time.monotonic() + 120
        while live.state.hub.counters.accepted < 2:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-2000:]
    assert "SIGTERM received" in stderr and "groups uploaded" in stderr and "Traceback" not in stderr


@pytest.mark.slow
def test_unreachable_hub_is_a_clear_failure(tmp_path, tiny_model_dir):
    config = write_config(tmp_path, "http://127.0.0.1:9", tiny_model_dir, retry_max_s=1)
    result = forks.run([GRPO, "generator", "--config", str(config)], capture_output=True, text=True,
                            timeout=300, env=ENV)
    assert result.returncode == 1
    assert "the hub stayed unreachable" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_bad_dataset_is_named(tmp_path, tiny_model_dir):
    config = write_config(tmp_path, "http://127.0.0.1:9", tiny_model_dir,
                          dataset=f"{{kind: jsonl, path: {tmp_path / 'missing.jsonl'}}}")
    result = forks.run([GRPO, "generator", "--config", str(config)], capture_output=True, text=True,
                            timeout=300, env=ENV)
    assert result.returncode == 2 and "missing.jsonl" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_sigterm_with_a_dead_hub_exits_promptly(tmp_path, tiny_model_dir):
    live = LiveServer(make_config(tmp_path)).__enter__()
    config = write_config(tmp_path, live.url, tiny_model_dir)
    proc = forks.popen([GRPO, "generator", "--config", str(config)], stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + 120
    while live.state.hub.counters.accepted < 1:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    live.__exit__(None, None, None)  # the hub dies; the generator's next upload is retried
    time.sleep(2)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-2000:]
    assert time.monotonic() - started < 30
    assert "stopped while the hub was unreachable" in stderr or "groups uploaded" in stderr
