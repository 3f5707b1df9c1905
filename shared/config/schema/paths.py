"""Where a run keeps its state: every state folder defaults to a place under ``run.run_dir``.

A path field's default is a template such as ``<run_dir>/ref_server/spool``; :func:`under_run_dir` (called by
the root config's validator, so every service reading the same YAML agrees) replaces ``<run_dir>`` with the run's
folder. Without a run folder (``run.run_dir`` null: a service started on its own, e.g. a ref server for scoring
only) a templated path resolves to null, and each service says what null means for it: no spool, a temporary
relay, no metrics file; a learner needs ``run.run_dir`` or its own output folders.
"""

from __future__ import annotations

RUN_DIR = "<run_dir>"

# (section, field): every state path of a run, in the order the launcher reports them
STATE_PATHS: tuple[tuple[str, str], ...] = (
    ("ref_server", "spool_dir"),
    ("ref_server", "weights_dir"),
    ("generator", "weights_dir"),
    ("learner", "checkpoint_dir"),
    ("learner", "output_dir"),
    ("learner", "metrics_jsonl"),
    ("learner", "tensorboard_dir"),
    ("eval", "jsonl"),
    ("eval", "best_dir"),
)


def under_run_dir(path: str | None, run_dir: str | None) -> str | None:
    """``path`` with ``<run_dir>`` replaced by ``run_dir`` (None where the path needs one and there is none)."""
    if path is None or RUN_DIR not in path:
        return path
    if run_dir is None:
        return None
    return path.replace(RUN_DIR, run_dir.rstrip("/") or "/")


def template_help(what: str, default: str, null: str) -> str:
    """The description of a state path field (one wording for all of them)."""
    return (f"{what}. Default {default}: under run.run_dir ({RUN_DIR} is replaced by it; a relative run_dir is "
            f"relative to the working directory). Null, or {RUN_DIR} with no run_dir: {null}.")
