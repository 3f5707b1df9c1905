"""The calculator demo's curve: per learner step, the share of sampled trajectories that called the calculator and
the share that answered right, from the learner's ``advantages_jsonl`` (every row's reward and mask, the mask 0 on
the calculator's tokens), with the held-out greedy numbers before and after; minutes of training on a top axis
(from ``metrics_jsonl``'s ``time``)."""

from __future__ import annotations

import json
from pathlib import Path


def step_rates(advantages_jsonl: Path) -> list[dict]:
    """``[{"step", "samples", "tool_call_rate", "accuracy"}]``, one per learner step (rows of all ranks and batches of
    a step together): a row called the tool if any completion token is the environment's (mask 0), and is right
    if its reward is 1 (the arithmetic reward alone: 0 or 1)."""
    by_step: dict[int, list[dict]] = {}
    for line in advantages_jsonl.read_text().splitlines():
        record = json.loads(line)
        by_step.setdefault(record["step"], []).extend(record["rows"])
    out = []
    for step in sorted(by_step):
        rows = by_step[step]
        if any("mask" not in row for row in rows):
            raise ValueError(f"{advantages_jsonl}: step {step} has single-turn rows (no mask); the calculator demo "
                             f"needs generator.environment")
        out.append({"step": step, "samples": len(rows),
                    "tool_call_rate": sum(0 in row["mask"] for row in rows) / len(rows),
                    "accuracy": sum(row["reward"] >= 1.0 for row in rows) / len(rows)})
    return out


def step_minutes(metrics_jsonl: Path, started: float) -> dict[int, float]:
    """Minutes from ``started`` (a ``time.time()``) to the end of each learner step."""
    rows = [json.loads(line) for line in metrics_jsonl.read_text().splitlines()] if metrics_jsonl.exists() else []
    return {row["step"]: (row["time"] - started) / 60 for row in rows}


def plot_calculator(rates: list[dict], minutes: dict[int, float], before: dict, after: dict, out: Path) -> None:
    """``before``/``after``: held-out greedy ``accuracy`` and ``tool_call_rate``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    steps = [r["step"] for r in rates]
    last = steps[-1] if steps else 1
    ax.plot(steps, [r["tool_call_rate"] for r in rates], color="tab:orange", label="tool-call rate (sampled)")
    ax.plot(steps, [r["accuracy"] for r in rates], color="tab:blue", label="accuracy (sampled)")
    for key, color, name in (("tool_call_rate", "tab:orange", "tool-call rate"),
                             ("accuracy", "tab:blue", "accuracy")):
        ax.scatter([0, last], [before[key], after[key]], color=color, marker="D", edgecolor="black", zorder=3,
                   label=f"held-out greedy {name}")
        ax.annotate(f"{before[key]:.0%}", (0, before[key]), textcoords="offset points", xytext=(6, 4))
        ax.annotate(f"{after[key]:.0%}", (last, after[key]), textcoords="offset points", xytext=(-30, -14))
    known = sorted(s for s in steps if s in minutes)
    if len(known) >= 2:  # minutes on top, interpolated between the steps' end times (monotone in the step)
        xs, ys = np.array([0, *known], float), np.array([0.0, *(minutes[s] for s in known)])
        top = ax.secondary_xaxis("top", functions=(lambda s: np.interp(s, xs, ys), lambda m: np.interp(m, ys, xs)))
        top.set_xlabel("minutes of training")
    ax.set_xlabel("learner step")
    ax.set_ylim(-0.02, 1.05)
    ax.set_title("the tiny model learns to call the calculator (2-digit multiplication, CPU)", fontsize=10)
    ax.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
