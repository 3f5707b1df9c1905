"""``train()``: ``grpo run`` from Python, TRL-style (docs/python-api.md).

It builds the config ``grpo run`` would (a YAML path, a dict of sections or a ``GRPOConfig``; then ``overrides``;
then the reward functions and datasets given as Python objects, grpo_stack/inputs.py), runs the same checks before
anything starts (deploy/preflight.py), starts the same services the same way (deploy/launcher.py) and blocks
until the run ends. A run that finished returns a :class:`RunResult` read from the run's own files; any other end
raises :class:`RunFailed` with the service's last lines.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_stack.inputs import has_callables, reward_specs, write_dataset
from shared.errors import GrpoError, UsageError
from shared.metrics_file import read_records

DEFAULT_RUN_DIR = "runs/train"   # a dict or GRPOConfig without run.run_dir (a YAML path: runs/<its name>)


@dataclass(frozen=True)
class RunResult:
    """A finished run: where its results are and its last metrics."""

    status: int                    # the exit status `grpo run` would have had (0)
    steps: int                     # the learner's last step (its last metrics line's ``step``; 0 without one)
    run_dir: Path                  # logs/, config.yaml (the resolved config), data/ (datasets written by train())
    model_dir: Path | None         # the trained model (a Hugging Face folder); None when none was written
    metrics_path: Path | None      # one JSON line per step (learner.metrics_jsonl); None when off
    metrics: dict[str, Any] | None  # the last training step's line of metrics_path


class RunFailed(GrpoError):
    """The run ended without finishing (a service died, it could not start, or it was stopped by a signal)."""

    def __init__(self, status: int, why: str, last_lines: list[str], run_dir: Path) -> None:
        self.status, self.why, self.last_lines, self.run_dir = status, why, last_lines, run_dir
        self.exit_code = status
        lines = "".join(f"\n  {line}" for line in last_lines)
        super().__init__(f"the run failed (exit status {status}): {why}" + (f"; its last lines:{lines}" if lines
                         else "") + f"\nevery service's output: {run_dir / 'logs'}")


def train(config: Any = None, *, model: str | None = None, reward_funcs: Any = None, train_dataset: Any = None,
          eval_dataset: Any = None, resume: bool = False, fresh: bool = False, **overrides: Any) -> RunResult:
    """Train as ``grpo run`` does and return the finished run's :class:`RunResult`.

    ``config``: a YAML path (or a shipped config's name), a dict of sections, a ``GRPOConfig``, or None (the
    defaults). ``model``: the starting model folder for all three services (ref_server, generator and learner
    ``.model``). ``reward_funcs``: a callable or a list of callables (the python reward's conventions, e.g.
    ``fn(prompt, completion, example) -> float``) and reward entries (dicts); they replace the config's rewards.
    ``train_dataset`` / ``eval_dataset``: a ``datasets.Dataset``, a list of dicts or a path (see
    grpo_stack/inputs.py); the evaluation set becomes ``eval.path`` (for ``grpo eval``). ``resume`` / ``fresh``:
    ``grpo run --resume`` / ``--fresh``. ``overrides``: config keys, dotted or with ``__`` for the dot
    (``**{"learner.max_steps": 10}`` or ``learner__max_steps=10``), values as Python objects.

    Raises a :class:`~shared.errors.UsageError` before anything starts for a config, dataset or reward that cannot
    work (callable rewards need generators forked from this process), and :class:`RunFailed` when the run does not
    finish."""
    from deploy.launcher import forks_generators, run_to_end
    from deploy.preflight import RUN_CHECKS, require

    if threading.current_thread() is not threading.main_thread():
        raise UsageError("grpo_stack.train() runs in the main thread only: it stops the services on Ctrl-C and "
                         "SIGTERM, and Python delivers signals to the main thread")
    tree, source = config_tree(config)
    tree = with_overrides(tree, {**({"ref_server.model": model, "generator.model": model, "learner.model": model}
                                    if model is not None else {}), **overrides})
    run_dir = Path(tree.setdefault("run", {}).setdefault("run_dir", default_run_dir(source)))
    if reward_funcs is not None:
        tree.setdefault("generator", {})["rewards"] = reward_specs(reward_funcs)
    place_datasets(tree, train_dataset, eval_dataset, run_dir / "data")
    resolved = validate(tree, source)
    if reward_funcs is not None and has_callables(tree["generator"]["rewards"]) and not forks_generators(resolved):
        raise UsageError(
            "reward_funcs: Python callables reach generators forked from this process only (every service on the "
            "CPU, run.fork_services true, generator.engine transformers); this config starts the generators as "
            "their own processes (GPU placement, vLLM, or run.fork_services false), which cannot call them. Put "
            "the function in a file and name it: {'name': 'python', 'args': {'function': 'my_rewards.py:score'}} "
            "(docs/python-api.md)")
    require(resolved, RUN_CHECKS)   # every mistake found before any service starts, as `grpo run`
    end = run_to_end(resolved, resume=resume, fresh=fresh, source=source if isinstance(config, (str, Path)) else None)
    if end.status != 0:
        raise RunFailed(end.status, end.failed or "stopped before the learner finished", end.last_lines, run_dir)
    return run_result(resolved, end.status)


def config_tree(config: Any) -> tuple[dict[str, Any], str]:
    """The config's sections as given (defaults not filled in, so ``<run_dir>`` paths still follow run.run_dir),
    and its name for messages."""
    from deploy.services import config_path
    from shared.config.loader import read_config_tree
    from shared.config.schema import GRPOConfig

    if config is None:
        return {}, "<defaults>"
    if isinstance(config, (str, Path)):
        path = config_path(str(config))
        return read_config_tree(path), path
    if isinstance(config, GRPOConfig):
        return config.model_dump(mode="json", exclude_unset=True), "<GRPOConfig>"
    if isinstance(config, dict):
        return json.loads(json.dumps(config)), "<dict>"   # a copy: the caller's dict is never changed
    raise UsageError(f"config: expected a YAML path, a dict of sections or a GRPOConfig, got {type(config).__name__}")


def with_overrides(tree: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``tree`` with each ``section.key`` (or ``section__key``) set to its value, through the one override parser
    (shared/config/loader.py: ``--set KEY=VALUE``), the value written as JSON (which YAML reads back as it was)."""
    from shared.config.loader import apply_overrides

    items = []
    for key, value in overrides.items():
        try:
            items.append(f"{key.replace('__', '.')}={json.dumps(value)}")
        except (TypeError, ValueError) as exc:
            raise UsageError(f"override {key}: {exc}") from None
    return apply_overrides(tree, items)


