"""On-policy distillation measured (issue 42 item 3): GRPO alone, distillation alone, GRPO + distillation.

    .venv/bin/python bench/distill.py --figure docs/distillation.png      # the tiny demo, one seed (~6 min on 2 cores)
    .venv/bin/python bench/distill.py --arm-steps 40 --eval-every 5 --seeds 0 1
    .venv/bin/python bench/distill.py --teacher runs/bench/distill/teacher-model --set learner.lr=3e-4 --out OTHER
    .venv/bin/python bench/distill.py --teacher runs/bench/distill/teacher-model --distill-mode topk_forward_kl --out TOPK

Every run is a real ``grpo run`` (launcher, three services, a fresh run folder), one at a time:

1. The student: the config's start model (the demo's warmed-up tiny model, built as ``grpo demo`` builds it).
2. The teacher: the student trained further with GRPO by the config as it is (``--teacher-steps`` steps); its
   last checkpoint, as a Hugging Face folder, is the teacher. Its held-out greedy accuracy must exceed the
   student's (else the script stops: there is nothing to distil). ``--teacher DIR`` takes an earlier run's
   ``OUT/teacher-model`` instead (evaluated again, not trained again: arms with other settings, same teacher).
3. Three arms from the same student, per seed, ``--arm-steps`` steps each, the same batch (the config's groups
   per step): ``grpo`` (the config as it is), ``distill`` (``supervision: none``, the teacher's reward alone) and
   ``grpo+distill`` (outcome advantages plus the teacher's reward). The distillation arms serve the teacher as
   ``ref_server.teacher_model`` with ``algorithm.distill`` {coef ``--coef``, baseline ``--baseline`` (default
   ``mean``: the batch's mean per-token reward subtracted), ``mode`` ``--distill-mode`` (default ``reverse_kl``;
   ``topk_forward_kl``: the forward-KL loss term over the teacher's ``--top-k`` next tokens per position instead
   of the reward), ``student: recompute``} and
   ``generator.drop_constant_groups`` false (refused with a teacher: a group of equal rewards still carries its
   signal).

Held-out greedy accuracy every ``--eval-every`` steps: learner checkpoints converted to Hugging Face folders and
evaluated by ``generator/evaluate.py`` on the config's held-out split (the same problems for every model). Per arm:
the first evaluated step (and its wall seconds, launch to that step, checkpoint time off the clock) at which
accuracy reaches ``--target-fraction`` of the teacher's, or "not reached within N".

Writes ``OUT/summary.json`` (every number, the machine, the load) and, with ``--figure``, a PNG of accuracy per
step with the teacher's line. Prints a markdown table, then one ``BENCH_JSON`` line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.process_vs_outcome import steps_to  # noqa: E402
from bench.vs_trl import (  # noqa: E402
    eval_config,
    eval_steps,
    evaluate_points,
    finish_run,
    machine,
    prepare_config,
    run_grpo,
    start_model,
    time_to,
)

ARMS = ("grpo", "distill", "grpo+distill")


def arm_settings(arm: str, teacher: Path, coef: float, baseline: str = "mean", mode: str = "reverse_kl",
                 top_k: int = 16) -> dict:
    """The config changes of one arm (``grpo_config``'s dotted keys); ``grpo`` is the config unchanged (no distill
    block: one without a teacher is refused). ``mode``/``top_k``: algorithm.distill's (``--distill-mode``,
    ``--top-k``) for the distillation arms."""
    if arm == "grpo":
        return {}
    supervision = "none" if arm == "distill" else "outcome"
    return {"algorithm__advantage__supervision": supervision,
            "algorithm__distill": {"coef": coef, "mode": mode, "top_k": top_k, "student": "recompute",
                                   "baseline": baseline},
            "ref_server__teacher_model": str(teacher), "generator__drop_constant_groups": False}


def reached(run: dict, target: float) -> dict:
    """Steps and wall seconds (launch to that step) to the first evaluated step at ``target`` (None: not reached)."""
    accuracy = {int(s): a for s, a in run["accuracy"].items()}
    step = steps_to(target, accuracy)
    clock = {int(s): c for s, c in run["clock"].items()}
    return {"steps": step, "wall_s": time_to(target, accuracy, clock) if step is not None else None}


def build_teacher(config, model_dir: str, ev, args, out: Path, tree: Path) -> tuple[Path, dict]:
    """The student trained further by ``grpo run`` on the config; its last checkpoint as the teacher's folder."""
    steps = eval_steps(args.teacher_steps, args.teacher_steps)
    teacher_config = config.model_copy(update={"learner": config.learner.model_copy(
        update={"max_steps": args.teacher_steps})})
    print(f"[bench] teacher: grpo run, {args.teacher_steps} steps ...", flush=True)
    run = run_grpo(teacher_config, model_dir, "cpu", steps, args.teacher_steps, out / "teacher", args.port, tree)
    folder = run["folders"][args.teacher_steps]
    if folder is None:
        raise SystemExit(f"teacher run left no checkpoint at step {args.teacher_steps}; see {out / 'teacher'}")
    finish_run("teacher", run, ev, out)
    kept = out / "teacher-model"
    shutil.copytree(folder, kept)
    shutil.rmtree(out / "teacher" / "checkpoints", ignore_errors=True)
    return kept, {"steps": args.teacher_steps, "accuracy": run["accuracy"][args.teacher_steps],
                  "total_s": run["total_s"], "load_avg_at_start": run["load_avg_at_start"]}


