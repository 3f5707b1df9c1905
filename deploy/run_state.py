"""`grpo run` and its run folder: what an earlier run left there, starting over, resuming, and where things ended up.

A run's state is every state path of the resolved config (shared/config/schema/paths.py: the spool, the relay, the
generator's weights, checkpoints, the model, metrics, TensorBoard, eval.jsonl and the best model), under
``run.run_dir`` unless set one by one.
A run never mixes with an earlier one by accident:

* no state there: the run starts;
* state there, no flag: refused before any service starts, with the two ways on (:func:`prepare_run_dir`);
* ``--fresh``: that state and the old logs are deleted first (never anything else in the folder: a model built
  there, a summary, files of the user's);
* ``--resume``: the learner continues from the newest complete checkpoint (its step, version and trained group
  ids), the hub from its spool (queued groups), the generators from the relay's newest weights; a run whose newest
  checkpoint is at ``learner.max_steps`` is finished: refused at once (exit 2), with how to train further.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

from generator.eval_files import eval_summary
from learner.checkpoint import complete_tags
from shared.config.schema import GRPOConfig
from shared.config.schema.paths import STATE_PATHS
from shared.errors import UsageError

MARKER = "COMPLETE"


@dataclass(frozen=True)
class StatePath:
    key: str      # the config key, e.g. "ref_server.spool_dir"
    path: Path


def state_paths(config: GRPOConfig) -> list[StatePath]:
    """Every state path the config sets (null ones are off)."""
    found = []
    for section, key in STATE_PATHS:
        value = getattr(getattr(config, section), key)
        if value is not None:
            found.append(StatePath(f"{section}.{key}", Path(value)))
    return found


def _holds_something(path: Path) -> bool:
    if path.is_dir():
        return any(p.is_file() for p in path.rglob("*"))
    return path.exists()


def existing_state(config: GRPOConfig) -> list[StatePath]:
    """The state paths that hold files (an empty folder is no state)."""
    return [s for s in state_paths(config) if _holds_something(s.path)]


def newest_checkpoint(config: GRPOConfig) -> tuple[str, dict] | None:
    """(tag, its COMPLETE record: step, version) of the newest complete checkpoint, or None."""
    if config.learner.checkpoint_dir is None:
        return None
    tags = complete_tags(config.learner.checkpoint_dir)
    if not tags:
        return None
    record = json.loads((Path(config.learner.checkpoint_dir) / tags[-1] / MARKER).read_text())
    return tags[-1], record


def prepare_run_dir(config: GRPOConfig, *, resume: bool, fresh: bool, source: str | None = None) -> str | None:
    """Check the run folder against the flags before anything starts; delete the old state for ``fresh``. Returns a
    line to show (what is resumed or deleted), or None. A :class:`UsageError` (exit 2) names the flags; ``source``:
    the config as named (in the line that says how to continue a finished run)."""
    if resume and fresh:
        raise UsageError("--resume and --fresh exclude each other: continue the earlier run, or start over")
    run_dir = config.run.run_dir
    held = existing_state(config)
    if fresh:
        return _delete_state(config, held)
    if resume:
        newest = newest_checkpoint(config)
        if newest is None:
            why = ("it holds no run state" if not held else
                   f"{config.learner.checkpoint_dir} holds no complete checkpoint (learner.checkpoint_every null "
                   "writes one only when a run is stopped)")
            raise UsageError(f"nothing to resume in {run_dir}: {why}; start it without --resume (or with --fresh)")
        tag, record = newest
        refuse_finished(config, record["step"], source)
        changed = changed_settings(config)
        return (f"resuming {run_dir}: the learner from checkpoint {tag} (step {record['step']}, weights version "
                f"{record['version']}), the hub from its spool, the generators from the relay's weights"
                + (f"; settings changed since the earlier run: {changed}" if changed else ""))
    if held:
        shown = ", ".join(str(s.path) for s in held[:3]) + (", ..." if len(held) > 3 else "")
        raise UsageError(f"{run_dir} holds an earlier run's state ({shown}): continue it with --resume, or delete "
                         "it and start over with --fresh (or set another run.run_dir / --run-dir)")
    return None


def refuse_finished(config: GRPOConfig, step: int, source: str | None) -> None:
    """A :class:`UsageError` (exit 2) when the newest checkpoint is already at ``learner.max_steps``: resuming would
    start every service to train nothing. Said at once, with the two ways on."""
    max_steps = config.learner.max_steps
    if max_steps is None or step < max_steps:
        return
    again = f"grpo run {source or 'CONFIG'}"
    raise UsageError(f"{config.run.run_dir} is finished: its learner reached step {step} of learner.max_steps "
                     f"{max_steps}, nothing is left to resume; train further with `{again} --resume --set "
                     f"learner.max_steps={step + max_steps}` (any value above {step}), or start over with `{again} "
                     "--fresh`")


# A checkpoint holds the weights (or the adapter) of one model trained one way: these settings cannot change under it.
RESUME_FIXED = ("learner.model", "learner.zero_stage", "learner.lora.r", "learner.lora.alpha",
                "learner.lora.target_modules")


def _flat(tree: object, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict) and tree:
        out: dict[str, object] = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): tree}


def changed_settings(config: GRPOConfig, shown: int = 6) -> str | None:
    """The settings of ``config`` that differ from the earlier run's (``run_dir/config.yaml``, written by every
    ``grpo run``), as one line (None: none differ, or no earlier config). A :class:`UsageError` when one of
    :data:`RESUME_FIXED` differs: the checkpoint cannot continue under it."""
    earlier_path = Path(config.run.run_dir) / "config.yaml"
    if not earlier_path.is_file():
        return None
    try:
        earlier = yaml.safe_load(earlier_path.read_text())
    except yaml.YAMLError as exc:
        raise UsageError(f"--resume: {earlier_path} (the earlier run's config) is not YAML: {exc}") from None
    before, now = _flat(earlier if isinstance(earlier, dict) else {}), _flat(config.model_dump(mode="json"))
    diffs = [(key, before.get(key), now.get(key)) for key in sorted(set(before) | set(now))
             if before.get(key) != now.get(key)]
    fixed = [d for d in diffs if d[0] in RESUME_FIXED]  # learner.lora set or not shows as learner.lora.r
    if fixed:
        key, old, new = fixed[0]
        raise UsageError(f"--resume: {key} was {old!r} in the earlier run and is {new!r} now; its checkpoint "
                         f"continues only under the same {key}: put it back, or start over with --fresh (or set "
                         "another run.run_dir)")
    if not diffs:
        return None
    text = ", ".join(f"{key} {old!r} -> {new!r}" for key, old, new in diffs[:shown])
    return text + (f" and {len(diffs) - shown} more" if len(diffs) > shown else "")


def _protected(config: GRPOConfig) -> list[Path]:
    """Folders --fresh never deletes, nor anything holding them: the models, the working and home folders."""
    models = [config.learner.model, config.generator.model, config.ref_server.model, config.ref_server.prm_model]
    return [Path(m).resolve() for m in models if m] + [Path.cwd().resolve(), Path.home().resolve()]


def _delete_state(config: GRPOConfig, held: list[StatePath]) -> str | None:
    logs = Path(config.run.run_dir) / "logs"
    doomed = [*held, *([StatePath("run.run_dir logs", logs)] if logs.exists() else [])]
    protected = _protected(config)
    for state in doomed:
        target = state.path.resolve()
        for keep in protected:
            if keep == target or target in keep.parents:
                raise UsageError(f"--fresh would delete {state.path} ({state.key}), which holds {keep}: point "
                                 f"{state.key} at a folder of its own")
    run_dir = Path(config.run.run_dir).resolve()
    for state in doomed:
        if state.path.is_dir():
            shutil.rmtree(state.path)
        else:
            state.path.unlink(missing_ok=True)
        for parent in state.path.resolve().parents:  # and the folders that held only it (ref_server/, ...)
            if parent == run_dir or run_dir not in parent.parents or any(parent.iterdir()):
                break
            parent.rmdir()
    if not held:
        return None
    return f"--fresh: deleted the earlier run's {', '.join(str(s.path) for s in held)}"


def disk_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def summary_lines(config: GRPOConfig, status: int, source: str | None = None) -> list[str]:
    """Where the run's results are, and their disk use: the run's last lines."""
    cfg, run_dir = config.learner, Path(config.run.run_dir)
    model = Path(cfg.output_dir) if cfg.output_dir else None
    lines = []
    if model is not None and (model / "config.json").is_file():
        lines.append(f"model: {model} (Hugging Face folder, {_size(disk_bytes(model))})")
    else:
        lines.append("model: none written")
    lines.append(f"logs: {run_dir / 'logs'}")
    if cfg.metrics_jsonl and Path(cfg.metrics_jsonl).exists():
        lines.append(f"metrics: {cfg.metrics_jsonl}" + (f", TensorBoard {cfg.tensorboard_dir}"
                                                       if cfg.tensorboard_dir and Path(cfg.tensorboard_dir).exists()
                                                       else ""))
    lines += eval_summary(config)   # eval.every_steps: the best model beside the last evaluation
    lines += _weights_lines(config, source)
    paths = {run_dir.resolve(): run_dir, **{s.path.resolve(): s.path for s in state_paths(config)}}
    roots = [p for p in paths if not any(q in p.parents for q in paths)]  # each file counted once
    existing = [p for p in roots if p.exists()]
    where = f" in {', '.join(str(paths[p]) for p in existing)}" if existing else ""
    lines.append(f"disk: {_size(sum(disk_bytes(p) for p in existing))}{where}; exit status {status}")
    return lines


def drop_unneeded_weights(config: GRPOConfig, status: int) -> str | None:
    """After a run that finished (exit 0, every service stopped: no generator reads them any more), the weight copies
    beside the model folder are deleted: the generators' downloads and every version on the relay. The model folder
    holds the final weights; a ``--resume`` of the run (with a raised ``learner.max_steps``) needs no relay copy
    either: its learner finds the relay behind its checkpoint and publishes the checkpoint's weights first
    (learner/main.py, ``Learner._register``), which its generators load. A run stopped early keeps them all."""
    if status != 0:
        return None
    dropped = 0
    for folder in (config.ref_server.weights_dir, config.generator.weights_dir):
        if folder is None or not Path(folder).is_dir():
            continue
        for weights in Path(folder).glob("v*.safetensors"):
            dropped += weights.stat().st_size
            weights.unlink()
    if not dropped:
        return None
    where = "the model folder" if config.learner.output_dir is None else str(config.learner.output_dir)
    return (f"the relay's and generators' weight copies are deleted ({_size(dropped)}): {where} holds the final "
            "weights" + (", and a --resume publishes them again from the checkpoint"
                         if newest_checkpoint(config) is not None else ""))


def _weights_lines(config: GRPOConfig, source: str | None) -> list[str]:
    """The checkpoint (its size, and all the kept checkpoints' when several) and the relay's weights left."""
    cfg = config.learner
    newest = newest_checkpoint(config)
    lines = []
    if newest is not None:
        root = Path(cfg.checkpoint_dir)
        kept = complete_tags(root)
        again = f"grpo run {source} --resume" if source else "grpo run CONFIG --resume"
        size = _size(disk_bytes(root / newest[0])) + (
            f"; {len(kept)} kept (learner.keep_checkpoints), {_size(disk_bytes(root))} in {root}"
            if len(kept) > 1 else "")
        lines.append(f"checkpoint: {root / newest[0]} (step {newest[1]['step']}, {size}); continue with: {again}")
    else:
        lines.append("checkpoint: none")
    relay = Path(config.ref_server.weights_dir) if config.ref_server.weights_dir else None
    held = sorted(relay.glob("v*.safetensors")) if relay is not None and relay.is_dir() else []
    if held:
        lines.append(f"relay: {relay} ({len(held)} weights version{'s' if len(held) > 1 else ''}, "
                     f"{_size(sum(p.stat().st_size for p in held))})")
    return lines


def finish_run(config: GRPOConfig, status: int, source: str | None = None) -> list[str]:
    """Once every service stopped: drop what the config does not keep, then the run's last lines."""
    note = drop_unneeded_weights(config, status)
    return [*([note] if note else []), *summary_lines(config, status, source)]
