"""The service commands, ``grpo ref-server``, ``grpo generator`` and ``grpo learner``, and what every ``grpo``
command shares: the root parser, the config arguments, and the mapping of errors to exit codes (:func:`run_command`).

A service process runs :func:`main`: started fresh (``python -m deploy.cli SERVICE``, where :mod:`deploy.cli` adds
these commands to the full parser) or forked from ``grpo run`` (deploy/forked.py). Nothing here imports the launcher
or the demo, so ``deploy.cli -> deploy.launcher -> deploy.forked -> deploy.services`` points one way.

Heavy imports (torch, transformers) happen inside the commands, so ``grpo --help`` is instant.
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

Command = Callable[[argparse.Namespace], int]
# add(name, command, help) -> the subcommand's parser (its defaults run ``command``)
AddCommand = Callable[[str, Command, str], argparse.ArgumentParser]


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


def load_with_flags(args: argparse.Namespace, flag_keys: dict[str, str]):
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
    from deploy.preflight import require, require_models

    config = load_with_flags(args, {"model": "ref_server.model", "host": "ref_server.host", "port": "ref_server.port",
                                    "token": "ref_server.token", "access_log": "ref_server.access_log"})
    # a port in use, a core this machine lacks, a missing model folder: one line at once, not after seconds of
    # imports (serve checks again); without ref_server.model the hub only queues and relays
    require(config, ["port", "cpu_cores"])
    require_models({key: path for key, path in (("ref_server.model", config.ref_server.model),
                                                ("ref_server.prm_model", config.ref_server.prm_model),
                                                ("ref_server.teacher_model", config.ref_server.teacher_model))
                    if path is not None})
    from ref_server.server import serve

    serve(config)
    return 0


def cmd_generator(args: argparse.Namespace) -> int:
    """Sample groups of completions, score them, upload them to the hub."""
    import logging

    from deploy.preflight import require_models
    from deploy.startup import import_model_classes

    config = load_with_flags(args, {"model": "generator.model", "hub": "generator.hub_url",
                                    "id": "generator.id", "max_groups": "generator.max_groups"})
    require_models({"generator.model": config.generator.model})  # before seconds of imports and hub retries
    import_model_classes()  # before generator.main: without the optional packages transformers would pull in
    from generator.main import run_generator

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_generator(config)
    return 0


def cmd_learner(args: argparse.Namespace) -> int:
    """Train: pull batches from the hub, GRPO step with DeepSpeed, publish weights."""
    import logging

    from deploy.preflight import require_models
    from deploy.startup import import_model_classes

    config = load_with_flags(args, {"model": "learner.model", "hub": "learner.hub_url",
                                    "max_steps": "learner.max_steps"})
    require_models({"learner.model": config.learner.model})  # before seconds of imports and hub retries
    import_model_classes()  # before learner.main: without the optional packages transformers would pull in
    from learner.main import run_learner

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_learner(config, resume=args.resume)
    return 0


def cmd_evaluator(args: argparse.Namespace) -> int:
    """Follow the hub's weight versions and evaluate every eval.every_steps-th (generator/evaluator.py)."""
    import logging
    import signal
    import threading

    # `grpo run`'s "the learner finished" (deploy/final_eval.py) may come while this process still imports and
    # loads: caught from the start, so it is never killed by it and evaluates the final version once loaded
    final = threading.Event()
    signal.signal(signal.SIGUSR1, lambda signum, frame: final.set())

    from deploy.preflight import require_models
    from deploy.startup import import_model_classes

    config = load_with_flags(args, {"model": "generator.model", "every_steps": "eval.every_steps",
                                    "every_minutes": "eval.every_minutes", "run_dir": "run.run_dir"})
    if not config.eval.while_training:
        raise UsageError("eval.every_steps is not set (nor eval.every_minutes): the evaluator evaluates every that "
                         "many weight versions (--every-steps N, or --set eval.every_steps=N)")
    require_models({"generator.model": config.generator.model})  # before seconds of imports and hub retries
    import_model_classes()
    from generator.evaluator import run_evaluator

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    scalars = None
    logs = config.learner
    if logs.tensorboard_dir or logs.wandb_project:  # eval/<dataset>/<metric> beside the learner's scalars
        from learner.metrics import MetricsLogger

        # its per-step progress line (logger grpo.learner) would read as a training step on the console
        logging.getLogger("grpo.learner").setLevel(logging.WARNING)
        scalars = MetricsLogger(jsonl=None, tensorboard_dir=logs.tensorboard_dir,
                                wandb_project=logs.wandb_project, enabled=True, total_steps=None)
    run_evaluator(config, args.hub or config.learner.hub_url, scalars, final)
    return 0


def cmd_scorer(args: argparse.Namespace) -> int:
    """Join a hub as a reference scorer: score the groups it holds (and /v1/logprobs requests) until stopped."""
    import logging
    import os
    import socket

    from deploy.preflight import require_models

    key = "ref_server.teacher_model" if args.teacher else "ref_server.model"  # --teacher: the teacher's pool
    config = load_with_flags(args, {"model": key, "device": "ref_server.device", "token": "ref_server.token"})
    require_models({key: config.ref_server.teacher_model if args.teacher else config.ref_server.model})
    if args.threads is not None:
        if args.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    from deploy.startup import import_model_classes

    import_model_classes()  # before transformers loads the model: without the optional packages it would pull in
    from ref_server.scorer_pool.remote import run_scorer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    hub = args.hub or config.learner.hub_url
    run_scorer(config, hub, args.id or f"scorer-{socket.gethostname()}-{os.getpid()}", teacher=args.teacher)
    return 0