def run_arm(config, model_dir: str, ev, arm: str, seed: int, teacher: Path, args, out: Path, tree: Path) -> dict:
    name = f"{arm}-seed{seed}"
    steps = eval_steps(config.learner.max_steps, args.eval_every)
    print(f"[bench] {name} ...", flush=True)
    run = run_grpo(config, model_dir, "cpu", steps, args.eval_every, out / name, args.port, tree, seed=seed,
                   **arm_settings(arm, teacher, args.coef, args.baseline, args.distill_mode, args.top_k))
    finish_run(name, run, ev, out)
    metrics = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(out / name / "checkpoints", ignore_errors=True)
    shutil.rmtree(out / name / "snapshots", ignore_errors=True)
    return {"arm": arm, "seed": seed, "accuracy": {str(k): v for k, v in run["accuracy"].items()},
            "clock": {str(k): v for k, v in run["clock"].items()}, "total_s": run["total_s"],
            "load_avg_at_start": run["load_avg_at_start"],
            "distill_reverse_kl": [m.get("distill_reverse_kl") for m in metrics],
            "distill_forward_kl": [m.get("distill_forward_kl") for m in metrics],
            "completion_len_mean": [m.get("completion_len_mean") for m in metrics]}


def cell(value, unit: str = "") -> str:
    return "-" if value is None else f"{value:.0f}{unit}"


def table(summary: dict) -> str:
    """Markdown: one row per run, accuracy at each evaluated step, steps and wall seconds to the target."""
    target, limit = summary["target_accuracy"], summary["arm_steps"]
    lines = [f"| arm | seed | accuracy at steps {', '.join(map(str, summary['eval_steps']))} | steps to "
             f"{target:.1%} | wall s to it | run wall s | load at start |", "|---|---|---|---|---|---|---|"]
    for run in summary["runs"].values():
        hit = run["reached"]
        points = " / ".join(f"{a:.1%}" if a is not None else "-" for a in run["accuracy"].values())
        steps = cell(hit["steps"]) if hit["steps"] is not None else f"not reached within {limit}"
        lines.append(f"| {run['arm']} | {run['seed']} | {points} | {steps} | {cell(hit['wall_s'])} | "
                     f"{run['total_s']:.0f} | {run['load_avg_at_start'][0]:.1f} |")
    return "\n".join(lines)


