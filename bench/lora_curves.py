"""LoRA rank 32 vs full fine-tuning on SmolLM2 arithmetic, the same steps and batch: held-out before/after.

Runs, one after the other, ``grpo run`` of deploy/configs/smollm2-arithmetic-cpu.yaml (full fine-tuning, lr 3e-5)
and of deploy/configs/smollm2-arithmetic-lora-cpu.yaml (LoRA r 32, alpha 64, the default seven projections,
lr 3e-4), both cut to ``--steps`` learner steps of 4 groups x 8 completions, each under ``flock LOCK`` (one
measured job machine-wide; the lock is released between the runs) with ``OMP_NUM_THREADS=1`` as in
docs/real-model.md. ``grpo eval`` (greedy accuracy and pass@k on the held-out split, ``--num-examples``
problems) scores the base model once and each run's final model folder (for LoRA the merged policy the learner
writes at the end), at nice 19 outside the lock (``--eval-lock`` to hold it): accuracies do not depend on the load.

Writes ``--json`` (the evals, the gains, gain_lora / gain_full, per-step training reward/accuracy/step time, wall
times and the load before/after each run) and draws ``--png`` (held-out greedy accuracy before/after, and the
training batches' reward per step). ``--plot-only`` redraws from an existing ``--json``.

    PYTHONPATH=$PWD .venv/bin/python bench/lora_curves.py --model runs/models/smollm2-135m-instruct --steps 12
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ARMS = {
    "full": "deploy/configs/smollm2-arithmetic-cpu.yaml",
    "lora": "deploy/configs/smollm2-arithmetic-lora-cpu.yaml",
}
LABELS = {"full": "full fine-tuning (lr 3e-5)", "lora": "LoRA r 32, alpha 64, 7 projections (lr 3e-4)"}


def env() -> dict[str, str]:
    out = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=os.getcwd())
    return out


def grpo(*args: str) -> list[str]:
    return [sys.executable, "-m", "deploy.cli", *args]


def model_sets(model: str) -> list[str]:
    return [f"--set={key}={model}" for key in ("learner.model", "generator.model", "ref_server.model")]


def run_eval(config: str, model: str, out: Path, num_examples: int, k: int, lock: str | None) -> dict:
    """``grpo eval`` at nice 19 without the lock (``lock`` None, the default) or under it at normal priority: the
    lock is for timings, and greedy accuracy does not depend on the load."""
    if not out.exists():
        prefix = ["flock", lock] if lock else ["nice", "-n", "19"]
        subprocess.run([*prefix, *grpo("eval", "--config", config, "--model", model, "--out", str(out),
                                        "--num-examples", str(num_examples), "--k", str(k))],
                       env=env(), check=True)
    return json.loads(out.read_text())


def train(arm: str, base: str, run_dir: Path, steps: int, lock: str) -> dict:
    """One ``grpo run`` under the lock; what it measured (wall time, load) is kept next to the run."""
    done = run_dir / "lora_curves_run.json"
    if done.exists():
        return json.loads(done.read_text())
    cmd = ["flock", lock, "sh", "-c", 'cat /proc/loadavg; date -u +%FT%TZ; "$@"; rc=$?; cat /proc/loadavg; '
           'date -u +%FT%TZ; exit $rc', "sh",
           *grpo("run", ARMS[arm], "--run-dir", str(run_dir), "--fresh", f"--set=learner.max_steps={steps}",
                 *model_sets(base))]
    started = time.time()
    proc = subprocess.run(cmd, env=dict(env(), OMP_NUM_THREADS="1"), capture_output=True, text=True)
    (run_dir.parent / f"{arm}.console.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"grpo run ({arm}) failed with {proc.returncode}; see {run_dir.parent / f'{arm}.console.txt'}")
    lines = proc.stdout.splitlines()
    # the first two and last two lines are the wrapper's loadavg/date; the run itself took (end - the lock's grant)
    record = {"load_before": " ".join(lines[0].split()[:3]), "lock_granted": lines[1],
              "load_after": " ".join(lines[-2].split()[:3]), "finished": lines[-1],
              "wall_s_incl_lock_wait": round(time.time() - started, 1)}
    done.write_text(json.dumps(record, indent=1))
    return record


def step_metrics(run_dir: Path) -> list[dict]:
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        rows.append({key: record.get(key) for key in ("step", "reward_mean", "accuracy", "time_step_s",
                                                      "time_forward_backward_s", "time_optimizer_s",
                                                      "time_publish_s", "time_wait_s")})
    return rows


def plot(result: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    steps = result["steps"]
    base = result["base_eval"]["greedy_accuracy"] * 100
    for arm, color in (("full", "tab:blue"), ("lora", "tab:orange")):
        after = result["arms"][arm]["eval"]["greedy_accuracy"] * 100
        left.plot([0, steps], [base, after], "o-", color=color, label=f"{LABELS[arm]}: {base:.1f}% -> {after:.1f}%")
        rows = result["arms"][arm]["steps"]
        right.plot([r["step"] for r in rows], [r["reward_mean"] for r in rows], ".-", color=color, label=LABELS[arm])
    left.set_xlabel("learner step")
    left.set_ylabel("held-out greedy accuracy (%)")
    left.set_title(f"held-out, {result['num_examples']} problems; gain LoRA / full = {result['gain_ratio']:.2f}",
                   fontsize=9)
    left.legend(fontsize=7, loc="lower right")
    left.grid(alpha=0.3)
    right.set_xlabel("learner step")
    right.set_ylabel("training batches' mean reward")
    right.set_title("training reward (groups with a signal only, 4 x 8 per step)", fontsize=9)
    right.legend(fontsize=7, loc="lower right")
    right.grid(alpha=0.3)
    fig.suptitle(f"SmolLM2-135M-Instruct, two-digit addition in words, {steps} GRPO steps; "
                 f"2-core CPU, {result['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="SmolLM2 folder (grpo fetch-model smollm2-135m-instruct)")
    parser.add_argument("--steps", type=int, default=12, help="learner steps per run (4 groups x 8 each)")
    parser.add_argument("--num-examples", type=int, default=200, help="held-out problems per eval")
    parser.add_argument("--k", type=int, default=1, help="pass@k samples per eval (the target is greedy accuracy)")
    parser.add_argument("--work", default="runs/lora-curves", help="run folders and eval files")
    parser.add_argument("--lock", default="/tmp/measure.lock", help="flock file held during each training run")
    parser.add_argument("--eval-lock", default=None, help="run the evals under this flock file (default: nice 19)")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--json", default="docs/lora-vs-full.json")
    parser.add_argument("--png", default="docs/lora-vs-full.png")
    parser.add_argument("--plot-only", action="store_true", help="redraw --png from --json")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads(Path(args.json).read_text()), args.png)
        return 0
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    for arm in args.arms:  # both training runs first: the lock is then free for others during the evals
        train(arm, args.model, work / arm, args.steps, args.lock)
    base_eval = run_eval(ARMS["full"], args.model, work / "base-eval.json", args.num_examples, args.k, args.eval_lock)
    print(f"base: {base_eval['greedy_accuracy']:.3f}", flush=True)
    arms = {}
    for arm in args.arms:
        run_dir = work / arm
        measured = train(arm, args.model, run_dir, args.steps, args.lock)
        after = run_eval(ARMS[arm], str(run_dir / "model"), work / f"{arm}-eval.json", args.num_examples, args.k, args.eval_lock)
        rows = step_metrics(run_dir)
        arms[arm] = {"config": ARMS[arm], "run": measured, "eval": after, "steps": rows,
                     "gain": after["greedy_accuracy"] - base_eval["greedy_accuracy"],
                     "median_step_s": statistics.median(r["time_step_s"] for r in rows)}
        print(f"{arm}: {after['greedy_accuracy']:.3f} (gain {arms[arm]['gain']:+.3f}), {measured}", flush=True)
    if set(arms) != set(ARMS):
        return 0
    gain_full, gain_lora = arms["full"]["gain"], arms["lora"]["gain"]
    result = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "steps": args.steps,
              "num_examples": args.num_examples, "model": args.model, "base_eval": base_eval, "arms": arms,
              "gain_ratio": gain_lora / gain_full if gain_full else float("nan"),
              "target": "gain_lora / gain_full >= 0.8",
              "machine": "2-core CPU dev VM, no GPU, other jobs at nice 19; OMP_NUM_THREADS=1 per service"}
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.png)
    print(json.dumps({"gain_full": gain_full, "gain_lora": gain_lora, "gain_ratio": result["gain_ratio"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
