"""`grpo demo` (what `make demo` runs): the whole stack learning arithmetic on a CPU, in a few minutes.

1. build the tiny local model with its short supervised warm-up (nothing is downloaded);
2. evaluate greedy accuracy on the held-out split;
3. `grpo run deploy/configs/tiny-cpu.yaml`: ref server, generator and learner as processes on 127.0.0.1;
4. evaluate the trained model the same way;
5. write runs/demo/curve.png (reward and accuracy) and runs/demo/summary.json.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from deploy.console import echo_logs
from deploy.launcher import run
from generator.evaluate import evaluate
from shared.config.loader import load_config
from shared.errors import UsageError
from shared.metrics_file import read_records


def build_model(config) -> dict:
    """The demo's starting policy: the tiny model, warmed up as `config.demo` says (built once, then reused).

    Raises `WarmupTargetMissed` (naming the demo settings to change) if a phase's step cap comes before its
    accuracy target: the demo's before/after numbers mean something only from the intended starting point.
    """
    from deploy.demo.tiny_model import TinyModelSpec, build_tiny_model_dir
    from deploy.demo.warmup import WarmupTargetMissed, warmup_record

    model_dir = Path(config.generator.model)
    stats_file = model_dir / "grpo_tiny_model.json"
    task = demo_task(config)
    if stats_file.exists():
        stats = json.loads(stats_file.read_text())
        recorded = json.loads(json.dumps({"warmup": warmup_record(config.demo, config.seed),
                                          "task": asdict(task)}))  # tuples as lists
        if stats.get("warmup") == recorded["warmup"] and stats.get("task") == recorded["task"]:
            return stats
        print(f"[demo] {model_dir} was built with other warm-up or task settings; rebuilding it", flush=True)
        shutil.rmtree(model_dir)
    demo = config.demo
    print(f"[demo] building the starting model in {model_dir} (once: later runs reuse it): up to "
          f"{demo.warmup_max_steps if demo.warmup_target_accuracy is not None else demo.warmup_steps} supervised "
          f"steps on correct demonstrations, then up to {demo.flawed_steps} on a flawed teacher's; a few minutes "
          f"on 2 CPU cores, with a progress line every few seconds", flush=True)
    try:
        return build_tiny_model_dir(model_dir, task=task, warmup=config.demo, seed=config.seed,
                                    spec=TinyModelSpec(seed=config.seed))
    except WarmupTargetMissed as err:
        raise WarmupTargetMissed(f"{err} In the config: demo.warmup_max_steps / demo.warmup_target_accuracy for "
                                 f"the correct demonstrations, demo.flawed_steps / demo.flawed_target_accuracy "
                                 f"for the flawed teacher.") from err


def demo_task(config):
    """The built-in task the tiny model warms up on: ``generator.dataset``'s arithmetic or chain settings."""
    from generator.tasks.arithmetic import ArithmeticTask
    from generator.tasks.chain import ChainTask

    dataset = config.generator.dataset
    environment = config.generator.environment
    if config.demo.tool_fraction > 0 and (environment is None or environment.name != "calculator"
                                          or dataset.kind != "arithmetic"):
        raise UsageError("demo.tool_fraction > 0 demonstrates the calculator: it needs generator.environment.name: "
                         "calculator and generator.dataset.kind: arithmetic")
    if dataset.kind == "chain":
        return ChainTask(**dataset.chain.model_dump())
    if dataset.kind == "arithmetic":
        return ArithmeticTask(**dataset.arithmetic)
    raise UsageError(f"the tiny model warms up on a built-in task: generator.dataset.kind must be 'arithmetic' or "
                     f"'chain', got {dataset.kind!r}")


def tool_text(result) -> str:
    """``, tool-call rate 12.0%`` for a multi-turn evaluation, nothing otherwise."""
    return "" if result.tool_call_rate is None else f", tool-call rate {result.tool_call_rate:.1%}"


def calculator_summary(config, before, after, metrics_path: Path, advantages_path: Path | None,
                       train_started_at: float, curve: Path) -> dict:
    """The multi-turn demo's extra summary fields (held-out tool-call rates; per-step sampled rates when the
    learner logged its rows in ``learner.advantages_jsonl``) and its curve (:mod:`deploy.demo.calc_curve`)."""
    from deploy.demo.calc_curve import plot_calculator, step_minutes, step_rates

    rates = step_rates(advantages_path) if advantages_path is not None and advantages_path.exists() else []
    minutes = step_minutes(metrics_path, train_started_at)
    for rate in rates:
        if rate["step"] in minutes:
            rate["minutes"] = round(minutes[rate["step"]], 2)
    ends = [{"accuracy": r.greedy_accuracy, "tool_call_rate": r.tool_call_rate} for r in (before, after)]
    plot_calculator(rates, minutes, *ends, curve)
    return {"tool_call_rate_before": before.tool_call_rate, "tool_call_rate_after": after.tool_call_rate,
            "turns_per_trajectory_before": before.turns_per_trajectory,
            "turns_per_trajectory_after": after.turns_per_trajectory,
            "environment": config.generator.environment.name,
            "per_step": [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in rates]}


