"""How bench/rollout_schedule.py reports its arms: each schedule's median run and the ratios to ``batch`` (over
repeats, the median of each repeat's own ratio, the arms of a repeat having run one after the other), and the bar
chart."""

from __future__ import annotations

import statistics
from pathlib import Path

# continuous: on_weights recompute (the default); continuous_keep: on_weights keep (the transformers engine only)
SCHEDULES = ("batch", "continuous", "continuous_keep")


def summarize(runs: dict[str, list[dict]]) -> dict:
    """``runs``: each schedule's results, one per repeat. Each schedule's entry is its run of median tokens/s (the
    lower middle one for an even count), with every repeat's tokens/s when there were several; each
    ``tokens_per_s_<schedule>_over_batch`` is the median of the repeats' ratios (a ``..._range`` beside it)."""
    out = {}
    for schedule, results in runs.items():
        ranked = sorted(results, key=lambda r: r["tokens_per_s"])
        out[schedule] = dict(ranked[(len(ranked) - 1) // 2])
        if len(results) > 1:
            out[schedule]["tokens_per_s_runs"] = [r["tokens_per_s"] for r in results]
    for schedule in runs:
        if schedule == "batch" or "batch" not in runs:
            continue
        ratios = [round(r["tokens_per_s"] / b["tokens_per_s"], 2) for r, b in zip(runs[schedule], runs["batch"])]
        out[f"tokens_per_s_{schedule}_over_batch"] = statistics.median(ratios)
        if len(ratios) > 1:
            out[f"tokens_per_s_{schedule}_over_batch_range"] = [min(ratios), max(ratios)]
    return out


def draw(out: dict, path: Path) -> None:
    """Tokens/s and publish-to-first-use of each schedule, per workload: two bar panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(out["workloads"])
    schedules = [s for s in SCHEDULES if s in out["workloads"][workloads[0]]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    width = 0.8 / len(schedules)
    for k, schedule in enumerate(schedules):
        xs = [i + k * width for i in range(len(workloads))]
        axes[0].bar(xs, [out["workloads"][w][schedule]["tokens_per_s"] for w in workloads], width, label=schedule)
        axes[1].bar(xs, [out["workloads"][w][schedule]["publish_to_first_use_s"] or 0 for w in workloads], width,
                    label=schedule)
    for ax, title in zip(axes, ("completion tokens/s", "publish -> first step using it (s, median)")):
        ax.set_xticks([i + width * (len(schedules) - 1) / 2 for i in range(len(workloads))], workloads)
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"rollout schedules, {out['engine']} engine, {out['slots']} sequence slots, cap "
                 f"{out['max_tokens']} tokens, a publish every {out['publish_every_s']}s", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
