"""The calculator as an agent against the calculator environment (issue 41 item 2), side by side, several seeds.

    .venv/bin/python bench/calc_agent.py --seeds 0 1 2 --out runs/bench/calc-agent

Both arms start from the calculator demo's warmed-up model (``grpo demo --config deploy/configs/tiny-calculator-cpu.yaml``
builds it into ``runs/calculator/tiny-model``; built here when missing) and run the demo's config as a real ``grpo
run`` (launcher, three services, a fresh run folder), one at a time:

- ``environment``: the config as it is (``generator.environment: {name: calculator, max_turns: 2}``);
- ``agent``: ``generator.environment: null`` and ``generator.agent: {fn: deploy/demo/calc_agent.py:calculator_agent,
  reward: rewards, max_total_tokens: 64}``: the same trajectories, driven through the OpenAI-compatible endpoint.

Held-out greedy accuracy every ``--eval-every`` steps (learner checkpoints as Hugging Face folders, evaluated by
``generator/evaluate.py`` with the config's environment on its test split: one evaluation for both arms, whose greedy
trajectories are the same token for token, tests/generator/test_eval_agent.py). Per arm and seed: the curve, the
first evaluated step at ``--target`` (default: 90% of the environment arms' median final accuracy), and the sampled
tool-call rate of the first and last five steps (``learner.advantages_jsonl``). Writes ``OUT/summary.json``; prints a
markdown table, then one ``BENCH_JSON`` line. A measurement: exits 0 whatever the numbers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.vs_trl import eval_config, eval_steps, finish_run, machine, prepare_config, run_grpo, start_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
AGENT = f"{ROOT / 'deploy' / 'demo' / 'calc_agent.py'}:calculator_agent"
ARMS = ("environment", "agent")


def arm_settings(arm: str, run_dir: Path) -> dict:
    """The config changes of one arm (``grpo_config``'s dotted keys)."""
    own = {"learner__advantages_jsonl": str(run_dir / "advantages.jsonl")}
    if arm == "environment":
        return own
    return {**own, "generator__environment": None,
            "generator__agent": {"fn": AGENT, "reward": "rewards", "max_total_tokens": 64}}


def tool_call_rates(path: Path, first: int = 5) -> tuple[float | None, float | None]:
    """The share of sampled trajectories that called the calculator, steps 1..first and the last ``first`` steps
    (deploy/demo/calc_curve.step_rates, the demo's curve)."""
    from deploy.demo.calc_curve import step_rates

    if not path.is_file():
        return None, None
    rates = step_rates(path)

    def share(part: list[dict]) -> float | None:
        samples = sum(r["samples"] for r in part)
        return sum(r["tool_call_rate"] * r["samples"] for r in part) / samples if samples else None

    return share(rates[:first]), share(rates[-first:])


def run_arm(config, model_dir: str, ev, arm: str, seed: int, args, out: Path) -> dict:
    name = f"{arm}-seed{seed}"
    steps = eval_steps(config.learner.max_steps, args.eval_every)
    print(f"[bench] {name} ...", flush=True)
    run = run_grpo(config, model_dir, "cpu", steps, args.eval_every, out / name, args.port, ROOT, seed=seed,
                   **arm_settings(arm, out / name))
    finish_run(name, run, ev, out)
    shutil.rmtree(out / name / "checkpoints", ignore_errors=True)
    shutil.rmtree(out / name / "snapshots", ignore_errors=True)
    early, late = tool_call_rates(out / name / "advantages.jsonl")
    return {"arm": arm, "seed": seed, "accuracy": {str(k): v for k, v in run["accuracy"].items()},
            "total_s": run["total_s"], "load_avg_at_start": run["load_avg_at_start"],
            "sampled_tool_calls_first_5": early, "sampled_tool_calls_last_5": late}


def first_step_at(run: dict, target: float) -> int | None:
    return next((int(s) for s, a in run["accuracy"].items() if a is not None and a >= target - 1e-9), None)


def pct(value) -> str:
    return "-" if value is None else f"{value:.1%}"


def table(summary: dict) -> str:
    target = summary["target_accuracy"]
    lines = [f"| arm | seed | accuracy at steps {', '.join(map(str, summary['eval_steps']))} | first step at "
             f"{target:.1%} | sampled tool calls, steps 1-5 -> last 5 | run wall s | load at start |",
             "|---|---|---|---|---|---|---|"]
    for run in summary["runs"].values():
        points = " / ".join(pct(a) for a in run["accuracy"].values())
        step = run["first_step_at_target"]
        lines.append(f"| {run['arm']} | {run['seed']} | {points} | {step if step is not None else '-'} | "
                     f"{pct(run['sampled_tool_calls_first_5'])} -> {pct(run['sampled_tool_calls_last_5'])} | "
                     f"{run['total_s']:.0f} | {run['load_avg_at_start'][0]:.1f} |")
    for arm, finals in summary["final_accuracy"].items():
        known = [f for f in finals if f is not None]
        lines.append(f"\n{arm}: final accuracy median {pct(statistics.median(known) if known else None)} (seeds: "
                     f"{', '.join(pct(f) for f in finals)})")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="deploy/configs/tiny-calculator-cpu.yaml", help="grpo YAML.")
    parser.add_argument("--steps", type=int, default=50, help="Learner steps of every run.")
    parser.add_argument("--eval-every", type=int, default=10, help="Held-out accuracy every N steps (and the last).")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="Seeds; both arms run once per seed.")
    parser.add_argument("--target", type=float,
                        help="Accuracy target (default: 90%% of the environment arms' median final accuracy).")
    parser.add_argument("--out", default="runs/bench/calc-agent", help="Work folder (emptied first).")
    parser.add_argument("--port", type=int, default=8489, help="Ref server port of the runs.")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="Override a config key for every run (repeatable).")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    config = prepare_config(args.config, args.steps, args.set)
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    model_dir = start_model(config)
    ev = eval_config(config, "cpu")
    summary: dict = {"config": args.config, "steps": args.steps, "eval_steps": eval_steps(args.steps, args.eval_every),
                     "heldout_examples": config.eval.num_examples, "machine_before": machine(), "runs": {}}
    for seed in args.seeds:
        for arm in ARMS:
            summary["runs"][f"{arm}-seed{seed}"] = run_arm(config, model_dir, ev, arm, seed, args, out)
            (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    last = str(args.steps)
    summary["final_accuracy"] = {arm: [r["accuracy"][last] for r in summary["runs"].values() if r["arm"] == arm]
                                 for arm in ARMS}
    finals = [a for a in summary["final_accuracy"]["environment"] if a is not None]
    summary["target_accuracy"] = args.target if args.target is not None else \
        (0.9 * statistics.median(finals) if finals else 1.0)
    for run in summary["runs"].values():
        run["first_step_at_target"] = first_step_at(run, summary["target_accuracy"])
    summary["machine_after"] = machine()
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(table(summary))
    print("BENCH_JSON " + json.dumps({"final_accuracy": summary["final_accuracy"],
                                      "target_accuracy": summary["target_accuracy"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
