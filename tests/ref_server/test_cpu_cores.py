"""ref_server.cpu_cores: validated in the schema, checked against the machine before anything starts (one line
naming the key, exit 2), and applied by `grpo ref-server` to its process and every thread (ref_server/cpu_cores.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from hypothesis import given
from hypothesis import strategies as st

from deploy.preflight import RUN_CHECKS, PreflightError, require
from ref_server.cpu_cores import cpu_cores_problem
from shared.config.loader import ConfigError, load_config
from shared.config.schema import GRPOConfig, RefServerConfig
from shared.ports import bind_port
from shared.protocol.health import ServerExited, wait_healthy

GRPO = str(Path(sys.executable).parent / "grpo")


def test_unset_by_default_and_a_list_of_cores_is_kept_in_order():
    assert RefServerConfig().cpu_cores is None
    assert RefServerConfig(cpu_cores=[3, 0, 1]).cpu_cores == [3, 0, 1]


@pytest.mark.parametrize(("value", "reason"), [
    ("[]", "at least 1 item"), ("[-1]", "core numbers are >= 0, got -1"),
    ("[0, 1, 0]", "core 0 is listed more than once"), ("[x]", "cpu_cores.0: Input should be a valid integer"), ("0", "valid list"),
])
def test_bad_values_are_one_line_naming_the_key(value, reason):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"ref_server.cpu_cores={value}"])
    problems = str(info.value).splitlines()[1:]
    assert len(problems) == 1 and problems[0].startswith("  ref_server.cpu_cores") and reason in problems[0], \
        problems


@given(st.lists(st.integers(-3, 40), max_size=6))
def test_the_schema_accepts_exactly_non_empty_lists_of_distinct_non_negative_cores(cores):
    valid = bool(cores) and min(cores) >= 0 and len(set(cores)) == len(cores)
    try:
        assert RefServerConfig(cpu_cores=cores).cpu_cores == cores and valid
    except ValueError:
        assert not valid


def test_a_core_the_process_may_not_use_is_named_with_the_cores_it_may():
    assert cpu_cores_problem(None, {0}) is None
    assert cpu_cores_problem([1, 0], {0, 1, 2}) is None
    problem = cpu_cores_problem([0, 5], {0, 1, 2, 3, 6})
    assert problem.startswith("ref_server.cpu_cores: core 5 not available: this process may run on cores 0-3,6 ("), \
        problem
    assert cpu_cores_problem([7, 9], {0}).startswith("ref_server.cpu_cores: cores 7, 9 not available: this process "
                                                      "may run on cores 0 (")


def test_the_preflight_of_a_run_refuses_a_core_the_machine_lacks():
    missing = max(os.sched_getaffinity(0)) + 1
    config = GRPOConfig.model_validate({"ref_server": {"cpu_cores": [missing]}})
    assert "cpu_cores" in RUN_CHECKS
    with pytest.raises(PreflightError) as info:
        require(config, ["cpu_cores"])
    assert info.value.exit_code == 2
    assert str(info.value).startswith(f"ref_server.cpu_cores: core {missing} not available")
    available = sorted(os.sched_getaffinity(0))
    assert require(GRPOConfig.model_validate({"ref_server": {"cpu_cores": available[:1]}}), ["cpu_cores"]).problems \
        == []


def _free_port() -> int:
    with bind_port("127.0.0.1", 0, "test") as sock:
        return sock.getsockname()[1]


def _affinities(pid: int) -> dict[int, set[int]]:
    """Every thread of ``pid`` -> the cores it may run on."""
    return {int(tid): os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.slow
def test_ref_server_runs_every_thread_on_the_configured_core(tmp_path):
    available = sorted(os.sched_getaffinity(0))
    if len(available) < 2:
        pytest.skip("pinning is only visible with at least two cores to choose from")
    core = available[0]
    port = _free_port()
    config = tmp_path / "hub.yaml"
    config.write_text(f"algorithm:\n  loss:\n    beta: 0.0\nref_server:\n  cpu_cores: [{core}]\n"
                      f"  spool_dir: {tmp_path / 'spool'}\n  weights_dir: {tmp_path / 'w'}\n")
    proc = subprocess.Popen([GRPO, "ref-server", "--config", str(config), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        try:
            wait_healthy(f"http://127.0.0.1:{port}", 90, process=proc, poll_s=0.2)
        except ServerExited:
            pytest.fail(proc.stdout.read())
        assert requests.get(f"http://127.0.0.1:{port}/v1/hub/stats", timeout=10).status_code == 200
        threads = _affinities(proc.pid)  # all but the main thread started after the pinning
        assert len(threads) >= 2, threads
        assert all(cores == {core} for cores in threads.values()), threads
        status = Path(f"/proc/{proc.pid}/status").read_text()
        assert f"Cpus_allowed_list:\t{core}\n" in status
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, output
    assert f"ref_server.cpu_cores: this process and its threads run on core {core} only" in output


@pytest.mark.slow
def test_ref_server_refuses_a_core_the_machine_lacks_in_one_line(tmp_path):
    missing = max(os.sched_getaffinity(0)) + 1
    result = subprocess.run([GRPO, "ref-server", "--set", f"ref_server.cpu_cores=[0, {missing}]", "--set",
                             "ref_server.spool_dir=null", "--port", str(_free_port())], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"grpo ref-server: error: ref_server.cpu_cores: core {missing} not available: "
                                    "this process may run on cores "), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
