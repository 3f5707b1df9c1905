"""The run's metrics.jsonl (``learner.metrics_jsonl``): one file, two writers.

The learner appends one line per training step (``{"step", "time", ...metrics}``). The evaluator appends one line
per evaluated weights version (``{"kind": "eval", "step", "version", "time", "eval/<dataset>/<metric>": ...}``), so
the held-out curve sits beside the training curve in the one file users and dashboards read. Each line is one
``write`` on a file opened for appending, so the two processes' lines never interleave. Readers that want the
training steps only (the step count, the last step's metrics) use :func:`read_records` with ``kind="step"``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Literal

EVAL_KIND = "eval"


def append_jsonl(path: str | Path, record: dict) -> None:
    """``record`` with the time added, as one line appended to the JSON-lines file ``path`` (one write: two
    processes appending never interleave a line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps({**record, "time": time.time()}) + "\n")


def append_eval_record(path: str | Path, version: int, metrics: dict[str, float]) -> None:
    """Append the evaluation of weights ``version`` (at step = version: a version is the learner step that
    published it) as one line."""
    append_jsonl(path, {"kind": EVAL_KIND, "step": version, "version": version, **metrics})


def jsonl_records(path: str | Path) -> list[dict]:
    """Every JSON object line of a JSON-lines file the run appends to ([] when it does not exist); a line cut short
    by a crash (the last one) is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_records(path: str | Path, kind: Literal["step", "eval", "all"] = "step") -> list[dict]:
    """The metrics file's records of one kind: ``step`` (the learner's), ``eval`` (the evaluator's) or ``all``."""
    return [r for r in jsonl_records(path) if kind == "all" or (kind == "eval") == (r.get("kind") == EVAL_KIND)]
