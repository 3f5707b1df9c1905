"""The rule for user code that fails, where the user meets it: `grpo generator` (the tiny model) against a live hub.
A reward that starts failing after good batches, and an environment whose step() raises, stop it with exit 2 and
the user's file:line; a reward server that goes down pauses generation (nothing uploaded meanwhile) and it resumes
when the server answers again. The rule itself: tests/generator/test_failures.py."""

from __future__ import annotations

import signal
import string
import time
from http.server import HTTPServer

import pytest

from shared.protocol.client import HubClient
from tests import service_forks as forks
from tests.generator.test_cli import ENV, GRPO, write_config
from tests.generator.test_rewards import _reward_server
from tests.live_server import LiveServer, make_config

FLAKY = """import itertools

_calls = itertools.count(1)


def score(prompt, completion, example):
    n = next(_calls)
    if n > 12 or n % 6 == 0:   # 1 completion in 6 for two batches (17%), then every one
        raise ValueError(f"the grader broke at call {n}")
    return float(n % 2)
"""

BROKEN_STEP = f"""class BrokenStep:
    stop = {list(string.ascii_letters + string.digits + string.punctuation + " ")!r}   # any text ends a turn

    def reset(self, sample):
        return None

    def step(self, text):
        return self.tools[text]   # no attribute tools: every trajectory fails here
"""


def line_of(source: str, text: str) -> int:
    return next(i for i, line in enumerate(source.splitlines(), 1) if text in line)


def generator_run(tmp_path, model_dir, **generator):
    """`grpo generator` with these generator settings against a live hub, to its end: (its result, the groups the
    hub accepted)."""
    with LiveServer(make_config(tmp_path)) as live:
        config = write_config(tmp_path, live.url, model_dir, **generator)
        result = forks.run([GRPO, "generator", "--config", str(config)], capture_output=True, text=True,
                           timeout=300, env=ENV)
        return result, live.state.hub.counters.accepted


@pytest.mark.slow
def test_a_reward_that_starts_failing_after_good_batches_stops_the_generator_with_its_line(tmp_path, tiny_model_dir):
    """Two batches of 6 completions with one failure each (17%, under the rule: the run goes on and uploads them),
    then every completion fails: 7 of the last 12 (58% >= 50%) stop the generator before that batch is uploaded."""
    (tmp_path / "flaky.py").write_text(FLAKY)
    result, accepted = generator_run(tmp_path, tiny_model_dir, failures="{window: 12, max_rate: 0.5}",
                                     rewards=f"[{{name: python, args: {{function: {tmp_path}/flaky.py:score}}}}]")
    assert result.returncode == 2, result.stderr[-3000:]
    where = f"{tmp_path}/flaky.py:{line_of(FLAKY, 'raise ValueError')} in score"
    assert result.stderr.strip().splitlines()[-1] == (
        "grpo generator: error: reward 'python' failed on 7 of its last 12 completions (58%): the rule is to stop at "
        "50% of a window of 12 (generator.failures.max_rate and .window), since training would learn from on_error "
        f"scores alone; the first failure in the window: ValueError: the grader broke at call 12 (at {where})")
    assert f'File "{tmp_path}/flaky.py", line {line_of(FLAKY, "raise ValueError")}, in score' in result.stderr
    assert accepted == 4   # the two good batches' groups; none of the third


@pytest.mark.slow
def test_an_environment_whose_step_raises_for_every_trajectory_stops_the_generator(tmp_path, tiny_model_dir):
    (tmp_path / "broken_env.py").write_text(BROKEN_STEP)
    name = f"{tmp_path}/broken_env.py:BrokenStep"
    result, accepted = generator_run(tmp_path, tiny_model_dir,
                                     environment=f"{{name: '{name}', max_turns: 2, on_error: -1.0}}")
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"grpo generator: error: environment '{name}' failed on all 6 trajectories it was given "
                           "so far: the rule is to stop at 50% of a window of 64"), last
    assert last.endswith("the first failure in the window: step() raised AttributeError: 'BrokenStep' object has "
                         f"no attribute 'tools' (at {tmp_path}/broken_env.py:{line_of(BROKEN_STEP, 'self.tools')} "
                         "in step)"), last
    assert accepted == 0   # not one group of on_error scores reached the hub


