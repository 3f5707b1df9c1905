"""Ctrl-C on `grpo run ... | tee console.txt`: the terminal sends SIGINT to the whole pipeline, so `tee` dies and
every later console write of the launcher fails with EPIPE. The launcher must still stop every service gracefully
and leave complete log files."""

import json
import os
import signal
import subprocess
import time

import pytest

from tests.e2e.test_run import GRPO, free_port, stray_processes, write_config


def wait_for(path, text, process, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        assert process.poll() is None, f"grpo run exited early: {path.read_text() if path.exists() else ''}"
        time.sleep(0.3)
    raise AssertionError(f"{text!r} never appeared in {path}")


@pytest.mark.slow
def test_ctrl_c_under_tee_stops_cleanly_and_leaves_complete_logs(tiny_model_dir, tmp_path):
    config = write_config(tmp_path, tiny_model_dir, free_port(), max_steps=500)  # far more than it gets to
    data = json.loads(config.read_text())
    data["algorithm"]["loss"]["beta"] = 0.0  # no reference model: a quicker start
    config.write_text(json.dumps(data))
    console, errors = tmp_path / "console.txt", tmp_path / "stderr.txt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # one process group, as a shell makes for a pipeline; the terminal's Ctrl-C is SIGINT to that group
    with open(errors, "w") as stderr:
        launcher = subprocess.Popen([GRPO, "run", str(config)], stdout=subprocess.PIPE, stderr=stderr, env=env,
                                    process_group=0)
    tee = subprocess.Popen(["tee", str(console)], stdin=launcher.stdout, stdout=subprocess.DEVNULL,
                           process_group=launcher.pid)
    launcher.stdout.close()  # tee holds the only read end: once it is gone, the launcher's writes fail
    try:
        wait_for(console, "[learner] step 2/500", launcher, 240)
        os.killpg(launcher.pid, signal.SIGINT)
        assert tee.wait(timeout=10) != 0  # tee died of the SIGINT: the console is gone
        assert launcher.wait(timeout=120) == 130
    finally:
        for process in (launcher, tee):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    problems = errors.read_text()
    assert "Traceback" not in problems and "BrokenPipe" not in problems, problems
    # what the console showed before Ctrl-C: readable, one line per step, no HTTP access lines
    shown = console.read_text().splitlines()
    assert any(line.startswith("[learner] step 1/500 (0%) | reward ") for line in shown)
    assert not [line for line in shown if "HTTP/1.1" in line]
    # every service was stopped by SIGTERM (not killed) and said so in its complete log file
    logs = tmp_path / "run" / "logs"
    learner_log = (logs / "learner.log").read_text()
    assert "SIGTERM received: finishing this step, checkpointing, exiting" in learner_log
    assert "checkpoint step" in learner_log.split("SIGTERM received")[1]  # its last checkpoint, after the signal
    assert "ref-server stopped (SIGTERM)" in (logs / "ref-server.log").read_text()
    assert "done: " in (logs / "gen-0.log").read_text()
    assert "HTTP/1.1" not in (logs / "ref-server.log").read_text()  # ref_server.access_log is off by default
    assert stray_processes(str(config)) == []
