"""Off-policy correction measured: staleness x correction mode, with the generator in a lower precision.

    .venv/bin/python bench/off_policy.py                       # the tiny demo, the full grid (~40 min on 2 cores)
    .venv/bin/python bench/off_policy.py --staleness 0 8 --modes none token_tis --steps 40
    .venv/bin/python bench/off_policy.py --config deploy/configs/smollm2-arithmetic-cpu.yaml --steps 20 --eval-every 10
    .venv/bin/python bench/off_policy.py --staleness 0 8 --modes token_tis --seeds 0 1 2 --set run.num_generators=2

Every cell is one real ``grpo run`` (launcher, three services, a fresh run folder) of the config with
``ref_server.max_staleness`` = S (the generator samples ahead of the learner, up to S versions: the hub's budget lets
it), ``algorithm.off_policy.mode`` = M (bounds ``--low`` / ``--high``), the generator's engine in ``--generator-dtype``
(bfloat16 by default) against the learner's float32: two real sources of drift, staleness and precision. Runs are
one at a time, so they share the machine alike. Per run: ``mismatch_kl``, ``mismatch_abs_logprob_diff``, the
masked fractions and the staleness of every step (the learner's metrics.jsonl) and held-out greedy accuracy every
``--eval-every`` steps (learner checkpoints converted to Hugging Face folders and evaluated by
``generator/evaluate.py`` on the config's held-out split, the same problems for every run).

Writes ``OUT/summary.json`` (every number, the machine, the versions) and, with ``--figure``, a PNG of accuracy and
mismatch_kl per step (docs/off-policy.md shows it). It prints the table of the runs, then one ``BENCH_JSON`` line
(the final accuracies, for ``grpo bench``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.vs_trl import (  # noqa: E402
    eval_config,
    eval_steps,
    evaluate_points,
    finish_run,
    machine,
    prepare_config,
    run_grpo,
    start_model,
)

MODES = ("none", "token_tis", "token_mask", "seq_geo_mask")
DRIFT_KEYS = ("mismatch_kl", "mismatch_abs_logprob_diff", "mismatch_ratio_max", "off_policy_masked_token_frac",
              "off_policy_masked_row_frac", "staleness_mean", "reward_mean", "is_weight_mean",
              "mismatch_ess", "mismatch_ess_seq")


def off_policy_settings(mode: str, low: float, high: float) -> dict:
    """``algorithm.off_policy`` of one cell; the pseudo-mode ``bypass`` is bypass true (the behaviour logprobs as
    pi_old, no recompute: the PPO ratio against them is the only correction)."""
    if mode == "bypass":
        return {"mode": "none", "bypass": True}
    return {"mode": mode, "low": low, "high": high, "bypass": False}  # bypass left null would be true with mu 1


def cell_name(staleness: int, mode: str, seed: int | None = None) -> str:
    """``stale8-token_tis``; with ``--seeds``, ``stale8-token_tis-seed3``."""
    return f"stale{staleness}-{mode}" + ("" if seed is None else f"-seed{seed}")


def drift_per_step(run_dir: Path) -> dict[str, list]:
    """The drift metrics of every step of one run, from its learner's metrics.jsonl (missing keys as None)."""
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    series = {key: [r.get(key) for r in records] for key in DRIFT_KEYS}
    series["step"] = [r["step"] for r in records]
    return series


def final_accuracy(cell: dict) -> float | None:
    """A cell's held-out accuracy at its last evaluation (None: that evaluation failed)."""
    return list(cell["accuracy"].values())[-1]


def mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def table(summary: dict) -> str:
    """Markdown: one row per (staleness, mode), final and best accuracy, mean drift, what the mode masked."""
    lines = ["| max_staleness | mode | staleness mean | mismatch_kl mean | masked tokens | accuracy by step | "
             "final |", "|---|---|---|---|---|---|---|"]
    for cell in summary["cells"].values():
        drift = cell["drift"]
        points = " / ".join(f"{a:.1%}" if a is not None else "-" for a in cell["accuracy"].values())
        final = final_accuracy(cell)
        kl, stale, masked = mean(drift["mismatch_kl"]), mean(drift["staleness_mean"]), \
            mean(drift["off_policy_masked_token_frac"])
        lines.append(f"| {cell['staleness']} | `{cell['mode']}` | {stale:.2f} | {kl:.2e} | {masked:.1%} | {points} | "
                     f"{final:.1%} |" if None not in (kl, stale, masked, final) else
                     f"| {cell['staleness']} | `{cell['mode']}` | - | - | - | {points} | - |")
    return "\n".join(lines)


