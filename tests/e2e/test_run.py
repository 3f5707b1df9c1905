"""End to end: the three services as real processes on 127.0.0.1 with the tiny model."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from shared.protocol.health import wait_healthy
from tests import service_forks as forks

ROOT = Path(__file__).resolve().parents[2]
GRPO = str(Path(sys.executable).parent / "grpo")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_config(tmp_path, model_dir, port, **learner):
    config = {
        "seed": 0,
        "algorithm": {"loss": {"beta": 0.04}},
        # a small queue: the generator cannot run far ahead while the learner starts, so it sees new versions
        "ref_server": {"model": str(model_dir), "port": port, "spool_dir": str(tmp_path / "spool"),
                       "weights_dir": str(tmp_path / "relay"), "queue_capacity": 4},
        "generator": {"model": str(model_dir), "engine": "transformers", "group_size": 4, "prompts_per_batch": 2,
                      "sampling": {"max_tokens": 8}, "weights_dir": str(tmp_path / "gen-weights"),
                      "rewards": [{"name": "arithmetic"}, {"name": "format", "weight": 0.1}]},
        "learner": {"model": str(model_dir), "groups_per_step": 2, "max_steps": 6, "lr": 1e-3,
                    "checkpoint_dir": str(tmp_path / "ckpt"), "output_dir": str(tmp_path / "final"),
                    "metrics_jsonl": str(tmp_path / "metrics.jsonl"), "tensorboard_dir": None,
                    "batch_wait_s": 2.0, **learner},
        "run": {"run_dir": str(tmp_path / "run"), "stop_grace_s": 20},
    }
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(config))
    return path


def stray_processes(marker: str) -> list[str]:
    # -ww: whole command lines (without it ps cuts them at 80 columns when it has no terminal, as under pytest,
    # and a long marker, such as a config path in the test's temporary folder, would never be found)
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -ww" not in line]


@pytest.mark.slow
def test_grpo_run_trains_publishes_and_shuts_down(tiny_model_dir, tmp_path):
    port = free_port()
    config = write_config(tmp_path, tiny_model_dir, port)
    data = json.loads(config.read_text())
    data["ref_server"]["access_log"] = True
    data["run"]["startup_report_s"] = 0.5   # the start-up lines, twice a second until the first step
    config.write_text(json.dumps(data))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # a fresh process, imports and all (the other e2e tests fork `grpo` from the tests' zygote: service_forks.py)
    result = subprocess.run([GRPO, "run", str(config)], capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "[grpo run] the learner finished: stopping the other services" in result.stdout
    assert "[ref-server]" in result.stdout and "[gen-0]" in result.stdout and "[learner]" in result.stdout
    # the console (run.console: progress): one line per step and a bounded rest; the access log only in the file
    console = result.stdout.splitlines()
    steps = [line for line in console if line.startswith("[learner] step ")]
    assert [line.split()[2] for line in steps] == [f"{i}/6" for i in range(1, 7)], console
    startup = [line for line in console if line.startswith("[grpo run] == start-up ")]
    assert len(console) - len(steps) - len(startup) <= 25, console
    check_startup_lines(console, startup)
    assert "HTTP/1.1" not in result.stdout
    assert '"GET /healthz HTTP/1.1" 200' in (tmp_path / "run" / "logs" / "ref-server.log").read_text()
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert all(abs(m["loss"]) < 1e6 for m in metrics) and metrics[-1]["version"] == 6
    # the default with one update per batch: bypass (no recompute, no weights) and the drift measured every step
    assert all(m["mismatch_kl"] >= 0 and m["is_weight_max"] == 1.0 for m in metrics)
    assert metrics[0]["mismatch_tokens/lag_0"] > 0
    generator_log = (tmp_path / "run" / "logs" / "gen-0.log").read_text()
    assert "policy version 0 -> " in generator_log  # a published version reached the generator
    assert (tmp_path / "run" / "config.yaml").exists() and (tmp_path / "final" / "model.safetensors").exists()
    assert stray_processes(str(config)) == []


# what each service says it does while it starts, in the order it does it (deploy/startup_report.py)
STARTUP_ORDER = {
    "learner": ("starting", "loading the model", "setting up DeepSpeed", "registering with the hub",
                "waiting for the first batch", "training step 1"),
    "gen-0": ("starting", "loading the model", "generating the first groups", "uploaded its first"),
}


def check_startup_lines(console: list[str], startup: list[str]) -> None:
    """The start-up lines come before the first step's line, each naming what the learner and the generator do, in
    the order they do it, with the time since the run started growing."""
    first_step = next(i for i, line in enumerate(console) if line.startswith("[learner] step 1/"))
    # at least one line, all before the first step (how many is timing: a loaded machine gave two, both at 12 s)
    assert len(startup) >= 1 and console.index(startup[-1]) < first_step, console
    seen: dict[str, list[int]] = {name: [] for name in STARTUP_ORDER}
    totals = []
    for line in startup:
        head, _, services = line[len("[grpo run] == start-up "):].partition(": ")
        totals.append(head)
        for part in services.split("; "):
            name, _, phase = part.partition(": ")
            if name in STARTUP_ORDER:
                seen[name].append(next(i for i, p in enumerate(STARTUP_ORDER[name]) if phase.startswith(p)))
    seconds = [int(m or 0) * 60 + int(sec) for m, sec in (re.fullmatch(r"(?:(\d+)m)?(\d+)s", t).groups()
                                                          for t in totals)]
    assert seconds == sorted(seconds), startup
    for name, phases in seen.items():
        assert phases == sorted(phases), (name, startup)   # never back to an earlier phase
    # more than the first phase of each when the lines span the start-up: they follow what the services say they do
    # (how far the learner got before its first step is a matter of timing: the lines come every 0.5 s, and a fast
    # start-up passes DeepSpeed's set-up and the registration between two of them, as a CI run did; a loaded one
    # may show only the first 0.5 s; the phases themselves are tested with a clock in tests/deploy)
    if len(startup) >= 3:
        assert max(seen["learner"]) >= STARTUP_ORDER["learner"].index("loading the model"), startup
        assert max(seen["gen-0"], default=99) >= 1, startup


@pytest.mark.slow
def test_a_service_that_dies_stops_the_run_with_its_last_lines(tiny_model_dir, tmp_path):
    config = write_config(tmp_path, tiny_model_dir, free_port())
    data = json.loads(config.read_text())
    # a death the checks before start cannot see (they import the reward and check its signature): a reward that
    # raises on every completion stops the generator after its first batch (generator/failures.py), exit 2 (the
    # user's to fix), and the run with it, naming the line that raised; the learner never trained: no checkpoint
    (tmp_path / "boom.py").write_text("def score(prompt, completion, example):\n    raise KeyError('label_xyz')\n")
    data["generator"]["rewards"] = [{"name": "python", "args": {"function": f"{tmp_path}/boom.py:score"}}]
    config.write_text(json.dumps(data))
    result = forks.run([GRPO, "run", str(config)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    # the generator's 2 (the user fixes the reward) is the run's: not 1, a service that had to give up
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert "gen-0 exited with status 2; its last lines:" in result.stdout
    assert ("reward 'python' failed on all 8 completions it was given so far: the rule is to stop at 50% of a window "
            "of 64") in result.stdout
    assert f"the first failure in the window: KeyError: 'label_xyz' (at {tmp_path}/boom.py:2 in score)" in result.stdout
    assert f'File "{tmp_path}/boom.py", line 2, in score' in result.stdout   # its traceback, on the console
    assert "checkpoint: none" in result.stdout and "model: none written" in result.stdout
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").glob("step*"))
    assert stray_processes(str(config)) == []


@pytest.mark.slow
def test_training_continues_when_a_generator_is_killed_and_another_starts(tiny_model_dir, tmp_path):
    port = free_port()
    config = write_config(tmp_path, tiny_model_dir, port, max_steps=8)
    data = json.loads(config.read_text())  # and the off-policy path that recomputes pi_old and masks tokens
    data["algorithm"]["off_policy"] = {"bypass": False, "mode": "token_mask", "low": 0.5, "high": 2.0}
    config.write_text(json.dumps(data))
    hub = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {}

    def start(name, *args):
        procs[name] = forks.popen([GRPO, *args, "--config", str(config)], env=env, stdout=subprocess.DEVNULL,
                                  stderr=open(tmp_path / f"{name}.log", "w"), start_new_session=True)

    try:
        start("ref", "ref-server")
        wait_healthy(hub, 120, process=procs["ref"], poll_s=0.3)
        start("learner", "learner", "--hub", hub)
        start("gen-a", "generator", "--hub", hub, "--id", "gen-a")
        deadline = time.monotonic() + 300
        while requests.get(f"{hub}/v1/hub/stats", timeout=5).json()["accepted"] < 3:
            assert time.monotonic() < deadline and procs["learner"].poll() is None
            time.sleep(0.3)
        procs["gen-a"].send_signal(signal.SIGKILL)
        procs["gen-a"].wait(timeout=30)
        start("gen-b", "generator", "--hub", hub, "--id", "gen-b")
        assert procs["learner"].wait(timeout=600) == 0, (tmp_path / "learner.log").read_text()[-3000:]
        os.killpg(procs["gen-b"].pid, signal.SIGTERM)
        procs["gen-b"].wait(timeout=60)
        stats = requests.get(f"{hub}/v1/hub/stats", timeout=5).json()
    finally:
        for proc in reversed(list(procs.values())):  # generators before the hub, as `grpo run` does
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 9))
    # every group the hub accepted, from the killed generator too, is accounted for: trained (acknowledged at the
    # learner's final checkpoint), still queued or leased, or dropped as stale, and none was trained twice
    assert stats["consumed"] == 8 * 2 and all(m["duplicate_groups"] == 0 for m in metrics)
    assert all(m["time_old_logprobs_s"] > 0 and 0 <= m["off_policy_masked_token_frac"] <= 1 for m in metrics)
    for m in metrics:  # the loss counts the tokens the correction kept: all of them, less the masked share
        tokens = sum(v for k, v in m.items() if k.startswith("mismatch_tokens/lag_"))
        assert m["loss_tokens"] == pytest.approx(tokens * (1 - m["off_policy_masked_token_frac"]), abs=0.5), m
    assert stats["accepted"] == (stats["consumed"] + stats["queue_depth"] + stats["leased_groups"]
                                 + stats["dropped_stale"] + stats["dropped_ref_failure"]), stats
    stats_log = (tmp_path / "gen-b.log").read_text()
    assert "groups uploaded" in stats_log  # gen-b ran until stopped and reported what it did
    assert stray_processes(str(config)) == []
