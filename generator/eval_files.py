"""Where evaluation while training writes (generator/evaluator.py) and what ``grpo run``'s closing lines read from
it (deploy/run_state.py): no heavy import here, the launcher reads these without torch."""

from __future__ import annotations

import json
from pathlib import Path

from shared.config.schema import GRPOConfig
from shared.metrics_file import jsonl_records

BEST_JSON = "best.json"


def eval_records(path: Path) -> list[dict]:
    """The lines of an eval.jsonl that hold a version (a line cut by a kill is skipped)."""
    def has_version(record: dict) -> bool:
        try:
            int(record["version"])
        except (ValueError, KeyError, TypeError):
            return False
        return True
    return [r for r in jsonl_records(path) if has_version(r)]


def last_evaluated(path: Path) -> int | None:
    """The newest version an eval.jsonl holds (a restarted evaluator continues after it); None: none."""
    return max((int(r["version"]) for r in eval_records(path)), default=None)


def eval_summary(config: GRPOConfig) -> list[str]:
    """``grpo run``'s closing lines about evaluation while training: the best model and its score beside the last
    version evaluated and its score (nothing when the run evaluated nothing)."""
    if config.eval.jsonl is None:
        return []
    path = Path(config.eval.jsonl)
    done = [r for r in eval_records(path) if "error" not in r]
    failed = len(eval_records(path)) - len(done)
    if not done and not failed:
        return []
    failures = f", {failed} failed" if failed else ""
    if not done:
        return [f"evaluations: {path} ({failed} failed, none finished)"]
    metric = config.eval.best_metric or "accuracy"
    last = max(done, key=lambda r: int(r["version"]))

    def score(record: dict) -> str:
        values = [(k.rsplit("/", 1)[1], v) for k, v in record.items() if k.startswith("eval/")]
        wanted = [(n, v) for n, v in values if n == metric or (metric == "pass@k" and n.startswith("pass@"))]
        return ", ".join(f"{n} {v:.4f}" for n, v in (wanted or values[:1]))

    lines = [f"evaluations: {path} ({len(done)} done{failures}); the last, version {last['version']}: {score(last)}"]
    best = Path(config.eval.best_dir) if config.eval.best_dir else None
    if config.eval.best_metric and best is not None and (best / BEST_JSON).is_file():
        try:
            data = json.loads((best / BEST_JSON).read_text())
            lines.append(f"best model: {best} (version {data['version']}, {data['metric']} {float(data['value']):.4f}; "
                         f"eval.best_metric {config.eval.best_mode})")
        except (ValueError, KeyError, TypeError):
            lines.append(f"best model: {best} (its {BEST_JSON} is unreadable)")
    return lines