def by_seed(summary: dict) -> str:
    """Markdown: one row per (staleness, mode) over its seeds: each seed's final accuracy, their mean and the
    standard error of the mean (sample standard deviation / sqrt(n)); and, per staleness, the gap of each mode's mean
    to the same mode's mean at the lowest staleness (the issue's "within 2 points of staleness 0")."""
    groups: dict[tuple[int, str], dict[int, float]] = {}
    for cell in summary["cells"].values():
        final = final_accuracy(cell)
        if final is not None:
            groups.setdefault((cell["staleness"], cell["mode"]), {})[cell.get("seed", 0)] = final
    lowest = min((s for s, _ in groups), default=None)
    lines = ["| max_staleness | mode | seeds | final accuracy per seed | mean | standard error | "
             "mean - lowest staleness |", "|---|---|---|---|---|---|---|"]
    for (staleness, mode), finals in sorted(groups.items()):
        values = [finals[s] for s in sorted(finals)]
        avg = sum(values) / len(values)
        sem = (sum((v - avg) ** 2 for v in values) / (len(values) - 1) / len(values)) ** 0.5 \
            if len(values) > 1 else None
        base = groups.get((lowest, mode))
        gap = avg - sum(base.values()) / len(base) if base and staleness != lowest else None
        lines.append(f"| {staleness} | `{mode}` | {len(values)} | "
                     f"{' / '.join(f'{v:.1%}' for v in values)} | {avg:.1%} | "
                     f"{'-' if sem is None else f'{100 * sem:.1f} points'} | "
                     f"{'-' if gap is None else f'{100 * gap:+.1f} points'} |")
    return "\n".join(lines)


def read_summary(out: Path) -> dict:
    """``OUT/summary.json``; a cell from before the bench recorded its seed gets the one its run's config had."""
    import yaml

    path = out / "summary.json"
    if not path.is_file():
        raise SystemExit(f"--report: {path} does not exist (not a finished --out folder of this bench)")
    summary = json.loads(path.read_text())
    for name, cell in summary["cells"].items():
        if "seed" not in cell:
            config = out / name / "bench-config.yaml"
            cell["seed"] = (yaml.safe_load(config.read_text()) or {}).get("seed", 0) if config.exists() else 0
    return summary


def merge_summaries(summaries: list[dict]) -> dict:
    """One summary of several invocations' cells (a cell named twice, same seed in two folders, is an error: the
    grid would count it twice)."""
    cells: dict = {}
    for summary in summaries:
        for cell in summary["cells"].values():
            key = cell_name(cell["staleness"], cell["mode"], cell.get("seed", 0))
            if key in cells:
                raise SystemExit(f"--report: {key} is in two of the folders; give each seed once")
            cells[key] = cell
    return {**summaries[0], "cells": cells}


