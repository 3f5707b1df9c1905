"""The multi-node rehearsal (issue 27, item 3): deploy/slurm/grpo-multinode.sbatch run unchanged on one machine,
each Slurm "node" a loopback address (127.0.0.2, .3, ...), with the stand-ins for ``srun`` and ``scontrol``
(deploy/slurm/standins/) first on PATH. The hub binds its node's address with a token, the learner is two
DeepSpeed ranks (gloo) on two nodes that meet at the first learner node's address, and generators on the other
nodes reach the hub and the learner's weight-sync groups at those addresses.

* a 4-node job trains to ``max_steps``; the hub's final counters (RUN_DIR/hub-stats.json, written by the template)
  balance exactly: accepted = acknowledged + queued + leased + dropped + quarantined, and the acknowledged groups are
  the learner's trained ones, none twice;
* a 5-node job loses every process of one generator node (SIGKILL to each of its tasks' process groups) mid-run:
  training goes on with the other generator node to ``max_steps``, the books balance, and every group of the dead
  node's that the hub held when it died is trained afterwards or still spooled, never lost.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from shared.protocol.records import RolloutGroup
from tests.faults.services import accounting_gap
from tests.process_env import PROCESS_GROUP_ENV

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "deploy/slurm/grpo-multinode.sbatch"
STANDINS = ROOT / "deploy/slurm/standins"
BIN = Path(sys.executable).parent
TOKEN = "multinode-rehearsal-token"
GROUPS_PER_STEP = 2  # per learner rank; two ranks train 4 groups a step
# The job's own bound. Most of it is start-up: two DeepSpeed ranks, a generator or two and the hub import torch at
# once on the CPUs the test has; the steps take about a second each.
JOB_TIMEOUT_S = 240


def free_port() -> int:
    """A port free on every address (the hub binds 127.0.0.2, the learner's rendezvous 127.0.0.3)."""
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        return sock.getsockname()[1]


def scorer_command_exists() -> bool:
    return subprocess.run([str(BIN / "grpo"), "scorer", "--help"], capture_output=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode == 0


def write_config(tmp_path: Path, model_dir: Path, max_steps: int) -> Path:
    config = {
        "seed": 0,
        "algorithm": {"loss": {"beta": 0.0}},
        # max_staleness above max_steps: no group is dropped as stale, so every accepted one must be trained or queued
        "ref_server": {"queue_capacity": 8, "max_staleness": 16, "lease_timeout_s": 10.0, "max_long_poll_s": 5.0},
        "generator": {"model": str(model_dir), "engine": "transformers", "group_size": 4, "prompts_per_batch": 2,
                      "sampling": {"max_tokens": 8}, "rewards": [{"name": "arithmetic"}], "retry_max_s": 60},
        "learner": {"model": str(model_dir), "groups_per_step": GROUPS_PER_STEP, "max_steps": max_steps,
                    "lr": 1e-3, "checkpoint_every": 2, "tensorboard_dir": None, "batch_wait_s": 1.0,
                    "retry_max_s": 60},
        "weight_sync": {"timeout_s": 20.0, "join_timeout_s": 60.0},
    }
    path = tmp_path / "multinode.yaml"
    path.write_text(json.dumps(config))
    return path


class Job:
    """One run of the template as ``bash grpo-multinode.sbatch`` with the stand-ins: its nodes, run folder, env."""

    def __init__(self, tmp_path: Path, model_dir: Path, nodes: int, max_steps: int) -> None:
        self.names = [f"node{i}" for i in range(1, nodes + 1)]
        self.addresses = {name: f"127.0.0.{i + 1}" for i, name in enumerate(self.names, start=1)}
        self.run_dir, self.state = tmp_path / "run", tmp_path / "standin-pids"
        self.port = free_port()
        inherited = {k: v for k, v in os.environ.items()  # no leaked rank variables, no outer Slurm job's
                     if not k.startswith("SLURM_") and k not in PROCESS_GROUP_ENV}
        self.env = {
            **inherited, "PATH": f"{STANDINS}:{BIN}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "GRPO": str(BIN / "grpo"), "GRPO_TOKEN": TOKEN, "CONFIG": str(write_config(tmp_path, model_dir,
                                                                                      max_steps)),
            "RUN_DIR": str(self.run_dir), "LEARNER_NODES": "2", "GPUS_PER_NODE": "0", "PORT": str(self.port),
            "MASTER_PORT": str(free_port()), "HUB_WAIT_S": "60",
            "SLURM_JOB_ID": "27", "SLURM_JOB_NODELIST": f"node[1-{nodes}]",
            "GRPO_STANDIN_NODES": ",".join(f"{n}={a}" for n, a in self.addresses.items()),
            "GRPO_STANDIN_STATE": str(self.state), "GRPO_STANDIN_KILL_WAIT_S": "20",
            # a reference scorer on the hub node where this checkout has `grpo scorer` (issue 27, item 1)
            "SCORERS_PER_NODE": "1" if scorer_command_exists() else "0",
        }
        self.proc: subprocess.Popen | None = None

    @property
    def hub(self) -> str:
        return f"http://{self.addresses['node1']}:{self.port}"

    def start(self) -> Job:
        self.out = open(self.run_dir.parent / "job.out", "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(["bash", str(TEMPLATE)], cwd=ROOT, env=self.env, stdout=self.out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def task_pids(self, node: str) -> list[int]:
        folder = self.state / node
        return [int(p.name) for p in folder.iterdir()] if folder.is_dir() else []

    def kill_node(self, node: str) -> int:
        """SIGKILL every process of ``node``: each of its tasks' process groups (what a dead node takes along)."""
        killed = 0
        for pid in self.task_pids(node):
            try:
                os.killpg(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        return killed

    def steps(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def wait_steps(self, n: int, deadline: float) -> None:
        while len(self.steps()) < n:
            assert self.proc.poll() is None, self.logs()
            assert time.monotonic() < deadline, self.logs()
            time.sleep(0.2)

    def logs(self) -> str:
        parts = [f"== job.out\n{(self.run_dir.parent / 'job.out').read_text(errors='replace')[-3000:]}"]
        for log in sorted((self.run_dir / "logs").glob("*.log")):
            parts.append(f"== {log.name}\n{log.read_text(errors='replace')[-2500:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """The job's end however the test went: TERM to the template (its trap stops every srun, which stops its
        tasks), then SIGKILL to whatever task is left."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        for node in self.names:
            self.kill_node(node)
        self.out.close()


def spooled_groups_of(run_dir: Path, generator_id: str) -> set[str]:
    """The ids of the groups from ``generator_id`` in the hub's spool now: accepted, not yet trained."""
    found = set()
    for path in (run_dir / "ref_server/spool").glob("*.group"):
        try:
            group = RolloutGroup.from_bytes(path.read_bytes())
        except FileNotFoundError:  # trained and deleted meanwhile
            continue
        if group.generator_id == generator_id:
            found.add(group.group_id)
    return found


def trained_groups(run_dir: Path) -> list[str]:
    """The group ids of the newest complete checkpoint, both ranks together (each rank records what it trained)."""
    final = sorted(run_dir.glob("checkpoints/step*/COMPLETE"))[-1].parent
    return [g for p in sorted(final.glob("consumed-rank*.json")) for g in json.loads(p.read_text())]


def check_books(job: Job, max_steps: int) -> dict:
    """The template's final hub counters balance, and what the hub saw acknowledged is what the learner trained."""
    stats = json.loads((job.run_dir / "hub-stats.json").read_text())
    print(f"hub's final counters: {stats}")
    trained = trained_groups(job.run_dir)
    assert len(trained) == len(set(trained)) == max_steps * GROUPS_PER_STEP * 2
    assert accounting_gap(stats, inflow=0) == 0, stats
    assert stats["consumed"] == len(trained), stats
    # nothing left leased or expired: each rank leased exactly the batches it trained (none past max_steps), and
    # whatever a stopping rank's long poll is granted goes back at once (learner/prefetch.py)
    assert stats["leased"] == stats["consumed"] and stats["leased_groups"] == 0, stats
    assert stats["lease_expired"] == 0, stats
    assert stats["quarantined"] == 0 and stats["spool_corrupt"] == 0, stats
    return stats


def check_addresses(job: Job) -> None:
    """Each service was where its node is: the hub on node1's address (with the token), the learner's two ranks
    met at node2's, and rank 0 offered weight-sync groups at node2's address."""
    hub_log = (job.run_dir / "logs/ref-server.log").read_text()
    assert f"ref-server ready on {job.hub}" in hub_log, hub_log[-2000:]
    learner_log = (job.run_dir / "logs/learner.log").read_text()
    assert "learner: 2 rank(s) on cpu" in learner_log, learner_log[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_template_on_four_loopback_nodes_trains_with_exact_books(tiny_model_dir, tmp_path):
    max_steps = 4
    job = Job(tmp_path, tiny_model_dir, nodes=4, max_steps=max_steps).start()
    try:
        assert job.proc.wait(timeout=JOB_TIMEOUT_S) == 0, job.logs()
    finally:
        job.stop()
    check_addresses(job)
    records = job.steps()
    assert [r["step"] for r in records] == list(range(1, max_steps + 1))
    stats = check_books(job, max_steps)
    assert stats["accepted"] >= max_steps * GROUPS_PER_STEP * 2
    # weights went from the learner's rank 0 on node2 to the generator on node4 over a gloo group at node2's address
    # (weight_sync.host), and the generator loaded a version the learner published
    assert "weight-sync sender" in (hub_log := (job.run_dir / "logs/ref-server.log").read_text())
    assert "(gloo at 127.0.0.3)" in hub_log, hub_log[-2000:]
    gen_log = (job.run_dir / "logs/gen-node4-g0.log").read_text()
    assert "weight sync: connected to tcp://127.0.0.3:" in gen_log, gen_log[-2000:]
    assert "policy version 0 -> " in gen_log, gen_log[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_losing_a_generator_node_mid_run_loses_no_accepted_group(tiny_model_dir, tmp_path):
    max_steps = 6
    job = Job(tmp_path, tiny_model_dir, nodes=5, max_steps=max_steps).start()
    deadline = time.monotonic() + JOB_TIMEOUT_S
    try:
        job.wait_steps(2, deadline)
        # the hub on node1's address answers only with the token
        assert requests.get(f"{job.hub}/v1/hub/stats", timeout=10).status_code == 401
        assert requests.get(f"{job.hub}/v1/hub/stats", headers={"Authorization": f"Bearer {TOKEN}"},
                            timeout=10).status_code == 200
        # node5 dies while the hub holds groups it accepted from node5's generator (not yet trained)
        while not (accepted_from_dead := spooled_groups_of(job.run_dir, "node5-g0")):
            assert job.proc.poll() is None and time.monotonic() < deadline, job.logs()
            time.sleep(0.1)
        assert job.kill_node("node5") == 1
        steps_at_kill = len(job.steps())
        assert job.proc.wait(timeout=max(deadline - time.monotonic(), 1)) == 0, job.logs()
    finally:
        job.stop()
    check_addresses(job)
    assert steps_at_kill < max_steps == len(job.steps())  # training went on after the node was lost
    stats = check_books(job, max_steps)
    # every group of the dead node's that the hub held at the kill was trained afterwards, or is still spooled
    # (queued) at the end; none was dropped (no stale drops in this run, so none can hide there)
    assert stats["dropped_stale"] == 0, stats
    left = accepted_from_dead - set(trained_groups(job.run_dir)) - spooled_groups_of(job.run_dir, "node5-g0")
    assert left == set(), (left, stats)
    # the run's trained groups came from both generator nodes' generators: node4's kept it going
    assert "node4-g0" in (job.run_dir / "logs/gen-node4-g0.log").read_text()
