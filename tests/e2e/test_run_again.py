"""`grpo run` a second time on one config: refused with the two flags, then --fresh starts over; and `grpo run
--resume` after a Ctrl-C continues the step and the weights version where they stopped (tiny model, real processes).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import service_forks as forks
from tests.e2e.test_run import free_port, stray_processes

GRPO = str(Path(sys.executable).parent / "grpo")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def write_config(tmp_path: Path, model_dir, *, max_steps: int, checkpoint_every=None) -> Path:
    """Only run.run_dir names a folder: every state path derives from it."""
    config = {
        "algorithm": {"loss": {"beta": 0.0}},
        "ref_server": {"port": free_port(), "queue_capacity": 4},
        "generator": {"model": str(model_dir), "engine": "transformers", "group_size": 4, "prompts_per_batch": 2,
                      "sampling": {"max_tokens": 6}, "rewards": [{"name": "arithmetic"}]},
        "learner": {"model": str(model_dir), "groups_per_step": 2, "max_steps": max_steps, "lr": 1e-3,
                    "checkpoint_every": checkpoint_every, "tensorboard_dir": None, "batch_wait_s": 1.0},
        "run": {"run_dir": str(tmp_path / "run"), "stop_grace_s": 20},
    }
    path = tmp_path / "train.yaml"
    path.write_text(json.dumps(config))
    return path


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def grpo_run(config: Path, *flags: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return forks.run([GRPO, "run", str(config), *flags], capture_output=True, text=True, timeout=timeout,
                          env=ENV)


@pytest.mark.slow
def test_a_second_run_is_refused_naming_both_flags_and_disk_holds_what_the_config_asks(tiny_model_dir, tmp_path):
    config = write_config(tmp_path, tiny_model_dir, max_steps=2)
    run_dir = tmp_path / "run"
    first = grpo_run(config)
    assert first.returncode == 0, first.stdout[-3000:]
    assert [m["step"] for m in metrics(run_dir)] == [1, 2]
    # checkpoint_every null and a run that finished: no checkpoint, so no weight copies to resume from either;
    # the model folder is the one copy of the weights
    assert not list((run_dir / "checkpoints").glob("step*"))
    assert sorted(p.name for p in run_dir.rglob("*.safetensors")) == ["model.safetensors"]
    assert "[grpo run] the relay's and generators' weight copies are deleted (" in first.stdout
    assert f"{run_dir / 'model'} holds the final weights\n" in first.stdout
    last = first.stdout.strip().splitlines()[-5:]
    assert last[0].startswith(f"[grpo run] model: {run_dir / 'model'} (Hugging Face folder, ")
    assert (run_dir / "model" / "model.safetensors").is_file()
    assert f"[grpo run] logs: {run_dir / 'logs'}" in last and f"[grpo run] metrics: {run_dir / 'metrics.jsonl'}" in last
    assert "[grpo run] checkpoint: none" in last and last[-1].endswith("exit status 0")

    logs_before = sorted((p.name, p.stat().st_size) for p in (run_dir / "logs").iterdir())
    again = grpo_run(config, timeout=120)
    assert again.returncode == 2
    # refused before anything started: no output, the earlier run's logs untouched
    assert again.stdout == "" and sorted((p.name, p.stat().st_size) for p in (run_dir / "logs").iterdir()) == logs_before
    (line,) = again.stderr.strip().splitlines()
    assert line.startswith(f"grpo run: error: {run_dir} holds an earlier run's state")
    assert "--resume" in line and "--fresh" in line

    assert stray_processes(str(config)) == []


@pytest.mark.slow
def test_fresh_deletes_the_earlier_runs_state_and_starts_over(tiny_model_dir, tmp_path):
    config = write_config(tmp_path, tiny_model_dir, max_steps=1)
    run_dir = tmp_path / "run"
    # what an earlier run of 5 steps left (written here: a real first run is the test above); a hub still holding
    # its learner at version 5 would make the new learner refuse to start
    (run_dir / "ref_server" / "relay").mkdir(parents=True)
    (run_dir / "ref_server" / "relay" / "learner.json").write_text(json.dumps({"session": "old", "version": 5}))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)))
    (run_dir / "notes.txt").write_text("mine")
    fresh = grpo_run(config, "--fresh")
    assert fresh.returncode == 0, fresh.stdout[-3000:]
    assert "--fresh: deleted the earlier run's" in fresh.stdout
    assert [m["step"] for m in metrics(run_dir)] == [1]  # a new run: the old metrics were deleted, not appended to
    assert (run_dir / "notes.txt").read_text() == "mine"  # nothing but the run's state is deleted
    assert stray_processes(str(config)) == []


@pytest.mark.slow
def test_resume_after_ctrl_c_continues_step_and_version(tiny_model_dir, tmp_path):
    config = write_config(tmp_path, tiny_model_dir, max_steps=1000)
    run_dir = tmp_path / "run"
    proc = forks.popen([GRPO, "run", str(config)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=ENV)
    try:
        deadline = time.monotonic() + 240
        while len(metrics(run_dir)) < 2:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out[-3000:]
    stopped = metrics(run_dir)[-1]
    step, version = stopped["step"], stopped["version"]
    assert f"checkpoint: {run_dir / 'checkpoints' / f'step{step:08d}'} (step {step}, " in out
    assert f"continue with: grpo run {config} --resume" in out

    resumed = grpo_run(config, "--resume", "--set", f"learner.max_steps={step + 2}")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert (f"resuming {run_dir}: the learner from checkpoint step{step:08d} (step {step}, weights version "
            f"{version})") in resumed.stdout
    after = metrics(run_dir)
    assert [m["step"] for m in after] == [*range(1, step + 1), step + 1, step + 2]
    assert [m["version"] for m in after[-2:]] == [version + 1, version + 2]
    # the learner's exit checkpoint of the resumed run is there too (it stopped at max_steps: checkpoint_every is
    # null, so no new one is written on a normal finish; the one it resumed from is kept)
    assert (run_dir / "checkpoints" / f"step{step:08d}" / "COMPLETE").is_file()
    assert stray_processes(str(config)) == []


@pytest.mark.slow
def test_a_finished_run_keeps_what_a_resume_needs_and_says_so_when_resumed_as_is(tiny_model_dir, tmp_path):
    """A finished run with checkpoints: ``keep_checkpoints`` of them stay, no weight copy stays beside the model
    (neither the relay's nor a generator's), the last lines give sizes; ``--resume`` as is says the run is finished at
    once, and with a raised ``learner.max_steps`` it trains on from the kept checkpoint, its learner publishing the
    checkpoint's weights to the empty relay for its generators."""
    config = write_config(tmp_path, tiny_model_dir, max_steps=3, checkpoint_every=1)
    config.write_text(config.read_text().replace('"batch_wait_s": 1.0', '"batch_wait_s": 1.0, "keep_checkpoints": 1'))
    run_dir = tmp_path / "run"
    first = grpo_run(config)
    assert first.returncode == 0, first.stdout[-3000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step*")) == ["step00000003"]
    # the model folder holds the final weights: no copy of them on the relay, none in a generator's folder
    assert sorted(p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*.safetensors")) == [
        "model/model.safetensors"]
    out = first.stdout
    assert re.search(r"\[grpo run\] the relay's and generators' weight copies are deleted \(\d+\.\d (KB|MB)\): "
                     rf"{re.escape(str(run_dir / 'model'))} holds the final weights, and a --resume publishes them "
                     "again from the checkpoint", out), out[-2000:]
    assert f"[grpo run] checkpoint: {run_dir / 'checkpoints' / 'step00000003'} (step 3, " in out
    assert re.search(r"\(step 3, \d+\.\d (KB|MB)\); continue with", out), out[-2000:]
    assert "[grpo run] relay: " not in out

    started = time.monotonic()
    again = grpo_run(config, "--resume", timeout=120)
    assert again.returncode == 2 and again.stdout == "", again.stdout[-2000:]
    assert again.stderr.startswith(f"grpo run: error: {run_dir} is finished: its learner reached step 3 of "
                                   "learner.max_steps 3"), again.stderr
    assert time.monotonic() - started < 60

    learner_log = run_dir / "logs" / "learner.log"
    first_log = len(learner_log.read_text())
    further = grpo_run(config, "--resume", "--set", "learner.max_steps=4")
    assert further.returncode == 0, further.stdout[-3000:]
    assert [m["step"] for m in metrics(run_dir)] == [1, 2, 3, 4]
    # trained on the checkpoint's weights (version 3, published again), into version 4
    assert [m["version"] for m in metrics(run_dir)] == [1, 2, 3, 4]
    assert "weight sync: version 3 on the relay" in learner_log.read_text()[first_log:]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step*")) == ["step00000004"]
    assert sorted(p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*.safetensors")) == [
        "model/model.safetensors"]
    assert stray_processes(str(config)) == []