def figure(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc_ax, kl_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {0: "-", 2: "--", 8: ":"}
    colours = dict(zip((*MODES, "bypass"), ("tab:gray", "tab:blue", "tab:green", "tab:red", "tab:purple")))
    for cell in summary["cells"].values():
        label = f"staleness {cell['staleness']}, {cell['mode']}"
        style = styles.get(cell["staleness"], "-.")
        colour = colours.get(cell["mode"], None)
        steps = [0, *(int(s) for s in cell["accuracy"])]
        accuracy = [summary["start_accuracy"], *cell["accuracy"].values()]
        acc_ax.plot(steps, [100 * a if a is not None else None for a in accuracy], style, color=colour, label=label)
        drift = cell["drift"]
        kl_ax.plot(drift["step"], drift["mismatch_kl"], style, color=colour, label=label)
    acc_ax.set(xlabel="learner step", ylabel="held-out greedy accuracy (%)", title="accuracy")
    kl_ax.set(xlabel="learner step", ylabel="mismatch_kl (k3, per token)", title="drift", yscale="log")
    acc_ax.legend(fontsize=7, ncol=2)
    fig.suptitle(f"{summary['config']}: generator {summary['generator_dtype']} vs learner float32")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="deploy/configs/tiny-cpu.yaml", help="grpo YAML: model, task, settings.")
    parser.add_argument("--steps", type=int, default=60, help="Learner steps per run.")
    parser.add_argument("--eval-every", type=int, default=10, help="Held-out accuracy every N steps (and the last).")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 2, 8], help="ref_server.max_staleness values.")
    parser.add_argument("--modes", nargs="+", default=list(MODES),
                        help="algorithm.off_policy.mode values; 'bypass' for off_policy.bypass true.")
    parser.add_argument("--low", type=float, default=0.5, help="algorithm.off_policy.low of every run.")
    parser.add_argument("--high", type=float, default=2.0, help="algorithm.off_policy.high of every run.")
    parser.add_argument("--generator-dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"),
                        help="generator.dtype (the learner stays float32 on the CPU).")
    parser.add_argument("--out", default="runs/bench/off-policy", help="Work folder (emptied first).")
    parser.add_argument("--figure", help="Write the accuracy / drift figure to this PNG.")
    parser.add_argument("--port", type=int, default=8483, help="Ref server port of the runs.")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="Override a config key for every run (repeatable).")
    parser.add_argument("--seeds", type=int, nargs="+",
                        help="Run every cell once per seed (the runs' `seed`: sampling and prompt order); the start "
                             "model stays the config's (the demo's is built with the config's seed). Default: one "
                             "run per cell with the config's seed.")
    parser.add_argument("--report", nargs="+", metavar="OUT",
                        help="Run nothing: print the tables of these earlier --out folders' summary.json together "
                             "(grids split over several invocations, e.g. seeds run side by side).")
    args = parser.parse_args(argv)
    if args.report:
        merged = merge_summaries([read_summary(Path(d)) for d in args.report])
        print(table(merged) + "\n\n" + by_seed(merged), flush=True)
        return 0
    config = prepare_config(args.config, args.steps, args.set)
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    tree = Path(__file__).resolve().parents[1]
    steps = eval_steps(config.learner.max_steps, args.eval_every)
    model_dir = start_model(config)
    ev = eval_config(config, "cpu")
    summary: dict = {"config": args.config, "steps": config.learner.max_steps, "eval_steps": steps,
                     "generator_dtype": args.generator_dtype, "low": args.low, "high": args.high,
                     "heldout_examples": config.eval.num_examples, "machine_before": machine(), "cells": {}}
    summary["start_accuracy"] = evaluate_points(ev, {0: Path(model_dir)})[0]
    print(f"[bench] start model: greedy accuracy {summary['start_accuracy']:.1%}", flush=True)
    for seed in args.seeds or [None]:  # seed-major: a grid stopped early has whole seeds, not half a grid
        for staleness in args.staleness:
            for mode in args.modes:
                name = cell_name(staleness, mode, seed)
                print(f"[bench] {name} ...", flush=True)
                seeded = {} if seed is None else {"seed": seed}
                run = run_grpo(config, model_dir, "cpu", steps, args.eval_every, out / name, args.port, tree,
                               ref_server__max_staleness=staleness, generator__dtype=args.generator_dtype,
                               algorithm__off_policy=off_policy_settings(mode, args.low, args.high), **seeded)
                finish_run(name, run, ev, out)
                summary["cells"][name] = {"staleness": staleness, "mode": mode,
                                          "seed": config.seed if seed is None else seed,
                                          "accuracy": {str(k): v for k, v in run["accuracy"].items()},
                                          "total_s": run["total_s"], "drift": drift_per_step(out / name)}
                shutil.rmtree(out / name / "checkpoints", ignore_errors=True)  # GBs for a real model; numbers kept
                shutil.rmtree(out / name / "snapshots", ignore_errors=True)
                (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    summary["machine_after"] = machine()
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if args.figure:
        figure(summary, Path(args.figure))
    print(table(summary), flush=True)
    if args.seeds:
        print(by_seed(summary), flush=True)
    final = {name: {"final_accuracy": final_accuracy(cell)} for name, cell in summary["cells"].items()}
    print("BENCH_JSON " + json.dumps({"start_accuracy": summary["start_accuracy"], **final}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