def _version() -> str:
    try:
        return metadata.version("grpo-stack")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def add_set_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="Override a config key, e.g. --set algorithm.loss.beta=0.0 (repeatable).")


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (every field: grpo config-reference).")
    add_set_arg(p)


def root_parser() -> tuple[argparse.ArgumentParser, AddCommand]:
    """The ``grpo`` parser with no subcommand yet, and the function that adds one."""
    parser = argparse.ArgumentParser(
        prog="grpo",
        description="grpo-stack: a distributed GRPO trainer (vLLM generators, a FastAPI reference server and "
        "rollout hub, a DeepSpeed learner).",
    )
    parser.add_argument("--version", action="version", version=f"grpo-stack {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, fn: Command, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(func=fn)
        return p

    return parser, add


def add_service_parsers(add: AddCommand) -> None:
    """``grpo ref-server``, ``grpo scorer``, ``grpo generator``, ``grpo evaluator`` and ``grpo learner``."""
    p = add("ref-server", cmd_ref_server,
            "Reference server: per-token reference logprobs over HTTP (POST /v1/logprobs), the rollout hub and "
            "the weight relay. Binds 127.0.0.1 unless told otherwise.")
    p.add_argument("--model", help="Reference model folder (overrides ref_server.model).")
    p.add_argument("--host", help="Address to bind (default 127.0.0.1).")
    p.add_argument("--port", type=int, help="Port (default 8470).")
    p.add_argument("--token", help="Require this bearer token (also read from GRPO_TOKEN).")
    p.add_argument("--access-log", action="store_const", const="true",
                   help="Log one line per HTTP request (sets ref_server.access_log; off by default).")
    add_config_args(p)

    p = add("scorer", cmd_scorer,
            "Reference scorer: load ref_server.model and join a hub (ref server) to score the groups it holds and "
            "the /v1/logprobs requests it is sent; any number may join and leave while training runs "
            "(docs/scale-out.md).")
    p.add_argument("--hub", help="Hub URL (default: learner.hub_url).")
    p.add_argument("--model", help="Reference model folder (overrides ref_server.model; must be the hub's; with "
                   "--teacher: overrides ref_server.teacher_model).")
    p.add_argument("--teacher", action="store_true", help="Score the teacher (ref_server.teacher_model) of on-policy "
                   "distillation instead of the reference (docs/distillation.md).")
    p.add_argument("--id", help="Scorer name in the hub's logs (default scorer-HOST-PID).")
    p.add_argument("--device", help="'cpu', 'cuda:N' or 'auto' (overrides ref_server.device).")
    p.add_argument("--threads", type=int, help="Torch CPU threads (torch.set_num_threads).")
    p.add_argument("--token", help="The hub's bearer token (also read from GRPO_TOKEN).")
    add_config_args(p)

    p = add("generator", cmd_generator,
            "Generator: sample G completions per prompt, score them, upload the groups to the hub, and load new "
            "policy weights as the learner publishes them.")
    p.add_argument("--model", help="Model folder (overrides generator.model).")
    p.add_argument("--hub", help="Ref server / hub URL (overrides generator.hub_url).")
    p.add_argument("--id", help="Generator name (overrides generator.id; also seeds its prompt order).")
    p.add_argument("--max-groups", type=int, help="Stop after this many uploaded groups.")
    add_config_args(p)

    p = add("evaluator", cmd_evaluator,
            "Evaluator: follow the weight versions the learner publishes and evaluate every eval.every_steps-th "
            "(held-out greedy accuracy, pass@k) without stalling the learner; one JSON line per evaluation in "
            "eval.jsonl, the best version kept in <run_dir>/best with eval.best_metric (docs/running.md).")
    p.add_argument("--hub", help="Ref server / hub URL (default: learner.hub_url).")
    p.add_argument("--model", help="Model folder: the engine, config and tokenizer (overrides generator.model).")
    p.add_argument("--every-steps", type=int, help="Evaluate every N versions (overrides eval.every_steps).")
    p.add_argument("--every-minutes", type=float, help="Evaluate every N minutes (overrides eval.every_minutes).")
    p.add_argument("--run-dir", help="The run folder eval.jsonl and best/ go under (overrides run.run_dir).")
    add_config_args(p)

    p = add("learner", cmd_learner,
            "Learner: pull batches (reference logprobs attached) from the hub, apply the GRPO step with DeepSpeed, "
            "publish weights. Several ranks: torchrun --nproc_per_node N -m deploy.cli learner ... (or the deepspeed "
            "launcher with --module deploy.cli).")
    p.add_argument("--model", help="Initial policy folder (overrides learner.model).")
    p.add_argument("--hub", help="Ref server / hub URL (overrides learner.hub_url).")
    p.add_argument("--max-steps", type=int, help="Stop after this many optimizer steps.")
    p.add_argument("--resume", action="store_true", help="Continue from the newest complete checkpoint.")
    add_config_args(p)


def run_command(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    """Parse ``argv`` and run its command; every :class:`shared.errors.GrpoError` becomes one message on stderr and
    its exit code (2 for what the user can fix, 1 for a service that gave up), never a bare traceback."""
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except GrpoError as exc:
        print(f"grpo {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code


def build_parser() -> argparse.ArgumentParser:
    """``grpo`` with the service commands only: what a service process parses."""
    parser, add = root_parser()
    add_service_parsers(add)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one service command, ``grpo ref-server|generator|learner ...``."""
    return run_command(build_parser(), argv)
