"""Training's rule for user code that fails, where `grpo eval` meets it (the tiny model, the real CLI): a reward that
raises on every completion stops the evaluation at its first chunk with exit 2, the traceback and the user's
file:line, instead of an accuracy of on_error scores; a reward server that is down pauses the evaluation, which
finishes once the server answers, with no completion scored on_error. The training side:
tests/generator/test_failures_cli.py."""

from __future__ import annotations

import json
import socket
import subprocess
import time

import pytest

from tests import service_forks as forks
from tests.generator.test_cli import ENV, GRPO
from tests.generator.test_failures_cli import line_of, reward_server, wait_for

BROKEN = """from pathlib import Path

CALLS = Path(__file__).with_suffix(".calls")


def score(prompt, completion, example):
    with open(CALLS, "a") as fh:
        fh.write("x")
    return example["label"] * 1.0   # no such key: every completion fails here
"""


def eval_config(tmp_path, reward: dict) -> str:
    config = tmp_path / "eval.yaml"
    config.write_text(json.dumps({
        "generator": {"rewards": [reward], "sampling": {"max_tokens": 4}, "failures": {"service_retry_s": 0.3}},
        "eval": {"num_examples": 6, "k": 2, "engine": "transformers"}}))
    return str(config)


@pytest.mark.slow  # one `grpo eval` process of the tiny model
def test_a_reward_that_raises_on_every_completion_stops_eval_with_exit_2_and_its_line(tmp_path, tiny_model_dir):
    (tmp_path / "broken.py").write_text(BROKEN)
    config = eval_config(tmp_path, {"name": "python", "args": {"function": f"{tmp_path}/broken.py:score"}})
    result = forks.run([GRPO, "eval", "--model", str(tiny_model_dir), "--config", config], capture_output=True,
                       text=True, timeout=300, env=ENV)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stdout == ""   # no result: an accuracy of on_error scores is no accuracy
    where = f"{tmp_path}/broken.py:{line_of(BROKEN, 'example[')} in score"
    last = result.stderr.strip().splitlines()[-1]
    assert last == ("grpo eval: error: reward 'python' failed on all 6 completions it was given so far: the rule is "
                    "to stop at 50% of a window of 64 (generator.failures.max_rate and .window), since training "
                    "would learn from on_error scores alone; the first failure in the window: KeyError: 'label' (at "
                    f"{where})"), last
    assert f'File "{tmp_path}/broken.py", line {line_of(BROKEN, "example[")}, in score' in result.stderr
    # stopped at the first chunk (the 6 greedy completions): the 12 samples were never scored
    assert (tmp_path / "broken.calls").read_text() == "x" * 6


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow  # one `grpo eval` process of the tiny model
def test_a_reward_server_that_is_down_pauses_eval_until_it_answers(tmp_path, tiny_model_dir):
    port = free_port()   # nothing listens there yet
    config = eval_config(tmp_path, {"name": "http", "on_error": -7.0,
                                    "args": {"url": f"http://127.0.0.1:{port}/", "timeout_s": 5}})
    err = tmp_path / "eval.err"
    server = None
    proc = forks.popen([GRPO, "eval", "--model", str(tiny_model_dir), "--config", config], stdout=subprocess.PIPE,
                       stderr=open(err, "w"), text=True, env=ENV)
    try:
        wait_for(lambda: "pausing evaluation" in err.read_text() or proc.poll() is not None, "the pause")
        time.sleep(2)   # several retries' worth: still paused, not failed
        assert proc.poll() is None, err.read_text()[-3000:]
        server = reward_server(port)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if server is not None:
            server.shutdown()
            server.server_close()
    log = err.read_text()
    assert proc.returncode == 0, log[-3000:]
    assert log.count("pausing evaluation") == 1, log[-3000:]   # one line for the pause, not one per retry
    assert f"HTTP reward at http://127.0.0.1:{port}/ unreachable (ConnectionError" in log
    assert f"HTTP reward at http://127.0.0.1:{port}/ answers again: evaluation resumes" in log
    result = json.loads(out)
    # scores are len % 3, in {0, 1, 2}: no completion was scored on_error (-7) while the server was down
    assert result["num_examples"] == 6 and 0.0 <= result["greedy_rewards"]["http"] <= 2.0
    assert "Traceback" not in log
