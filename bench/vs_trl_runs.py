"""The two sides' runs of bench/vs_trl.py, each on its clock from launch: TRL's ``GRPOTrainer`` in its own process
(bench/vs_trl_trl.py) and ``grpo run`` with its three services; bench/vs_trl.py evaluates their snapshots and
reports (its docstring says what is compared and how)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.vs_trl_trl import TRLRequest, TRLResult
from shared.config.schema import GRPOConfig

TRL_CHILD = Path(__file__).resolve().with_name("vs_trl_trl.py")


# -- TRL (its own process: bench/vs_trl_trl.py) -------------------------------------------------------------
def wait_for(command: list[str], log, cwd: Path | None = None) -> int:
    """Run ``command`` in its own session with its output in ``log``; its exit status. Ctrl-C stops its group."""
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
        raise


def check_trl_installed() -> None:
    """The parent never imports TRL (its import time belongs to TRL's clock, in the child); it only checks."""
    missing = [name for name in ("trl", "datasets") if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"{' and '.join(missing)} not installed for {sys.executable}: TRL's side of this benchmark "
                         "needs the bench extra: .venv/bin/pip install -e '.[bench]' (or --skip-trl --target ACC)")


def run_trl(config: GRPOConfig, model_dir: str, device: str, steps: list[int], run_dir: Path) -> dict:
    """TRL's ``GRPOTrainer`` in a subprocess, launched as ``grpo run`` is: the clock starts at ``Popen``."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    request = TRLRequest(config=json.loads(config.model_dump_json()), model_dir=str(Path(model_dir).resolve()),
                         device=device, eval_steps=steps, out_dir=str(run_dir),
                         result_path=str(run_dir / "result.json"))
    request.write(run_dir / "request.json")
    log_path = run_dir / "trl.log"
    load = os.getloadavg()
    with open(log_path, "w") as log:
        wall_start = time.time()
        status = wait_for([sys.executable, str(TRL_CHILD), str(run_dir / "request.json")], log)
        process_s = time.time() - wall_start
    result = read_trl_result(status, Path(request.result_path), log_path)
    run = trl_run(result, wall_start)
    folders = {step: (Path(result.snapshots[step]) if step in result.snapshots else None) for step in steps}
    return run | {"folders": folders, "process_s": process_s, "load_avg_at_start": load,
                  "missing_snapshots": [s for s, f in folders.items() if f is None]}


def read_trl_result(status: int, result_path: Path, log_path: Path) -> TRLResult:
    """The child's result file, or a SystemExit that says why there is none (with the end of the child's log)."""
    if status != 0 or not result_path.exists():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:]) if log_path.exists() else ""
        why = f"exited with status {status}" if status != 0 else f"wrote no {result_path}"
        raise SystemExit(f"TRL's process (bench/vs_trl_trl.py) {why}; see {log_path}; its last lines:\n{tail}")
    try:
        return TRLResult.from_json(result_path.read_text())
    except (ValueError, TypeError) as exc:  # JSONDecodeError is a ValueError
        raise SystemExit(f"{result_path}: not a TRL result file ({exc})") from exc


def trl_clock(result: TRLResult, wall_start: float) -> dict[int, float]:
    """Seconds from launch to each step's end, less the snapshot time before it. A step's snapshot is saved after
    its stamp, so it is taken off from the next step on (as ``time_checkpoint_s`` is on our side)."""
    clock, paused = {}, 0.0
    for step in sorted(result.step_end_at):
        clock[step] = result.step_end_at[step] - wall_start - paused
        paused += result.save_s.get(step, 0.0)
    return clock


def trl_run(result: TRLResult, wall_start: float) -> dict:
    """The TRL run's clock and its start-up parts. ``clock`` is from launch (the headline, as ours);
    ``clock_from_model_load`` starts after the imports (the benchmark's first definition, kept to compare)."""
    clock = trl_clock(result, wall_start)
    if not clock:
        raise SystemExit("TRL's process reported no training step")
    imports = result.imports_done_at - wall_start
    ready = result.trainer_ready_at - wall_start
    first = clock[min(clock)]
    snapshot_s = sum(result.save_s.values())
    return {"clock": clock, "clock_from_model_load": {step: t - imports for step, t in clock.items()},
            "total_s": result.train_done_at - wall_start - snapshot_s,
            "interpreter_start_s": result.started_at - wall_start,
            "imports_s": result.imports_done_at - result.started_at,
            "interpreter_and_imports_s": imports,
            "model_load_and_trainer_s": ready - imports,
            "setup_s": ready - imports,  # the old key: model load to trainer built
            "first_step_duration_s": first - ready, "first_step_s": first, "snapshot_s": snapshot_s,
            "rewards": result.rewards, "versions": result.versions}


def print_trl_start(name: str, run: dict) -> None:
    print(f"[bench] {name}: from launch: interpreter + imports {run['interpreter_and_imports_s']:.1f} s "
          f"(interpreter {run['interpreter_start_s']:.1f} s, imports {run['imports_s']:.1f} s), model load + "
          f"trainer {run['model_load_and_trainer_s']:.1f} s, first step {run['first_step_duration_s']:.1f} s: "
          f"first step done at {run['first_step_s']:.1f} s; snapshots took {run['snapshot_s']:.1f} s (off the clock)",
          flush=True)


# -- grpo run ------------------------------------------------------------------------------------------------
def grpo_config(config: GRPOConfig, run_dir: Path, port: int, device: str, model_dir: str, **changes) -> Path:
    """The config for one ``grpo run``: fresh state under ``run_dir`` (absolute paths, so the run may start in
    another source tree). Only non-default values are written, so an older tree's schema reads it too."""
    run_dir = run_dir.resolve()
    data = config.model_dump(mode="json", exclude_defaults=True)
    model = str(Path(model_dir).resolve())
    changes = {
        "ref_server__model": model, "generator__model": model, "learner__model": model,
        "ref_server__port": port, "ref_server__spool_dir": str(run_dir / "spool"),
        "ref_server__weights_dir": str(run_dir / "relay"), "generator__weights_dir": str(run_dir / "gen-weights"),
        "learner__checkpoint_dir": str(run_dir / "checkpoints"), "learner__output_dir": str(run_dir / "final"),
        "learner__metrics_jsonl": str(run_dir / "metrics.jsonl"), "learner__tensorboard_dir": None,
        "run__run_dir": str(run_dir), **changes}
    if device == "cuda":
        changes.update(run__placement={"ref_server": [0], "learner": [0],
                                       "generators": [[0]] * config.run.num_generators}, learner__device="cuda")
    else:
        changes.update(run__placement={"ref_server": [], "learner": [], "generators": []}, learner__device="cpu",
                       generator__device="cpu", ref_server__device="cpu")
    for dotted, value in changes.items():
        node = data
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    GRPOConfig.model_validate(data)  # a bad change fails here, naming the key
    path = run_dir / "bench-config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def checkpoint_folder(model_dir: str, checkpoints: Path, step: int, out: Path) -> Path | None:
    """The learner's DeepSpeed checkpoint of ``step`` as a Hugging Face folder (None if there is none)."""
    import torch
    from transformers import AutoModelForCausalLM

    states = checkpoints / f"step{step:08d}" / "mp_rank_00_model_states.pt"
    if not states.exists():
        return None
    # our own learner's file on this machine, not network input; DeepSpeed pickles its client state next to it
    module = torch.load(states, map_location="cpu", weights_only=False)["module"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(module)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for item in Path(model_dir).iterdir():  # the tokenizer's files (save_pretrained wrote the model's)
        if item.is_file() and not (out / item.name).exists() and not item.name.endswith((".safetensors", ".bin")):
            shutil.copy2(item, out / item.name)
    return out


def run_grpo(config: GRPOConfig, model_dir: str, device: str, steps: list[int], every: int, run_dir: Path,
             port: int, tree: Path, **changes) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    # snapshots: a learner checkpoint every eval step (their time is taken off the clock below)
    path = grpo_config(config, run_dir, port, device, model_dir, learner__checkpoint_every=every,
                       learner__keep_checkpoints=len(steps) + 1, **changes)
    log = open(run_dir / "launcher.log", "w")
    load = os.getloadavg()
    wall_start = time.time()
    started = time.perf_counter()
    # python -m puts the working directory first on sys.path: the services run the code of ``tree``
    status = wait_for([sys.executable, "-m", "deploy.cli", "run", str(path)], log, cwd=tree)
    total = time.perf_counter() - started
    log.close()
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    if status != 0 and len(records) < config.learner.max_steps:
        raise SystemExit(f"grpo run failed with status {status}; see {run_dir / 'launcher.log'}")
    if status != 0:  # every step done, then a non-zero exit (e.g. a crash at shutdown): kept, and said
        print(f"[bench] warning: grpo run exited with status {status} after all {len(records)} steps; see "
              f"{run_dir / 'launcher.log'}", flush=True)
    clock, snapshot_s = {}, 0.0
    for r in records:  # a checkpoint's time is charged to the next step's record (time_checkpoint_s)
        snapshot_s += r.get("time_checkpoint_s", 0.0)
        clock[r["step"]] = r["time"] - wall_start - snapshot_s
    folders = {}
    for step in steps:  # each DeepSpeed checkpoint (weights and optimizer: GBs for a real model) dropped once converted
        folders[step] = checkpoint_folder(model_dir, run_dir / "checkpoints", step,
                                          run_dir / "snapshots" / f"step{step:06d}")
        shutil.rmtree(run_dir / "checkpoints" / f"step{step:08d}", ignore_errors=True)
    return {"clock": clock, "folders": folders, "total_s": total, "first_step_s": clock[min(clock)],
            "rewards": [r["reward_mean"] for r in records], "step_time_ms": step_breakdown(records[1:]),
            "snapshot_s": snapshot_s, "exit_status": status, "load_avg_at_start": load, "missing_snapshots": [s for s, f in folders.items() if f is None]}


def step_breakdown(records: list[dict]) -> dict[str, float]:
    """Medians (ms) of the learner's step parts (the first step, which includes set-up, is left out).
    ``overhead`` = step - compute; ``overhead_without_wait`` also leaves out waiting for groups the hub did not
    have yet (generation-bound runs wait there; it is not the learner's own cost)."""
    if not records or "time_step_s" not in records[0]:
        return {}

    def median(values):
        values = sorted(values)
        return round(1000 * values[len(values) // 2], 2)

    keys = [k for k in records[0] if k.startswith("time_") and k.endswith("_s")]
    result = {k.removeprefix("time_").removesuffix("_s"): median(r[k] for r in records) for k in keys}
    result["overhead_without_wait"] = median(r["time_overhead_s"] - r["time_wait_s"] for r in records)
    return result
