"""tests/service_forks.py: a forked ``grpo`` behaves, as far as the tests can see, like ``subprocess``'s."""

import os
import signal
import subprocess
import time

import pytest

from tests import service_forks as forks
from tests.e2e.test_run import free_port, stray_processes

pytestmark = pytest.mark.slow


def test_exit_status_output_and_cwd_are_those_of_a_fresh_process(tmp_path):
    forked = forks.run([forks.GRPO, "check-config", "missing.yaml"], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    fresh = subprocess.run([forks.GRPO, "check-config", "missing.yaml"], capture_output=True, text=True,
                           timeout=120, cwd=tmp_path)
    assert forked.returncode == fresh.returncode == 2
    assert forked.stderr == fresh.stderr and "missing.yaml" in forked.stderr and forked.stdout == fresh.stdout


def test_a_forked_service_has_its_own_session_command_line_and_signal_status(tmp_path):
    port_config = tmp_path / "hub.yaml"
    port_config.write_text(f"algorithm: {{loss: {{beta: 0.0}}}}\nref_server: {{port: {free_port()}}}\n")
    proc = forks.popen([forks.GRPO, "ref-server", "--config", str(port_config)], stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True, env={**os.environ, "GRPO_TEST_MARKER": "x"})
    assert isinstance(proc, forks.ForkedService)
    try:
        assert os.getpgid(proc.pid) == proc.pid and os.getsid(proc.pid) == proc.pid  # at once, as Popen's
        shown = subprocess.run(["ps", "-ww", "-o", "args=", "-p", str(proc.pid)], capture_output=True, text=True).stdout
        assert shown.strip() == f"{forks.GRPO} ref-server --config {port_config}"  # what a fresh one shows
        time.sleep(0.5)
        assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL and proc.returncode == -signal.SIGKILL
    proc.stderr.close()
    deadline = time.monotonic() + 10
    while stray_processes(str(port_config)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stray_processes(str(port_config)) == []


def test_what_the_zygote_cannot_give_starts_fresh(monkeypatch):
    env = {**os.environ, "PYTHONHASHSEED": "123"}  # read when the interpreter starts: the zygote's is fixed
    for proc in (forks.popen([forks.GRPO, "--help"], env=env, stdout=subprocess.DEVNULL), forks.popen(["true"])):
        assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=60) == 0
    monkeypatch.setenv("GRPO_TEST_FORK", "0")
    with forks.popen([forks.GRPO, "--help"], stdout=subprocess.DEVNULL) as proc:
        assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=60) == 0


def test_a_fork_of_the_test_process_leaving_does_not_end_the_zygote():
    """Tests that fork (tests/ref_server/test_spool_group_commit.py) run the exit handlers in their children: the
    zygote's handler must leave the parent's zygote alone."""
    import atexit

    assert forks.run([forks.GRPO, "--help"], stdout=subprocess.DEVNULL, timeout=60).returncode == 0
    pid = os.fork()
    if pid == 0:
        atexit._run_exitfuncs()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert forks.run([forks.GRPO, "--help"], stdout=subprocess.DEVNULL, timeout=60).returncode == 0
