"""Each mistake, as the `grpo` command a user types: one line, exit status 2, before any service starts.

The in-process tests (tests/deploy/test_preflight.py) hold each check to 5 s; here the bound on a whole command is
looser (the margin tests/slow_guard.py gives a loaded CI machine): there the interpreter and its imports alone
can take several seconds.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

GRPO = str(Path(sys.executable).parent / "grpo")
COMMAND_BOUND_S = 10.0   # measured 2.8-3.9 s per command at a load average of 11 on 2 cores


def grpo(*argv: str, cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    result = subprocess.run([GRPO, *argv], cwd=cwd, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    return result, time.perf_counter() - started


def one_line_error(result: subprocess.CompletedProcess, command: str) -> str:
    assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-2000:])
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"grpo {command}: error: "), result.stderr
    return lines[0]


@pytest.mark.slow
def test_grpo_run_stops_every_mistake_before_any_service_starts(tmp_path):
    (tmp_path / "bad_reward.py").write_text("def score(completion):\n    return 1.0\n")
    config = {"algorithm": {"loss": {"beta": 0.04}},
              "ref_server": {"port": 0},   # set below: a port this test holds
              "generator": {"model": "runs/missing-model", "dataset": {"kind": "jsonl", "path": "missing.jsonl"},
                            "rewards": [{"name": "python", "args": {"function": "bad_reward.py:score"}}]},
              "learner": {"model": "runs/missing-model"},
              "run": {"run_dir": "runs/r"}}
    (tmp_path / "runs").mkdir()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        config["ref_server"]["port"] = held.getsockname()[1]
        (tmp_path / "run.yaml").write_text(json.dumps(config))
        result, seconds = grpo("run", "run.yaml", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[0] == "grpo run: error: 6 problems, found before starting anything:"
    assert [line.split(":")[0].removeprefix("  - ") for line in lines[1:]] == [
        "generator.model", "learner.model", "ref_server.model is not set, but algorithm.loss.beta is 0.04 (> 0)",
        "generator.dataset", "generator.rewards[0] (python)", "ref_server.port"]
    assert not (tmp_path / "runs" / "r").exists()   # nothing started: no run folder, no logs
    assert seconds < COMMAND_BOUND_S


@pytest.mark.slow
@pytest.mark.parametrize("command", [["learner"], ["generator"], ["eval", "--model", "runs/missing-model"],
                                     ["ref-server"], ["scorer"]])
def test_a_missing_model_folder_is_one_line_at_once_with_no_hub_retries(tmp_path, command):
    (tmp_path / "runs").mkdir()
    flags = ["--set", "learner.model=runs/missing-model", "--set", "generator.model=runs/missing-model",
             "--set", "ref_server.model=runs/missing-model"]
    result, seconds = grpo(*command, *flags, cwd=tmp_path)
    key = {"eval": "--model", "ref-server": "ref_server.model", "scorer": "ref_server.model"}.get(
        command[0], f"{command[0]}.model")
    line = one_line_error(result, command[0])
    assert line.startswith(f"grpo {command[0]}: error: {key}: no model folder runs/missing-model (from {tmp_path})")
    assert seconds < COMMAND_BOUND_S


@pytest.mark.slow
def test_the_ref_server_names_who_holds_its_port_and_never_says_ready(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result, seconds = grpo("ref-server", "--port", str(port), "--set", "algorithm.loss.beta=0", cwd=tmp_path)
    line = one_line_error(result, "ref-server")
    assert line.startswith(f"grpo ref-server: error: ref_server.port: port {port} on 127.0.0.1 is held by pid "
                           f"{os.getpid()} (")
    assert "ready" not in result.stdout + result.stderr
    assert seconds < COMMAND_BOUND_S
