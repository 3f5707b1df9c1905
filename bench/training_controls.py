"""Issue 40, item 6 on the tiny demo: evaluation while training's cost in steps per minute, and the curriculum's
effect on the steps to a held-out accuracy. Each arm is one `grpo run` of deploy/configs/tiny-cpu.yaml (its own
run folder, --fresh, same seed), one after the other; the figures come from each run's metrics.jsonl (the learner's
step times) and eval.jsonl (the evaluator's held-out accuracy per version).

    python bench/training_controls.py overhead --seeds 0 1 --out runs/bench/controls
    python bench/training_controls.py curriculum --seeds 0 1 --pool 200 --out runs/bench/controls

``overhead``: arms ``no-eval`` and ``eval`` (eval.every_steps N): steps per minute from the first step's time to
the last's (start-up and the evaluator's final evaluation excluded), and the ratio. ``curriculum``: arms ``plain``
and ``curriculum`` (generator.curriculum.enabled), both with eval.every_steps N and the arithmetic pool cut to
``--pool`` problems (the demo's 20000 are seldom drawn twice in 150 steps, so nothing could settle): the first
evaluated version whose accuracy reaches each of ``--targets``, per seed. Prints one JSON summary; exits 0 (a measurement).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "deploy" / "configs" / "tiny-cpu.yaml"


def run_arm(out: Path, name: str, seed: int, model: str, steps: int, settings: list[str]) -> dict:
    """One `grpo run` of the demo config; its step rate, eval curve, curriculum line and wall time."""
    run_dir = out / f"{name}-seed{seed}"
    sets = [f"seed={seed}", f"learner.max_steps={steps}", f"ref_server.model={model}", f"generator.model={model}",
            f"learner.model={model}", *settings]
    command = [sys.executable, "-m", "deploy.cli", "run", str(CONFIG), "--run-dir", str(run_dir), "--fresh"]
    for item in sets:
        command += ["--set", item]
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - started
    steps_seen = [r for r in _records(run_dir / "metrics.jsonl") if r.get("kind") != "eval"]
    evals = [r for r in _records(run_dir / "eval.jsonl") if "error" not in r]
    result = {"arm": name, "seed": seed, "exit": done.returncode, "wall_s": round(wall, 1),
              "steps": len(steps_seen), "command": " ".join(command[1:])}
    if len(steps_seen) >= 2:
        span = steps_seen[-1]["time"] - steps_seen[0]["time"]
        result["steps_per_min"] = round(60 * (steps_seen[-1]["step"] - steps_seen[0]["step"]) / span, 2)
    result["eval"] = [(r["version"], _accuracy(r)) for r in evals]
    skipped = [line for line in _log_lines(run_dir) if "curriculum:" in line and "passed over" in line]
    result["curriculum_line"] = skipped[-1].strip() if skipped else None
    if done.returncode != 0:
        result["stderr_tail"] = done.stderr[-2000:]
    return result


def _records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _accuracy(record: dict) -> float:
    return next(v for k, v in record.items() if k.endswith("/accuracy"))


def _log_lines(run_dir: Path) -> list[str]:
    return [line for log in sorted((run_dir / "logs").glob("gen-*.log")) for line in log.read_text().splitlines()]


def first_reaching(curve: list[tuple[int, float]], target: float) -> int | None:
    return next((version for version, accuracy in curve if accuracy >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["overhead", "curriculum"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=150, help="learner.max_steps of each arm")
    parser.add_argument("--every-steps", type=int, default=10, help="eval.every_steps of the arms that evaluate")
    parser.add_argument("--pool", type=int, default=200, help="curriculum: generator.dataset.arithmetic_pool")
    parser.add_argument("--targets", type=float, nargs="+", default=[0.85, 0.9],
                        help="curriculum: the held-out accuracies to reach")
    parser.add_argument("--transport", default="http", help=(
        "weight_sync.transport of every arm: http (the default here) puts each version in the relay, which the "
        "evaluator reads; with the demo's collective transport the relay gets the final version only"))
    parser.add_argument("--model", default=str(ROOT / "runs" / "demo" / "tiny-model"),
                        help="the demo's starting model (make demo builds it)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "controls")
    args = parser.parse_args()
    evaluate = [f"eval.every_steps={args.every_steps}"]
    transport = [f"weight_sync.transport={args.transport}"]
    if args.what == "overhead":
        arms = {"no-eval": transport, "eval": [*transport, *evaluate]}
    else:
        pool = [f"generator.dataset.arithmetic_pool={args.pool}", *transport, *evaluate]
        arms = {"plain": pool, "curriculum": [*pool, "generator.curriculum.enabled=true"]}
    results = []
    for seed in args.seeds:
        for name, settings in arms.items():
            results.append(run_arm(args.out, name, seed, args.model, args.steps, settings))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    summary: dict = {"what": args.what, "date": time.strftime("%Y-%m-%d"), "arms": results}
    if args.what == "overhead":
        rates = {(r["arm"], r["seed"]): r.get("steps_per_min") for r in results}
        summary["eval_over_no_eval"] = {seed: round(rates[("eval", seed)] / rates[("no-eval", seed)], 3)
                                        for seed in args.seeds
                                        if rates[("eval", seed)] and rates[("no-eval", seed)]}
    else:
        summary["first_version_reaching"] = {
            str(target): {f"{r['arm']}-seed{r['seed']}": first_reaching(r["eval"], target) for r in results}
            for target in args.targets}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
