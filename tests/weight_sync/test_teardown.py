"""Both ends of a weight-sync gloo group as real processes (tests/weight_sync/holder.py): each tears its group
down in close() and exits with status 0. Before the teardown was explicit, the learner closed its member links
without waiting for their threads, the interpreter exited while a link thread still shut its group down, and the
process died in std::terminate (status -6) after its work was done: 5 rounds in 10 with this ordering."""

import subprocess
import sys

import pytest

from tests.live_server import LiveServer, make_config

ROUNDS = 2
HOLDER = [sys.executable, "-m", "tests.weight_sync.holder"]


def start(role: str, url: str) -> subprocess.Popen:
    return subprocess.Popen([*HOLDER, role, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def run_round(url: str) -> tuple[tuple, tuple]:
    """The learner closes as soon as its version is served (the receiver may still be in the completion step)
    while the receiver holds the group; the receiver closes after the learner is gone."""
    learner = start("learner", url)
    receiver = None
    try:
        assert learner.stdout.readline().strip() == "READY"
        receiver = start("receiver", url)
        learner.stdin.write("close right after serving\n")
        learner.stdin.flush()
        learner_out, learner_err = learner.communicate(timeout=60)
        receiver_out, receiver_err = receiver.communicate("close\n", timeout=60)
    finally:
        for process in (learner, receiver):
            if process is not None:
                process.kill()
                process.wait(10)
    return ((learner.returncode, learner_out.split(), learner_err),
            (receiver.returncode, receiver_out.split(), receiver_err))


@pytest.mark.slow
def test_the_sender_and_a_receiver_holding_a_group_close_it_and_exit_with_status_0(tmp_path):
    with LiveServer(make_config(tmp_path)) as live:
        for _ in range(ROUNDS):
            (learner_rc, learner_out, learner_err), (receiver_rc, receiver_out, receiver_err) = run_round(live.url)
            assert (learner_rc, learner_out) == (0, ["SERVED", "DONE", "1"]), learner_err[-2000:]
            assert (receiver_rc, receiver_out) == (0, ["RECEIVED", "1", "DONE", "1"]), receiver_err[-2000:]
            assert "terminate called" not in learner_err + receiver_err
