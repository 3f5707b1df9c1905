"""learner.collective_timeout_s bounds every collective after start-up: two real gloo ranks (subprocesses, the
learner's own init_distributed and per-batch agreement, tests/learner/collective_peer.py); after start-up rank 1
stops dead, and rank 0 exits 1 within the timeout and a margin, with one line naming the setting, instead of
waiting DeepSpeed's default 10 minutes."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PEER = Path(__file__).with_name("collective_peer.py")
TIMEOUT_S = 4.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_a_rank_whose_peer_stops_dead_fails_after_collective_timeout_s_naming_it(tmp_path):
    port = free_port()
    ranks = []
    try:
        for rank in range(2):
            env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": "2",
                   "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            ranks.append(subprocess.Popen([sys.executable, str(PEER), str(TIMEOUT_S), str(tmp_path)], env=env, cwd=ROOT,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        out, err = ranks[0].communicate(timeout=360)   # start-up (imports: slow on a loaded machine) and the wait
        ended = time.time()
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()   # SIGKILL ends a stopped process too
                process.wait(timeout=10)
    assert ranks[0].returncode == 1, (out, err[-3000:])
    waited = ended - float(out.split("waiting since ")[1].split()[0])
    # it did wait for its peer (no error at once), and not much longer than the setting
    assert TIMEOUT_S - 0.5 <= waited <= TIMEOUT_S + 10, waited
    last = err.strip().splitlines()[-1]
    assert last.startswith("grpo learner: learner rank 0: a collective with the other ranks failed"), err[-3000:]
    assert "learner.collective_timeout_s is 4s" in last and "Traceback" not in err, err[-3000:]