def default_run_dir(source: str) -> str:
    return DEFAULT_RUN_DIR if source.startswith("<") else f"runs/{Path(source).stem}"


def place_datasets(tree: dict[str, Any], train_dataset: Any, eval_dataset: Any, folder: Path) -> None:
    """``train_dataset`` as generator.dataset's kind and path, ``eval_dataset`` as eval.path (in the training
    set's kind, which is what eval.path is read as), each written under ``folder`` when not a path."""
    dataset = tree.setdefault("generator", {}).setdefault("dataset", {})
    if train_dataset is not None:
        dataset["kind"], dataset["path"] = write_dataset(train_dataset, folder, "train_dataset")
    if eval_dataset is not None:
        if dataset.get("kind") not in ("jsonl", "hf"):
            raise UsageError("eval_dataset: needs a training dataset of kind jsonl or hf (give train_dataset too, "
                             f"or set generator.dataset); this config trains on kind {dataset.get('kind', 'arithmetic')!r}")
        _, tree.setdefault("eval", {})["path"] = write_dataset(eval_dataset, folder, "eval_dataset", dataset["kind"])


def validate(tree: dict[str, Any], source: str):
    """The config every service will read: validated, every service pointed at the one hub (as `grpo run`)."""
    from deploy.launcher import resolve_config
    from shared.config.loader import validate_tree

    return resolve_config(validate_tree(tree, source))


def run_result(config, status: int) -> RunResult:
    """What a finished run left: the model folder, the metrics file and its last line."""
    learner = config.learner
    model = Path(learner.output_dir) if learner.output_dir else None
    metrics_path = Path(learner.metrics_jsonl) if learner.metrics_jsonl else None
    last = None
    if metrics_path is not None and metrics_path.is_file():
        steps = read_records(metrics_path, "step")   # not the evaluator's lines beside them
        last = steps[-1] if steps else None
    return RunResult(status=status, steps=int(last["step"]) if last else 0, run_dir=Path(config.run.run_dir),
                     model_dir=model if model is not None and (model / "config.json").is_file() else None,
                     metrics_path=metrics_path if metrics_path is not None and metrics_path.is_file() else None,
                     metrics=last)
