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


LONG_RESET = Path(__file__).with_name("long_reset_env.py")


@pytest.mark.slow
@pytest.mark.parametrize("shared", [False, True], ids=["own-reset-fills-max_total_tokens", "shared-reset-past-context"])
def test_a_generator_whose_every_group_is_refused_stops_with_the_reason(tmp_path, tiny_model_dir, shared):
    """The livelock: every group of this config is refused (a reset() text that leaves no room for a model token,
    dropped by the generator's own check; or, joined to the prompt, one longer than the model's 256-token context,
    refused 422 by the hub). Each is counted and dropped once, the reason logged once, and after
    max_refused_in_a_row refusals in a row the generator stops with it, exit 2, instead of sampling forever."""
    with LiveServer(make_config(tmp_path, tiny_model_dir)) as live:
        environment = (f"{{name: '{LONG_RESET}:LongReset', max_env_tokens: 400, max_total_tokens: 32, "
                       f"args: {{length: 300, shared: {str(shared).lower()}}}}}")
        config = write_config(tmp_path, live.url, tiny_model_dir, environment=environment, max_refused_in_a_row=5)
        started = time.monotonic()
        result = forks.run([GRPO, "generator", "--config", str(config), "--max-groups", "3"], capture_output=True,
                           text=True, timeout=300, env=ENV)
        counters = live.state.hub.counters
    assert result.returncode == 2, result.stderr[-3000:]
    assert time.monotonic() - started < 200 and "Traceback" not in result.stderr
    assert "refused the last 5 groups and accepted none" in result.stderr
    if shared:   # the hub's reason, refused by the hub: every group sent once
        reason = "exceed the model's context of 256"
        assert counters.rejected == 6 and counters.accepted == 0   # 3 engine calls of 2 prompts, none sent again
        assert "5 refused as invalid, 0 dropped as unacceptable" in result.stderr
    else:        # the generator's own check: nothing sent
        reason = "reset() text is 300 tokens, which leaves no room for a model token"
        assert counters.rejected == 0 and counters.accepted == 0
        assert "0 refused as invalid, 5 dropped as unacceptable" in result.stderr
    assert result.stderr.count(reason) == 2, result.stderr[-3000:]   # logged once, then in the final error


@pytest.mark.slow
def test_an_environment_reward_runs_alone_in_the_generator(tmp_path, tiny_model_dir):
    """reward: environment with no rewards listed: the generator uploads groups scored by the environment alone
    (the default arithmetic reward, which fails on a guessing game's examples, is not run)."""
    with LiveServer(make_config(tmp_path)) as live:
        # no answer field: the default arithmetic reward failed on every completion here and stopped the run
        config = write_config(tmp_path, live.url, tiny_model_dir, dataset="{kind: jsonl, answer_field: null, path: "
                              + str(tmp_path / "secrets.jsonl") + "}",
                              environment="{name: guess, reward: environment, max_turns: 2, stop: '\\n', "
                                          "args: {secret_field: secret}}")
        (tmp_path / "secrets.jsonl").write_text("".join(f'{{"question": "guess", "secret": "{n:03d}"}}\n'
                                                        for n in range(5)))
        result = forks.run([GRPO, "generator", "--config", str(config), "--max-groups", "2"], capture_output=True,
                           text=True, timeout=300, env=ENV)
        batch = HubClient(live.url).get_batch(2, wait_s=10)
    assert result.returncode == 0, result.stderr[-3000:]
    assert set(batch.reward_components) == {"environment"} and "arithmetic" not in result.stderr


@pytest.mark.slow
def test_a_generator_whose_every_group_is_dropped_as_constant_stops_with_the_scores(tmp_path, tiny_model_dir):
    """Dynamic sampling with a reward that scores every completion alike (a bug in the reward, a task never solved):
    every group is dropped, none reaches the learner, the policy cannot change: it sampled forever. Now the
    generator stops after max_refused_in_a_row such groups, exit 2, naming the scores."""
    (tmp_path / "flat_reward.py").write_text("def score(prompt, completion, example):\n    return 0.25\n")
    with LiveServer(make_config(tmp_path, tiny_model_dir)) as live:
        config = write_config(tmp_path, live.url, tiny_model_dir, drop_constant_groups="true",
                              max_refused_in_a_row=4, rewards=f"[{{name: python, args: {{function: "
                                                              f"'{tmp_path / 'flat_reward.py'}:score'}}}}]")
        result = forks.run([GRPO, "generator", "--config", str(config)], capture_output=True, text=True,
                           timeout=300, env=ENV)
        accepted = live.state.hub.counters.accepted
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert accepted == 0 and "0 groups uploaded, 4 dropped (constant reward)" in result.stderr
    assert ("the last 4 groups, all sampled from policy version 0, were dropped by dynamic sampling "
            "(generator.drop_constant_groups): the completions of each scored alike (the last group: 0.25 for all "
            "3)") in result.stderr, result.stderr[-3000:]
