"""Outcome vs process supervision, KL in the loss vs in the reward, on the multi-step chain task (issue 23).

    .venv/bin/python bench/process_vs_outcome.py                           # the defaults below
    .venv/bin/python bench/process_vs_outcome.py --steps 60 --eval-every 10 --seeds 0 1 2

What runs, one at a time (so the runs do not share the machine with each other):

1. The start model, ONE for every run: the config's ``generator.model`` (deploy/configs/tiny-chain-cpu.yaml: the
   tiny model warmed up on the chain task, then fine-tuned on a flawed teacher that slips in intermediate lines;
   ``deploy/demo/run.py: build_model``, built once and reused). Its held-out greedy accuracy is step 0 of every
   curve.
2. For each seed, the four variants of :data:`VARIANTS`, each a ``grpo run`` (a real subprocess, three services)
   of ``--steps`` learner steps with that seed and the same settings otherwise:

   * ``outcome+kl_loss``: reward ``chain`` (the last line is the answer), one advantage per completion,
     ``algorithm.loss.beta`` = ``--beta`` (k3 in the loss);
   * ``process+kl_loss``: reward ``chain_steps`` (one reward per line, right given the line before),
     ``algorithm.advantage.supervision: process``, ``generator.step_rewards.outcome: none`` (DeepSeekMath's process
     supervision: the steps only), the same KL in the loss;
   * ``outcome+kl_reward`` / ``process+kl_reward``: the same with ``algorithm.kl: {in_reward: true, beta: --beta}``
     (k1 in the per-token reward, returns to go) and no KL in the loss.

   Every ``--eval-every`` steps the learner writes a checkpoint (all kept); after the run each is converted to a
   Hugging Face folder and evaluated by the project's evaluator (generator/evaluate.py: greedy accuracy of the
   ``chain`` reward on ``eval.num_examples`` held-out problems, the same problems for every run).
3. The report: per variant, the mean curve over seeds; for each KL placement, the outcome run's final accuracy
   (mean over seeds) as the target and the first evaluated step at which each curve reaches it; the ratio process
   steps / outcome steps (issue 23 aims at <= 0.7). Written to ``--out``/summary.json (curves, settings, machine)
   and the figure ``--figure``.

The learner's steps are not deterministic (three asynchronous processes), so one seed is one sample: use several.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.vs_trl import eval_config, eval_steps, evaluate_points, machine, prepare_config  # noqa: E402
from bench.vs_trl_runs import run_grpo  # noqa: E402
from shared.config.schema import GRPOConfig  # noqa: E402

OUTCOME_REWARDS = [{"name": "chain", "weight": 1.0}]
# the outcome reward stays in the list at weight 0: the evaluator's judge and the per-reward metrics
PROCESS_REWARDS = [{"name": "chain_steps", "weight": 1.0}, {"name": "chain", "weight": 0.0}]


SUPERVISIONS = ("outcome", "process", "process_outcome")
PLACES = ("kl_loss", "kl_reward")


def variant_changes(name: str, beta: float) -> dict:
    """The config changes of one variant (``supervision+kl_place``), as ``grpo_config``'s dotted keys (``__``).

    ``process_outcome`` (not in the default set) is process supervision with the outcome added to the last step's
    reward (``generator.step_rewards.outcome: final_step``)."""
    supervision, _, place = name.partition("+")
    if supervision not in SUPERVISIONS or place not in PLACES:
        raise ValueError(f"unknown variant {name!r}; variants are {', '.join(ALL_VARIANTS)}")
    outcome = supervision == "outcome"
    changes = {"algorithm__advantage__supervision": "outcome" if outcome else "process",
               "generator__rewards": OUTCOME_REWARDS if outcome else PROCESS_REWARDS}
    if not outcome:
        changes["generator__step_rewards"] = {"outcome": "none" if supervision == "process" else "final_step"}
    if place == "kl_loss":
        changes.update(algorithm__loss__beta=beta, algorithm__kl={"in_reward": False})
    else:
        changes.update(algorithm__loss__beta=0.0, algorithm__kl={"in_reward": True, "beta": beta, "estimator": "k1"})
    return changes


VARIANTS = ("outcome+kl_loss", "process+kl_loss", "outcome+kl_reward", "process+kl_reward")
ALL_VARIANTS = tuple(f"{s}+{p}" for p in PLACES for s in SUPERVISIONS)


# -- curve bookkeeping (pure) -----------------------------------------------------------------------------------
def mean_curve(per_seed: dict[int, dict[int, float | None]]) -> dict[int, float | None]:
    """Step -> mean accuracy over the seeds that have it (None where no seed does)."""
    steps = sorted({s for curve in per_seed.values() for s in curve})
    out: dict[int, float | None] = {}
    for step in steps:
        values = [c[step] for c in per_seed.values() if c.get(step) is not None]
        out[step] = statistics.fmean(values) if values else None
    return out


def final_accuracy(curve: dict[int, float | None]) -> float | None:
    """The accuracy at the curve's last step (None if that evaluation is missing)."""
    return curve[max(curve)] if curve else None