def figure(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    colours = dict(zip(ARMS, ("tab:gray", "tab:blue", "tab:green")))
    styles = ["-", "--", ":", "-."]
    for run in summary["runs"].values():
        steps = [0, *(int(s) for s in run["accuracy"])]
        accuracy = [summary["student_accuracy"], *run["accuracy"].values()]
        ax.plot(steps, [100 * a if a is not None else None for a in accuracy], styles[run["seed"] % 4], marker=".",
                color=colours[run["arm"]], label=f"{run['arm']}, seed {run['seed']}")
    teacher = summary["teacher"]["accuracy"]
    ax.axhline(100 * teacher, color="black", label=f"teacher ({teacher:.1%})")
    ax.axhline(100 * summary["target_accuracy"], color="black", linestyle="--",
               label=f"{summary['target_fraction']:.0%} of the teacher")
    ax.set(xlabel="learner step", ylabel="held-out greedy accuracy (%)",
           title=f"{summary['config']}: student {summary['student_accuracy']:.1%} at step 0")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="deploy/configs/tiny-cpu.yaml", help="grpo YAML: model, task, settings.")
    parser.add_argument("--teacher-steps", type=int, default=150, help="GRPO steps that build the teacher.")
    parser.add_argument("--teacher", help="Use this teacher folder (an earlier OUT/teacher-model), not a new one.")
    parser.add_argument("--arm-steps", type=int, default=60, help="Learner steps of every arm.")
    parser.add_argument("--eval-every", type=int, default=5, help="Held-out accuracy every N steps (and the last).")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="Seeds; every arm runs once per seed.")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS, help="Arms to run.")
    parser.add_argument("--coef", type=float, default=1.0, help="algorithm.distill.coef of the distillation arms.")
    parser.add_argument("--baseline", choices=("none", "mean"), default="mean",
                        help="algorithm.distill.baseline of the distillation arms (mean: the batch's mean per-token "
                        "reward subtracted; none: the raw reverse-KL rewards).")
    parser.add_argument("--distill-mode", choices=("reverse_kl", "topk_forward_kl"), default="reverse_kl",
                        help="algorithm.distill.mode of the distillation arms: the reverse-KL reward on the sampled "
                        "token, or the forward-KL loss term over the teacher's top-k (docs/distillation.md).")
    parser.add_argument("--top-k", type=int, default=16,
                        help="algorithm.distill.top_k of the distillation arms (mode topk_forward_kl only).")
    parser.add_argument("--target-fraction", type=float, default=0.9, help="Target: this fraction of the teacher.")
    parser.add_argument("--out", default="runs/bench/distill", help="Work folder (emptied first).")
    parser.add_argument("--figure", help="Write the accuracy figure to this PNG.")
    parser.add_argument("--port", type=int, default=8487, help="Ref server port of the runs.")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="Override a config key for every run (repeatable).")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    config = prepare_config(args.config, args.arm_steps, args.set)
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    tree = Path(__file__).resolve().parents[1]
    model_dir = start_model(config)
    ev = eval_config(config, "cpu")
    summary: dict = {"config": args.config, "arm_steps": args.arm_steps, "coef": args.coef, "baseline": args.baseline,
                     "distill_mode": args.distill_mode, "top_k": args.top_k,
                     "eval_steps": eval_steps(args.arm_steps, args.eval_every), "target_fraction": args.target_fraction,
                     "heldout_examples": config.eval.num_examples, "machine_before": machine(), "runs": {}}
    summary["student_accuracy"] = evaluate_points(ev, {0: Path(model_dir)})[0]
    print(f"[bench] student: greedy accuracy {summary['student_accuracy']:.1%}", flush=True)
    if args.teacher:  # an earlier run's teacher: evaluated again, not trained again
        teacher = Path(args.teacher).resolve()
        summary["teacher"] = {"folder": str(teacher), "accuracy": evaluate_points(ev, {0: teacher})[0]}
    else:
        teacher, summary["teacher"] = build_teacher(config, model_dir, ev, args, out, tree)
    if summary["teacher"]["accuracy"] <= summary["student_accuracy"]:
        raise SystemExit(f"the teacher ({summary['teacher']['accuracy']:.1%}) is not better than the student "
                         f"({summary['student_accuracy']:.1%}): more --teacher-steps")
    summary["target_accuracy"] = args.target_fraction * summary["teacher"]["accuracy"]
    for seed in args.seeds:
        for arm in args.arms:
            run = run_arm(config, model_dir, ev, arm, seed, teacher, args, out, tree)
            run["reached"] = reached(run, summary["target_accuracy"])
            summary["runs"][f"{arm}-seed{seed}"] = run
            (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    summary["machine_after"] = machine()
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if args.figure:
        figure(summary, Path(args.figure))
    print(table(summary), flush=True)
    result = {name: run["reached"] for name, run in summary["runs"].items()}
    print("BENCH_JSON " + json.dumps({"student_accuracy": summary["student_accuracy"],
                                      "teacher_accuracy": summary["teacher"]["accuracy"], **result}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
