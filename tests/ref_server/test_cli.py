import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from shared.protocol.health import ServerExited, wait_healthy

GRPO = str(Path(sys.executable).parent / "grpo")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_ref_server_command_serves_and_stops_cleanly(tiny_model_dir, tmp_path):
    port = _free_port()
    config = tmp_path / "run.yaml"
    config.write_text(f"ref_server:\n  spool_dir: {tmp_path / 'spool'}\n  weights_dir: {tmp_path / 'w'}\n")
    proc = subprocess.Popen(
        [GRPO, "ref-server", "--model", str(tiny_model_dir), "--port", str(port), "--config", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        try:
            wait_healthy(f"http://127.0.0.1:{port}", 90, process=proc, poll_s=0.2)
        except ServerExited:
            pytest.fail(proc.stdout.read())
        answer = requests.post(f"http://127.0.0.1:{port}/v1/logprobs",
                               json={"input_ids": [[1, 2, 3]], "prompt_lengths": [1]}, timeout=30)
        assert answer.status_code == 200 and len(answer.json()["logprobs"][0]) == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, output
    assert f"ref-server ready on http://127.0.0.1:{port}" in output
    assert "Traceback" not in output


@pytest.mark.slow
def test_ref_server_missing_model_is_a_clear_error(tmp_path):
    result = subprocess.run([GRPO, "ref-server", "--model", str(tmp_path / "nope"), "--port", str(_free_port())],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert f"ref_server.model: no model folder {tmp_path / 'nope'}" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_ref_server_config_typo_names_the_key(tmp_path):
    config = tmp_path / "typo.yaml"
    config.write_text("ref_server:\n  prot: 9000\n")
    result = subprocess.run([GRPO, "ref-server", "--config", str(config)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and "ref_server.prot: unknown key" in result.stderr
