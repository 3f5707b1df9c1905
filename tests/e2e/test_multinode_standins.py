"""The Slurm stand-ins (deploy/slurm/standins/) and the template's own checks, without any grpo service: what a
task sees, how a step ends, and the template's clear exits for too few nodes and a hub that does not start."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
STANDINS = ROOT / "deploy/slurm/standins"
_spec = importlib.util.spec_from_file_location("standin_nodes", STANDINS / "nodes.py")
nodes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nodes)


def test_hostlists_expand_as_slurm_writes_them():
    assert nodes.expand_hostlist("node[1-3,7],gpu[08-10],login") == [
        "node1", "node2", "node3", "node7", "gpu08", "gpu09", "gpu10", "login"]
    with pytest.raises(nodes.StandinError, match="bad range 'x'"):
        nodes.expand_hostlist("node[x]")


@given(st.from_regex(r"[a-z]{1,6}", fullmatch=True), st.integers(0, 500), st.integers(0, 40), st.integers(1, 3))
def test_a_range_expands_to_every_number_once_with_its_padding(prefix, low, span, width):
    high = low + span
    names = nodes.expand_hostlist(f"{prefix}[{low:0{width}d}-{high}]")
    assert len(names) == span + 1 == len(set(names))
    assert names[0] == f"{prefix}{low:0{width}d}" and names[-1] == f"{prefix}{high:0{width}d}"


def env(tmp_path: Path, **extra: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**clean, "PATH": f"{STANDINS}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node[1-3]",
            "GRPO_STANDIN_NODES": "node1=127.0.0.2,node2=127.0.0.3,node3=127.0.0.4",
            "GRPO_STANDIN_STATE": str(tmp_path / "pids"), **extra}


@pytest.mark.slow
def test_srun_gives_each_task_its_slurm_variables_and_reports_the_first_failure(tmp_path):
    show = 'echo $SLURMD_NODENAME $SLURM_PROCID $SLURM_LOCALID $SLURM_NTASKS $GRPO_STANDIN_NODE_ADDR $FOO'
    out = subprocess.run(["srun", "--nodes=2", "--ntasks=4", "--ntasks-per-node=2", "--nodelist=node[2-3]",
                          "--export=ALL,FOO=bar", "bash", "-c", show], env=env(tmp_path), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["node2 0 0 4 127.0.0.3 bar", "node2 1 1 4 127.0.0.3 bar",
                                               "node3 2 0 4 127.0.0.4 bar", "node3 3 1 4 127.0.0.4 bar"]
    assert len(list((tmp_path / "pids/node2").iterdir())) == 2  # what a test kills a node by
    # --kill-on-bad-exit: rank 1 fails, rank 0 (sleeping) is terminated at once, the step reports rank 1's status
    started = time.monotonic()
    out = subprocess.run(["srun", "-N", "2", "--kill-on-bad-exit=1", "bash", "-c",
                          '[ "$SLURM_PROCID" = 1 ] && exit 3; sleep 60'], env=env(tmp_path), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 3 and time.monotonic() - started < 20, out.stderr
    out = subprocess.run(["srun", "--mem=4G", "true"], env=env(tmp_path), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "option '--mem=4G' is not stood in for" in out.stderr
    out = subprocess.run(["scontrol", "show", "node", "node9"], env=env(tmp_path), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "node 'node9' is not in GRPO_STANDIN_NODES" in out.stderr


@pytest.mark.slow
def test_the_template_exits_with_a_reason_for_too_few_nodes_and_a_hub_that_dies(tmp_path):
    template = ["bash", str(ROOT / "deploy/slurm/grpo-multinode.sbatch")]
    base = env(tmp_path, SLURM_JOB_ID="1", RUN_DIR=str(tmp_path / "run"), GPUS_PER_NODE="0", GRPO="false",
               GRPO_TOKEN="t")
    out = subprocess.run(template, env={**base, "LEARNER_NODES": "2"}, cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2, out.stderr
    assert "3 nodes; need 1 hub + 2 learner + at least 1 generator node" in out.stderr
    out = subprocess.run(template, env={**base, "LEARNER_NODES": "1", "PORT": "1"}, cwd=ROOT, capture_output=True,
                         text=True, timeout=60)  # `false` as grpo: the hub's step exits at once
    assert out.returncode == 1, out.stderr
    assert "the ref server on node1 exited; its log:" in out.stderr
