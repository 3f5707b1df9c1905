"""DeepSpeed checkpoints that a kill half-way through can never corrupt.

Each checkpoint is a DeepSpeed tag folder ``step00000042``; once every rank has written its part, rank 0 writes
``COMPLETE`` (JSON: step, policy version) into it. Resuming picks the newest tag that has ``COMPLETE``, so a
checkpoint interrupted mid-write is ignored (and later pruned). Client state holds the step, the version and the
RNG states of torch, Python and NumPy; these files are our own, never network input. Each rank also writes the
rollout group ids it has trained on (``consumed-rank00000.json``): a resumed learner drops a group it meets again,
whatever the new world size; and the batch ids whose acknowledgement was to follow the checkpoint
(``unacked-rank00000.json``): a resumed learner presents them to the hub, which keeps their leases held for it.

Beside the checkpoints, ``learner-session.json`` holds the learner's hub session id (written at each registration):
a resumed learner presents it to take its session back (the hub refuses a new session while one is live).

torch and NumPy are imported where a checkpoint is written or read: `grpo run` asks :func:`complete_tags` whether
there is anything to resume before it imports them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import re
import shutil
from pathlib import Path

from shared.config.schema.learner import LoraConfig

log = logging.getLogger("grpo.learner")
_TAG = re.compile(r"^step(\d{8})$")
MARKER = "COMPLETE"
SESSION_FILE = "learner-session.json"


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def complete_tags(directory: str | Path) -> list[str]:
    """The checkpoints in ``directory`` that every rank finished writing, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if _TAG.match(p.name) and (p / MARKER).is_file())


def save_checkpoint(engine, directory: str | Path, *, step: int, version: int, keep: int, rank: int,
                    consumed: list[str] = (), unacknowledged: list[str] = (), lora: LoraConfig | None = None,
                    base_model: str | None = None, controls: dict | None = None) -> str:
    """``lora``: the run trains LoRA adapters on ``base_model``: the DeepSpeed files hold only the trainable (adapter)
    parameters and their optimizer state, and the tag folder also holds the adapter in peft's format
    (:func:`learner.lora.save_adapter`, what ``grpo export --merge`` reads). ``controls``: the state of the training
    loop's controllers (the adaptive entropy coefficient), given back by :func:`load_latest` as ``controls``."""
    import numpy as np
    import torch

    tag = f"step{step:08d}"
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    from learner.lora import save_adapter, trainable_state_only

    with trainable_state_only(engine) if lora is not None else contextlib.nullcontext():
        engine.save_checkpoint(str(directory), tag=tag, client_state={"step": step, "version": version, "rng": rng,
                                                                  "controls": controls or {}},
                               save_latest=False, exclude_frozen_parameters=lora is not None)
    if lora is not None:
        save_adapter(engine.module, lora, base_model, Path(directory) / tag, is_writer=rank == 0)
    (Path(directory) / tag / f"consumed-rank{rank:05d}.json").write_text(json.dumps(list(consumed)))
    (Path(directory) / tag / f"unacked-rank{rank:05d}.json").write_text(json.dumps(list(unacknowledged)))
    _barrier()
    if rank == 0:
        (Path(directory) / tag / MARKER).write_text(json.dumps({"step": step, "version": version}) + "\n")
        _prune(Path(directory), keep)
    _barrier()
    log.info("checkpoint %s written", tag)
    return tag


def _prune(root: Path, keep: int) -> None:
    complete = complete_tags(root)
    newest = complete[-1] if complete else None
    for path in root.iterdir():
        if not _TAG.match(path.name) or path.name == newest:
            continue
        stale_incomplete = not (path / MARKER).is_file() and (newest is None or path.name < newest)
        if path.name in complete[:-keep] or stale_incomplete:
            shutil.rmtree(path, ignore_errors=True)


def load_latest(engine, directory: str | Path) -> dict | None:
    """Restore the newest complete checkpoint into ``engine``; returns its client state (None if there is none)."""
    import numpy as np
    import torch

    tags = complete_tags(directory)
    if not tags:
        return None
    # a LoRA checkpoint holds no frozen (base) weights: those stay as loaded from the model folder
    frozen = any(not p.requires_grad for p in engine.module.parameters())
    path, state = engine.load_checkpoint(str(directory), tag=tags[-1], load_optimizer_states=True,
                                         load_lr_scheduler_states=True, load_module_strict=not frozen)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {tags[-1]} from {directory}")
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    state["consumed"] = [group_id for path in sorted((Path(directory) / tags[-1]).glob("consumed-rank*.json"))
                         for group_id in json.loads(path.read_text())]
    state["unacknowledged"] = [batch_id for path in sorted((Path(directory) / tags[-1]).glob("unacked-rank*.json"))
                               for batch_id in json.loads(path.read_text())]
    log.info("resumed from %s (step %d, version %d); %d groups trained on", tags[-1], state["step"],
             state["version"], len(state["consumed"]))
    return state


def save_session(directory: str | Path, session: str) -> None:
    """Keep the learner's hub session id beside its checkpoints (replaced atomically)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / (SESSION_FILE + ".tmp")
    tmp.write_text(json.dumps({"session": session}) + "\n")
    tmp.replace(root / SESSION_FILE)


def load_session(directory: str | Path) -> str | None:
    """The session id a resumed learner presents to the hub (None: none kept, or unreadable)."""
    path = Path(directory) / SESSION_FILE
    try:
        session = json.loads(path.read_text())["session"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("%s is unreadable (%s): registering as a new learner session", path, exc)
        return None
    return session if isinstance(session, str) and session else None
