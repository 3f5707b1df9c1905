"""Evaluation while training (``eval.every_steps``): ``grpo evaluator``, a process of its own that follows the weight
versions the learner publishes on the hub's relay, never in the learner's step.

It asks the hub for its newest version every ``eval.poll_s`` seconds; whenever that version is at least
``eval.every_steps`` past the last one evaluated (or ``eval.every_minutes`` passed since the last evaluation and a
version came since), it downloads it (shared/weight_sync/download_dir.py, files of its own beside the generators'),
loads it into one engine built at start (the engine ``grpo eval`` uses) and evaluates it with generator/evaluate.py's
:func:`evaluate_engine`. Versions published meanwhile are skipped: it always takes the
newest. Each evaluation is one JSON line in ``eval.jsonl`` (default ``<run_dir>/eval.jsonl``; ``version``, ``step``,
``eval/<dataset>/<metric>``), the same metrics as a ``kind: eval`` line in the learner's ``metrics.jsonl``
(shared/metrics_file.py), a line ``version V: accuracy ...`` (``[evaluator] version V: ...`` on `grpo run`'s
console), and TensorBoard / W&B scalars when ``learner.tensorboard_dir`` / ``learner.wandb_project`` is set (the
learner's MetricsLogger, given by ``grpo evaluator``). A version's
``step`` is the learner's step that published it: a version is its step (learner/main.py), but for a learner that
published past a relay ahead of it.

An evaluation that fails (a version gone or holding NaN/inf, a reward that raises, the failure rule of
generator/failures.py) is logged, counted and written as ``{"version", "step", "error"}``: the evaluator goes on
with the next version, and the run never stops for it. When the learner finishes, `grpo run` sends SIGUSR1: the
final version is evaluated (whatever ``eval.every_steps``) and the evaluator exits (deploy/final_eval.py).

``eval.best_metric`` keeps the best version as a Hugging Face folder ``eval.best_dir`` (``<run_dir>/best``: the
model folder's config and tokenizer files, the version's weights as ``model.safetensors``) with ``best.json``
(version, step, metric, value); a restarted evaluator reads best.json and keeps that model unless a version beats it, and continues after
the last version its eval.jsonl holds.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from generator.datasets import kind_traits
from generator.eval_files import BEST_JSON, last_evaluated
from generator.evaluate import EvalPlan, EvalResult, eval_engine, evaluate_engine, plan_eval
from shared.config.schema import GRPOConfig
from shared.errors import UsageError
from shared.metrics_file import append_eval_record, append_jsonl
from shared.progress import PROGRESS_MARK
from shared.protocol.client import HubClient, HubError, HubUnavailable, service_client, stop_on_signals
from shared.weight_sync.download_dir import DownloadDir
from shared.weight_sync.engine_load import NonFiniteWeights, load_version_file
from shared.weight_sync.export import write_safetensors

log = logging.getLogger("grpo.evaluator")

class VersionRefused(RuntimeError):
    """A downloaded version that is not evaluated (NaN/inf weights, a file the engine cannot load)."""


def dataset_name(config: GRPOConfig) -> str:
    """The ``<dataset>`` of the metric names: eval.path's or the training dataset's name (its file's stem)."""
    dataset = config.generator.dataset
    reads_path = kind_traits(dataset.kind).eval_path is not None
    path = config.eval.path or (dataset.path if reads_path else None)
    return dataset.kind if path is None else Path(str(path).rstrip("/")).name.removesuffix(".jsonl")


def eval_metrics(result: EvalResult, dataset: str) -> dict[str, float]:
    """``eval/<dataset>/<metric>`` of one evaluation (``pass@k`` with k written out, tool calls when multi-turn)."""
    out = {"accuracy": result.greedy_accuracy, f"pass@{result.k}": result.pass_at_k,
           "mean_reward": result.greedy_mean_reward}
    if result.tool_call_rate is not None:
        out.update(tool_call_rate=result.tool_call_rate, turns_per_trajectory=result.turns_per_trajectory)
    return {f"eval/{dataset}/{name}": float(value) for name, value in out.items()}


@dataclass
class Best:
    version: int
    step: int
    metric: str
    value: float


class BestCheckpoint:
    """``eval.best_dir``: the best version so far by ``metric`` (``mode`` max or min), its Hugging Face folder and
    best.json. ``model_dir`` gives the config and tokenizer files (the generator's model folder)."""

    def __init__(self, folder: Path, metric: str, mode: str, model_dir: str) -> None:
        self.folder, self.metric, self.mode, self.model_dir = folder, metric, mode, model_dir
        self.best = self.read()

    def read(self) -> Best | None:
        path = self.folder / BEST_JSON
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            best = Best(int(data["version"]), int(data["step"]), str(data["metric"]), float(data["value"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"{path} is not a best.json the evaluator wrote ({exc!r}): delete {self.folder} to "
                             "start the best checkpoint over") from None
        if best.metric != self.metric:
            log.warning("%s was chosen by %s, not eval.best_metric %s: it is replaced by the next version evaluated",
                        path, best.metric, self.metric)
            return None
        return best

    def beats(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        return value > self.best.value if self.mode == "max" else value < self.best.value

    def keep(self, write_weights: Callable[[Path], object], version: int, step: int, value: float) -> None:
        """The folder rewritten for ``version`` (a new folder renamed over the old one: never half a model);
        ``write_weights(dest)`` writes the version's full weights to ``dest`` (a copy of the downloaded file, or an
        adapter version merged into the base)."""
        staging = self.folder.with_name(self.folder.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for item in Path(self.model_dir).iterdir():
            if item.is_file() and not item.name.endswith((".safetensors", ".bin", ".pt", ".index.json")):
                shutil.copy2(item, staging / item.name)
        write_weights(staging / "model.safetensors")
        self.best = Best(version, step, self.metric, value)
        (staging / BEST_JSON).write_text(json.dumps(self.best.__dict__) + "\n")
        old = self.folder.with_name(self.folder.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if self.folder.exists():
            os.replace(self.folder, old)
        os.replace(staging, self.folder)
        shutil.rmtree(old, ignore_errors=True)


class Evaluator:
    """Follows the hub's versions and evaluates every ``eval.every_steps``-th one (the newest when due)."""

    def __init__(self, config: GRPOConfig, client: HubClient, engine, plan: EvalPlan,
                 evaluate: Callable[..., EvalResult] = evaluate_engine, say: Callable[[str], object] = print,
                 scalars=None, clock: Callable[[], float] = time.monotonic) -> None:
        """``scalars``: where each evaluation's metrics also go, at step = version (``log(step, metrics)``,
        ``close()``: the learner's MetricsLogger writing TensorBoard, given by deploy/services.py: a service never
        imports another)."""
        cfg = config.eval
        if not cfg.while_training:
            raise UsageError("neither eval.every_steps nor eval.every_minutes is set: the evaluator evaluates every "
                             "that many versions or minutes")
        self.config, self.client, self.engine, self.plan = config, client, engine, plan
        self.evaluate, self.say = evaluate, say
        if cfg.jsonl is None:
            raise UsageError("eval.jsonl is null (no run.run_dir to put it under): set run.run_dir or eval.jsonl")
        if cfg.best_metric and cfg.best_dir is None:
            raise UsageError("eval.best_metric is set and eval.best_dir is null (no run.run_dir to put it under): "
                             "set run.run_dir or eval.best_dir")
        if cfg.best_metric in ("tool_call_rate", "turns_per_trajectory") and config.generator.environment is None:
            raise UsageError(f"eval.best_metric {cfg.best_metric} is measured with generator.environment only "
                             "(multi-turn): choose accuracy, pass@k or mean_reward")
        self.every = cfg.every_steps
        self.every_s = None if cfg.every_minutes is None else cfg.every_minutes * 60
        self.clock = clock
        self.last_time = clock()   # eval.every_minutes counts from here, then from each evaluation's start
        self.jsonl = Path(cfg.jsonl)
        self.metrics_jsonl = config.learner.metrics_jsonl
        self.dataset = dataset_name(config)
        self.downloads = DownloadDir(config.generator.weights_dir or self.jsonl.parent / "evaluator-weights")
        self.last = last_evaluated(self.jsonl) or 0   # version 0 is the initial model: evaluated after every_steps
        self.best = (BestCheckpoint(Path(cfg.best_dir), cfg.best_metric, cfg.best_mode, config.generator.model)
                     if cfg.best_metric else None)
        self.evaluated = self.failed = 0
        self.scalars = scalars
        self.said_no_merge = False

    def due(self, final: bool = False) -> int | None:
        """The hub's newest version if it is due (>= the last evaluated + every_steps, or eval.every_minutes
        passed since the last evaluation; ``final``: any version after the last evaluated), else None."""
        version = self.client.weights_version()
        if version is None or version <= self.last:
            return None
        by_steps = self.every is not None and version >= self.last + self.every
        by_time = self.every_s is not None and self.clock() - self.last_time >= self.every_s
        return version if final or by_steps or by_time else None

    def poll(self, final: bool = False) -> bool:
        """Evaluate the newest version if it is due (``final``: if not evaluated yet); whether one was evaluated
        (or failed)."""
        try:
            version = self.due(final)
        except (HubUnavailable, HubError) as exc:
            log.warning("evaluator: cannot read the hub's newest version (%s); asking again", exc)
            return False
        if version is None:
            return False
        self.last, self.last_time = version, self.clock()
        try:
            metrics = self.evaluate_version(version)
        except Exception as exc:   # noqa: BLE001 - an evaluation that fails never stops the evaluator or the run
            self.failed += 1
            log.exception("evaluator: version %d failed", version)
            self.write({"version": version, "step": version, "error": f"{type(exc).__name__}: {exc}"})
            self.say(f"version {version}: failed ({type(exc).__name__}: {exc}); "
                     f"{self.failed} failed so far, going on")
            return True
        self.evaluated += 1
        self.write({"version": version, "step": version, **metrics})
        if self.metrics_jsonl is not None:   # beside the learner's steps (shared/metrics_file.py)
            append_eval_record(self.metrics_jsonl, version, metrics)
        shown = ", ".join(f"{k.rsplit('/', 1)[1]} {v:.4f}" for k, v in metrics.items())
        best = f"; best: version {self.best.best.version}" if self.best is not None and self.best.best else ""
        self.say(f"version {version}: {shown}{best}")
        if self.scalars is not None:
            self.scalars.log(version, metrics)
        return True

    def evaluate_version(self, version: int) -> dict[str, float]:
        try:
            path = self.client.download_weights(version, self.downloads.path_for(version))
        except HubError as exc:
            raise VersionRefused(f"version {version} could not be downloaded: {exc}") from None
        try:
            self.plan.rewards.context.trainer_state.global_step = version   # TRL-style rewards' trainer_state
            try:
                adapter = load_version_file(self.engine, path, version)
            except NonFiniteWeights as exc:
                raise VersionRefused(str(exc)) from None
            result = self.evaluate(self.config, self.engine, self.plan, f"version {version}")
            metrics = eval_metrics(result, self.dataset)
            if self.best is not None:
                value = metrics[self.metric_key(result.k)]
                if self.best.beats(value) and (not adapter or self.can_merge()):
                    self.best.keep(self.merged if adapter else partial(shutil.copy2, path),
                                   version, version, value)
        finally:
            self.downloads.clear()
        return metrics

    def can_merge(self) -> bool:
        """Can an adapter version be kept as best: does the engine hold it merged into a module (the transformers
        engine: base + scaling * B @ A in place)? vLLM keeps adapters apart: said once, and not kept."""
        if isinstance(getattr(self.engine, "model", None), torch.nn.Module):
            return True
        if not self.said_no_merge:
            self.said_no_merge = True
            log.warning("evaluator: LoRA adapter versions are evaluated but not kept as best with the %s engine "
                        "(it keeps adapters apart from the base): set eval.engine: transformers to keep them",
                        getattr(self.engine, "name", type(self.engine).__name__))
        return False

    def merged(self, dest: Path) -> None:
        """The engine's model with the adapter version applied, as full weights in the relay's layout (a tied head
        once, under the embedding's name: what ``from_pretrained`` loads)."""
        write_safetensors(self.engine.model, dest, is_writer=True)

    def metric_key(self, k: int) -> str:
        """The eval.jsonl key of eval.best_metric (pass@k with k written out)."""
        name = f"pass@{k}" if self.best.metric == "pass@k" else self.best.metric
        return f"eval/{self.dataset}/{name}"

    def write(self, record: dict) -> None:
        append_jsonl(self.jsonl, record)

    def run(self, stop: threading.Event, final: threading.Event | None = None) -> None:
        """Until ``stop`` is set (the launcher stops it with the run), or ``final`` (the learner finished: SIGUSR1
        from `grpo run`): then the newest version is evaluated if it was not, whatever eval.every_steps, and it
        returns."""
        final = final or threading.Event()
        while not stop.is_set():
            if final.is_set():
                self.poll(final=True)
                return
            if not self.poll():
                stop.wait(self.config.eval.poll_s)

    def close(self) -> None:
        self.downloads.clear()
        if self.scalars is not None:
            self.scalars.close()


def run_evaluator(config: GRPOConfig, hub_url: str, scalars=None, final: threading.Event | None = None) -> None:
    """``grpo evaluator``: the engine built once, then :meth:`Evaluator.run` until stopped (SIGTERM, Ctrl-C) or
    ``final`` is set (SIGUSR1, set by the caller's handler); ``scalars``: :class:`Evaluator`'s."""
    plan = plan_eval(config)   # an unknown eval.accuracy_reward is refused before the engine loads
    stop = threading.Event()
    client = service_client(hub_url, config.ref_server.token, config.generator.retry_max_s)
    stop_on_signals(stop, client, "exiting after the current evaluation")
    engine = eval_engine(config, config.generator.model)
    # the progress mark: `grpo run` shows the line on its console as "[evaluator] version V: ..." (deploy/console.py)
    evaluator = Evaluator(config, client, engine, plan, say=lambda text: log.info("%s%s", PROGRESS_MARK, text),
                          scalars=scalars)
    try:
        evaluator.run(stop, final or threading.Event())
    finally:
        evaluator.close()
        engine.close()