def reward_server(port: int = 0) -> HTTPServer:
    """An HTTP reward model that scores each completion by its length mod 3."""
    return _reward_server(lambda body: [len(c) % 3 for c in body["completions"]], port)


def wait_for(condition, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.slow
def test_a_reward_server_that_goes_down_pauses_generation_until_it_answers_again(tmp_path, tiny_model_dir):
    server = reward_server()
    port = server.server_port
    err = tmp_path / "generator.err"
    with LiveServer(make_config(tmp_path)) as live:
        config = write_config(tmp_path, live.url, tiny_model_dir, failures="{service_retry_s: 0.3}",
                              rewards=f"[{{name: http, on_error: -7.0, args: {{url: 'http://127.0.0.1:{port}/', "
                                      "timeout_s: 5}}]")
        proc = forks.popen([GRPO, "generator", "--config", str(config)], stderr=open(err, "w"), env=ENV)
        try:
            counters = live.state.hub.counters
            wait_for(lambda: counters.accepted >= 2 or proc.poll() is not None, "two groups uploaded")
            server.shutdown()
            server.server_close()
            wait_for(lambda: "pausing generation" in err.read_text() or proc.poll() is not None, "the pause")
            paused_at = counters.accepted
            time.sleep(3)   # ten retries' worth: the generator stays paused, nothing is uploaded
            assert proc.poll() is None and counters.accepted == paused_at
            server = reward_server(port)
            wait_for(lambda: counters.accepted > paused_at + 2 or proc.poll() is not None, "uploads again")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, err.read_text()[-3000:]
            batch = HubClient(live.url).get_batch(counters.accepted, wait_s=10)
        finally:
            if proc.poll() is None:
                proc.kill()
            server.shutdown()
            server.server_close()
    log = err.read_text()
    assert log.count("pausing generation") == 1, log[-3000:]   # one line for the pause, not one per retry
    assert f"HTTP reward at http://127.0.0.1:{port}/ unreachable (ConnectionError" in log
    assert f"HTTP reward at http://127.0.0.1:{port}/ answers again: generation resumes" in log
    assert "reward services: generation paused 1 time(s) while one was down" in log   # the summary at the end
    assert -7.0 not in batch.rewards.tolist()   # no group scored on_error: the down server failed none
    assert "Traceback" not in log


HANGS = """import time


def score(prompt, completion, example):
    time.sleep(3600)   # a reward that never answers
    return 1.0
"""


@pytest.mark.slow
def test_a_reward_that_hangs_stops_the_generator_with_its_line(tmp_path, tiny_model_dir):
    """A python reward that never returns held the generator forever, silent. Its timeout_s cuts each call off (the
    group scored on_error); every completion failed so far, so the rule stops the run at once, exit 2, naming the
    line it hung at."""
    (tmp_path / "hangs.py").write_text(HANGS)
    started = time.monotonic()
    result, accepted = generator_run(tmp_path, tiny_model_dir, rewards=f"[{{name: python, timeout_s: 1, args: "
                                                                        f"{{function: {tmp_path}/hangs.py:score}}}}]")
    assert result.returncode == 2 and time.monotonic() - started < 120, result.stderr[-3000:]
    where = f"{tmp_path}/hangs.py:{line_of(HANGS, 'time.sleep')} in score"
    assert result.stderr.strip().splitlines()[-1] == (
        "grpo generator: error: reward 'python' failed on all 6 completions it was given so far: the rule is to stop "
        "at 50% of a window of 64 (generator.failures.max_rate and .window), since training would learn from "
        "on_error scores alone; the first failure in the window: took longer than the reward's timeout_s "
        f"(generator.rewards 'python') = 1s (at {where})")
    assert accepted == 0
