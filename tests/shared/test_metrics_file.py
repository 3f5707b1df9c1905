"""shared/metrics_file.py: the learner's and the evaluator's lines in one metrics.jsonl, read apart."""

import json
import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.metrics_file import append_eval_record, read_records


def learner_line(path, step: int) -> None:
    with open(path, "a", buffering=1) as fh:   # what learner.metrics.MetricsLogger opens
        fh.write(json.dumps({"step": step, "time": 0.0, "loss": step / 7, "pad": "x" * 900}) + "\n")


def write_many(path, kind: str, n: int) -> None:
    for i in range(n):
        if kind == "eval":
            append_eval_record(path, i, {"eval/d/accuracy": i / n, "eval/d/pad": float(i)})
        else:
            learner_line(path, i)


def test_two_writers_appending_at_once_never_interleave_a_line(tmp_path):
    """Each writer opens the file itself, as the two processes do (O_APPEND: one write() is one whole line)."""
    path = tmp_path / "metrics.jsonl"
    writers = [threading.Thread(target=write_many, args=(path, kind, 300)) for kind in ("step", "eval")]
    for w in writers:
        w.start()
    for w in writers:
        w.join(60)
    lines = path.read_text().splitlines()
    assert len(lines) == 600 and all(isinstance(json.loads(line), dict) for line in lines)
    assert [r["step"] for r in read_records(path, "step")] == list(range(300))
    assert [r["version"] for r in read_records(path, "eval")] == list(range(300))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 10**6)), max_size=30), st.booleans())
def test_reads_split_by_kind_and_skip_a_cut_last_line(tmp_path_factory, writes, cut):
    path = tmp_path_factory.mktemp("m") / "metrics.jsonl"
    for is_eval, n in writes:
        append_eval_record(path, n, {"eval/d/accuracy": 0.5}) if is_eval else learner_line(path, n)
    if cut:
        with open(path, "a") as fh:
            fh.write('{"step": 99, "lo')   # a crash half-way through a line
    assert [r["step"] for r in read_records(path, "step")] == [n for e, n in writes if not e]
    evals = read_records(path, "eval")
    assert [(r["kind"], r["step"], r["version"]) for r in evals] == [("eval", n, n) for e, n in writes if e]
    assert len(read_records(path, "all")) == len(writes)


def test_a_missing_file_has_no_records(tmp_path):
    assert read_records(tmp_path / "none.jsonl") == []