def steps_to(target: float | None, curve: dict[int, float | None]) -> int | None:
    """The first evaluated step whose accuracy is >= target (None if never, or no target)."""
    if target is None:
        return None
    for step in sorted(curve):
        if curve[step] is not None and curve[step] >= target - 1e-9:
            return step
    return None


def comparison(curves: dict[str, dict[int, float | None]]) -> dict[str, dict]:
    """For each KL placement and each process variant with an outcome curve beside it (keys ``kl_loss``,
    ``kl_reward`` for ``process``, ``process_outcome+kl_loss``... for the others): the outcome curve's final
    accuracy as the target, the steps each curve takes to reach it, and process / outcome (None when a side never
    reaches it)."""
    out = {}
    for place in PLACES:
        outcome = curves.get(f"outcome+{place}")
        for supervision in SUPERVISIONS[1:]:
            process = curves.get(f"{supervision}+{place}")
            if not outcome or not process:
                continue
            target = final_accuracy(outcome)
            steps_outcome, steps_process = steps_to(target, outcome), steps_to(target, process)
            ratio = steps_process / steps_outcome if steps_outcome and steps_process is not None else None
            key = place if supervision == "process" else f"{supervision}+{place}"
            out[key] = {"target": target, "steps_outcome": steps_outcome, "steps_process": steps_process,
                        "budget": max(outcome), "ratio": ratio, "final_outcome": target,
                        "final_process": final_accuracy(process)}
    return out


def curve_stats(curves: dict[str, dict[int, float | None]], level: float) -> dict[str, dict]:
    """Per variant, two measures that do not hinge on one point of a plateau: the first evaluated step at ``level``
    and the mean accuracy over the evaluated steps after step 0 (the area under the curve per step)."""
    out = {}
    for name, curve in curves.items():
        later = [v for s, v in curve.items() if s > 0 and v is not None]
        out[name] = {"final": final_accuracy(curve), f"steps_to_{level:g}": steps_to(level, curve),
                     "mean_after_start": statistics.fmean(later) if later else None}
    return out


# -- running -----------------------------------------------------------------------------------------------------
def run_variant(config: GRPOConfig, model_dir: str, name: str, seed: int, args, start_accuracy: float) -> dict:
    """One ``grpo run`` of variant ``name`` with ``seed``; its curve (step 0 = the start model) and rewards."""
    steps = eval_steps(config.learner.max_steps, args.eval_every)
    run_dir = Path(args.out) / f"{name.replace('+', '_')}-seed{seed}"
    started = time.monotonic()
    run = run_grpo(config, model_dir, "cpu", steps, args.eval_every, run_dir, args.port, Path(args.grpo_tree),
                   seed=seed, **variant_changes(name, args.beta))
    accuracy = evaluate_points(eval_config(config, "cpu"), run.pop("folders"))
    if not args.keep_snapshots:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        shutil.rmtree(run_dir / "snapshots", ignore_errors=True)
    record = {"variant": name, "seed": seed, "accuracy": {0: start_accuracy, **accuracy},
              "rewards": run["rewards"], "train_s": round(run["total_s"], 1),
              "wall_s": round(time.monotonic() - started, 1), "exit_status": run["exit_status"],
              "missing_snapshots": run["missing_snapshots"], "load_avg_at_start": run["load_avg_at_start"]}
    (run_dir / "result.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"[bench] {name} seed {seed}: " + ", ".join(
        f"{s}: {a:.1%}" if a is not None else f"{s}: missing" for s, a in record["accuracy"].items()), flush=True)
    return record


def summarise(records: list[dict], args, start: dict, config: GRPOConfig) -> dict:
    per_variant: dict[str, dict[int, dict[int, float | None]]] = {}
    for r in records:
        per_variant.setdefault(r["variant"], {})[r["seed"]] = {int(k): v for k, v in r["accuracy"].items()}
    curves = {name: mean_curve(seeds) for name, seeds in per_variant.items()}
    per_seed_cmp = {seed: comparison({name: seeds[seed] for name, seeds in per_variant.items() if seed in seeds})
                    for seed in args.seeds}
    return {"command": " ".join(sys.argv), "config": args.config, "overrides": args.overrides,
            "task": config.generator.dataset.chain.model_dump(mode="json"), "steps": config.learner.max_steps,
            "eval_every": args.eval_every, "seeds": args.seeds, "beta": args.beta,
            "eval_examples": config.eval.num_examples, "start_model": start, "curves": curves,
            "per_seed": {name: seeds for name, seeds in per_variant.items()},
            "comparison": comparison(curves), "comparison_per_seed": per_seed_cmp,
            "curve_stats": curve_stats(curves, args.level),
            "curve_stats_per_seed": {seed: curve_stats({n: s[seed] for n, s in per_variant.items() if seed in s},
                                                       args.level) for seed in args.seeds},
            "runs": records,
            "machine": machine()}


