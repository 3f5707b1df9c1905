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


def append_eval_record(path: str | Path, version: int, metrics: dict[str, float]) -> None:
    """Append the evaluation of weights ``version`` (at step = version: a version is the learner step that
    published it) as one line."""
    record = {"kind": EVAL_KIND, "step": version, "version": version, "time": time.time(), **metrics}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def read_records(path: str | Path, kind: Literal["step", "eval", "all"] = "step") -> list[dict]:
    """The file's records of one kind: ``step`` (the learner's), ``eval`` (the evaluator's) or ``all``; [] when
    the file does not exist. A line cut short by a crash (the last one) is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        is_eval = isinstance(record, dict) and record.get("kind") == EVAL_KIND
        if kind == "all" or (kind == "eval") == is_eval:
            records.append(record)
    return records
