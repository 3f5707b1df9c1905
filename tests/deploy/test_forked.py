"""Services forked from the launcher (deploy/forked.py): each child is the process a fresh interpreter would be."""

import os
import subprocess
import threading
import time

import pytest

from deploy.forked import fork_service
from deploy.launcher import Service, plan
from shared.config.loader import load_config
from tests.deploy.test_configs import ROOT


def report(argv: list[str]) -> int:
    """A service that prints what it sees: its arguments, an env variable, torch threads and seed, its session."""
    import sys

    import torch

    print("argv", " ".join(argv))
    print("env", os.environ.get("GRPO_TEST_VALUE"), "PARENT_ONLY" in os.environ)
    print("threads", torch.get_num_threads())
    print("seed", torch.initial_seed())
    print("session", os.getsid(0) == os.getpid(), os.getpgid(0) == os.getpid())
    print("stdin", sys.stdin.read() == "")
    print("to stderr", file=sys.stderr)
    return 3


def failing(argv: list[str]) -> int:
    raise RuntimeError("the service broke: " + argv[0])


def sleeping(argv: list[str]) -> int:
    time.sleep(60)
    return 0


def output_of(process) -> dict[str, str]:
    lines = [line.rstrip("\n") for line in process.stdout]
    return {line.split(" ", 1)[0]: line.split(" ", 1)[1] if " " in line else "" for line in lines}


@pytest.mark.slow
def test_a_forked_service_gets_its_arguments_environment_threads_and_own_session(monkeypatch):
    monkeypatch.setenv("PARENT_ONLY", "1")
    env = {"GRPO_TEST_VALUE": "forty-two", "OMP_NUM_THREADS": "1", "PATH": os.environ["PATH"]}
    first = fork_service(["learner", "--config", "c.yaml"], env, entry=report)
    seen = output_of(first)
    assert first.wait(timeout=30) == 3
    assert seen["argv"] == "learner --config c.yaml"
    assert seen["env"] == "forty-two False"       # the service's environment only, not the launcher's
    assert seen["threads"] == "1"                 # OMP_NUM_THREADS applied although torch loaded before the fork
    assert seen["session"] == "True True"         # its own session and process group (what the launcher signals)
    assert seen["stdin"] == "True"
    assert "to" in seen and seen["to"] == "stderr"  # stderr comes through the same pipe
    second = fork_service(["gen"], {**env, "OMP_NUM_THREADS": "2"}, entry=report)
    other = output_of(second)
    assert second.wait(timeout=30) == 3 and other["threads"] == "2"
    assert other["seed"] != seen["seed"]         # reseeded like a fresh process, not the launcher's stream


@pytest.mark.slow
def test_a_service_that_raises_exits_1_with_its_traceback():
    process = fork_service(["gen-7"], {"PATH": os.environ["PATH"]}, entry=failing)
    text = process.stdout.read()
    assert process.wait(timeout=30) == 1
    assert "RuntimeError: the service broke: gen-7" in text and "Traceback" in text


@pytest.mark.slow
def test_stop_terminates_a_forked_service_and_wait_times_out_while_it_runs(tmp_path):
    service = Service("gen-0", ["grpo", "gen"], {"PATH": os.environ["PATH"]}, tmp_path / "gen-0.log",
                      fork_argv=["gen"])
    service.process = fork_service(["gen"], service.env, entry=sleeping)
    service.start_reader(threading.Lock())
    with pytest.raises(subprocess.TimeoutExpired):
        service.process.wait(timeout=0.3)
    assert service.process.poll() is None
    started = time.monotonic()
    service.stop(grace_s=10)
    assert service.process.returncode == -15 and time.monotonic() - started < 5


def test_plan_forks_cpu_services_only(tmp_path, monkeypatch):
    config = load_config(ROOT / "deploy" / "configs" / "tiny-cpu.yaml")
    services = {s.name: s for s in plan(config, tmp_path / "c.yaml", tmp_path)}
    assert services["ref-server"].fork_argv is None     # started fresh, beside the launcher's imports
    assert services["learner"].fork_argv == ["learner", "--config", str(tmp_path / "c.yaml")]
    assert services["gen-0"].fork_argv == ["generator", "--config", str(tmp_path / "c.yaml"), "--id", "gen-0"]
    data = config.model_dump(mode="json")
    data["run"]["learner_ranks"] = 2                    # torchrun starts the ranks: never forked
    services = {s.name: s for s in plan(type(config).model_validate(data), tmp_path / "c.yaml", tmp_path)}
    assert services["learner"].fork_argv is None and services["gen-0"].fork_argv is not None
    data["generator"]["engine"] = "vllm"               # vLLM starts its own processes: a fresh generator
    services = {s.name: s for s in plan(type(config).model_validate(data), tmp_path / "c.yaml", tmp_path)}
    assert services["gen-0"].fork_argv is None
    data["run"]["fork_services"] = False
    assert all(s.fork_argv is None for s in plan(type(config).model_validate(data), tmp_path / "c.yaml", tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    data["run"]["fork_services"] = True
    data["run"]["learner_ranks"] = None
    data["run"]["placement"] = {"learner": [1], "generators": [[]], "ref_server": []}  # one service on a GPU
    assert all(s.fork_argv is None for s in plan(type(config).model_validate(data), tmp_path / "c.yaml", tmp_path))