def plot(metrics_path: Path, before: float, after: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
    fig, ax = plt.subplots(figsize=(7, 4))
    if rows:
        ax.plot([r["step"] for r in rows], [r["reward_mean"] for r in rows], label="training reward (sampled)")
        last = rows[-1]["step"]
    else:
        last = 1
    ax.scatter([0, last], [before, after], color="tab:red", zorder=3, label="held-out greedy accuracy")
    ax.annotate(f"{before:.0%}", (0, before), textcoords="offset points", xytext=(6, -12))
    ax.annotate(f"{after:.0%}", (last, after), textcoords="offset points", xytext=(-34, -16))
    ax.set_xlabel("learner step")
    ax.set_ylim(0, 1.02)
    ax.set_title("grpo-stack demo: GRPO unlearns a flawed teacher's habits (CPU)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(config_path: str = "deploy/configs/tiny-cpu.yaml", overrides: list[str] | None = None) -> int:
    config = load_config(config_path, overrides)
    echo_logs(("grpo.demo", "grpo.eval"), "[demo]")  # warm-up and evaluation progress
    run_dir = Path(config.run.run_dir)
    model_dir = Path(config.generator.model)
    started = time.monotonic()
    stats = build_model(config)
    print(f"[demo] tiny model ready: {stats['params']:,} parameters; held-out greedy accuracy "
          f"{stats['heldout_accuracy_clean_phase']:.1%} after {stats['warmup_steps']} steps of correct "
          f"demonstrations, {stats['heldout_accuracy']:.1%} after {stats['flawed_steps']} steps of the flawed "
          f"teacher's", flush=True)
    before = evaluate(config, str(model_dir))
    print(f"[demo] before RL: greedy accuracy {before.greedy_accuracy:.1%}, pass@{before.k} "
          f"{before.pass_at_k:.1%}{tool_text(before)} on {before.num_examples} held-out problems", flush=True)
    metrics_path = Path(config.learner.metrics_jsonl)
    advantages_path = Path(config.learner.advantages_jsonl) if config.learner.advantages_jsonl else None
    if advantages_path is not None:
        advantages_path.unlink(missing_ok=True)  # the learner appends; the curve is of this run only
    train_started, train_started_at = time.monotonic(), time.time()
    # every run of the demo starts from the warmed-up model, not from what an earlier run left behind
    status = run(config, fresh=True)
    train_seconds = time.monotonic() - train_started
    if status != 0:
        print(f"[demo] training failed (exit status {status}); see {run_dir / 'logs'}", flush=True)
        return status
    after = evaluate(config, config.learner.output_dir)
    steps = len(read_records(metrics_path, "step"))
    summary = {
        "accuracy_before": before.greedy_accuracy, "accuracy_after": after.greedy_accuracy,
        f"pass@{after.k}_before": before.pass_at_k, f"pass@{after.k}_after": after.pass_at_k,
        "steps": steps, "train_seconds": round(train_seconds, 1),
        "wall_seconds": round(time.monotonic() - started, 1), "heldout_examples": after.num_examples,
        "warmup": {k: stats[k] for k in ("warmup_steps", "flawed_steps", "warmup_seconds", "torch_threads",
                                         "validation_accuracy_clean_phase", "validation_accuracy",
                                         "heldout_accuracy_clean_phase", "heldout_accuracy") if k in stats},
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    if after.tool_call_rate is not None:
        summary.update(calculator_summary(config, before, after, metrics_path, advantages_path, train_started_at,
                                          run_dir / "curve.png"))
    else:
        plot(metrics_path, before.greedy_accuracy, after.greedy_accuracy, run_dir / "curve.png")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"[demo] after RL:  greedy accuracy {after.greedy_accuracy:.1%} (before {before.greedy_accuracy:.1%}), "
          f"pass@{after.k} {after.pass_at_k:.1%}{tool_text(after)}; {steps} steps in {train_seconds:.0f}s",
          flush=True)
    print(f"[demo] wrote {run_dir / 'summary.json'} and {run_dir / 'curve.png'}", flush=True)
    return 0