def points(curve: dict) -> tuple[list[int], list[float | None]]:
    """A curve's steps in order and its values (keys may be ints, or strings after a JSON round trip)."""
    by_step = {int(step): value for step, value in curve.items()}
    return sorted(by_step), [by_step[step] for step in sorted(by_step)]


def write_summary(records: list[dict], args, start: dict, config: GRPOConfig, out: Path) -> dict:
    summary = summarise(records, args, start, config)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def plot(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {"kl_loss": "KL in the loss", "kl_reward": "KL in the reward"}
    places = [p for p in PLACES if any(name.endswith(f"+{p}") for name in summary["curves"])]
    fig, axes = plt.subplots(1, len(places), figsize=(max(7.0, 5.5 * len(places)), 4.6), sharey=True, squeeze=False)
    colours = {"outcome": "tab:blue", "process": "tab:orange", "process_outcome": "tab:green"}
    for ax, place in zip(axes[0], places):
        title = titles[place]
        for supervision in SUPERVISIONS:
            name = f"{supervision}+{place}"
            for curve in summary["per_seed"].get(name, {}).values():
                steps, values = points(curve)
                ax.plot(steps, values, color=colours[supervision], alpha=0.25, lw=1)
            mean = summary["curves"].get(name)
            if mean:
                steps, values = points(mean)
                ax.plot(steps, values, color=colours[supervision], lw=2.2, marker="o", ms=3,
                        label=f"{supervision} (mean of {len(summary['per_seed'][name])} seeds)")
        cmp = summary["comparison"].get(place)
        if cmp and cmp["target"] is not None:
            ax.axhline(cmp["target"], color="grey", ls=":", lw=1)
        ax.set_title(title)
        ax.set_xlabel("learner step")
        ax.legend(loc="lower right")
    axes[0][0].set_ylabel("held-out greedy accuracy (final line right)")
    lines = summary.get("task", {}).get("num_operands", 0) - 1
    fig.suptitle(f"chain task ({lines} lines), tiny model on CPU\noutcome vs process rewards, KL beta {summary['beta']}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="deploy/configs/tiny-chain-cpu.yaml", help="grpo YAML (chain task).")
    parser.add_argument("--steps", type=int, help="Learner steps per run (default: the config's max_steps).")
    parser.add_argument("--eval-every", type=int, default=10, help="Evaluate every N learner steps.")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="Seeds; every variant runs each.")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=ALL_VARIANTS,
                        help="supervision+kl_place; process_outcome = process with the outcome in the last step.")
    parser.add_argument("--level", type=float, default=0.9, help="Also report the steps to this accuracy.")
    parser.add_argument("--beta", type=float, default=0.04, help="KL weight, in the loss or in the reward.")
    parser.add_argument("--out", default="runs/bench/process-vs-outcome", help="Work folder (emptied first).")
    parser.add_argument("--figure", default="docs/process-vs-outcome.png")
    parser.add_argument("--port", type=int, default=8483, help="Ref server port of the runs.")
    parser.add_argument("--reuse", action="store_true", help="Keep --out and reuse the runs it already holds "
                        "(a variant and seed with a result.json is read, not run again): add seeds or variants to "
                        "an earlier measurement, or redraw its figure.")
    parser.add_argument("--keep-snapshots", action="store_true", help="Keep the checkpoints and HF snapshots.")
    parser.add_argument("--grpo-tree", default=str(Path(__file__).resolve().parents[1]),
                        help="Source tree whose services `grpo run` starts.")
    parser.add_argument("overrides", nargs="*", help="Config overrides, key=value.")
    args = parser.parse_args(argv)
    if args.eval_every < 1:
        parser.error("--eval-every must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = prepare_config(args.config, args.steps, args.overrides)
    from deploy.demo.run import build_model
    from generator.evaluate import evaluate

    stats = build_model(config)  # one start model for every run (built once, then reused from its folder)
    model_dir = config.generator.model
    start_accuracy = evaluate(eval_config(config, "cpu"), model_dir).greedy_accuracy
    start = {"folder": model_dir, "heldout_greedy_accuracy": start_accuracy,
             **{k: stats.get(k) for k in ("warmup_steps", "flawed_steps", "heldout_accuracy_clean_phase",
                                          "heldout_accuracy", "validation_accuracy")}}
    print(f"[bench] start model {model_dir}: held-out greedy accuracy {start_accuracy:.1%}", flush=True)
    out = Path(args.out)
    if not args.reuse:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for seed in args.seeds:
        for name in args.variants:
            done = out / f"{name.replace('+', '_')}-seed{seed}" / "result.json"
            if args.reuse and done.exists():
                records.append(json.loads(done.read_text()))
                print(f"[bench] {name} seed {seed}: reused {done}", flush=True)
                continue
            records.append(run_variant(config, model_dir, name, seed, args, start_accuracy))
            write_summary(records, args, start, config, out)  # after every run: a failure loses nothing
    summary = write_summary(records, args, start, config, out)
    plot(summary, Path(args.figure))
    print(json.dumps({key: summary[key] for key in ("comparison", "comparison_per_seed", "curve_stats")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
