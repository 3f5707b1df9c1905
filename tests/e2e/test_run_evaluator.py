"""End to end: `grpo run` with eval.every_steps evaluates published versions beside training, in its evaluator
process, keeps the best as a loadable model and names it in the closing lines."""

import json
import os
import re
import subprocess

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from shared.metrics_file import read_records
from tests.e2e.test_run import GRPO, free_port, stray_processes, write_config


@pytest.mark.slow
def test_grpo_run_evaluates_while_training_and_keeps_the_best(tiny_model_dir, tmp_path):
    config = write_config(tmp_path, tiny_model_dir, free_port(), max_steps=14, tensorboard_dir=str(tmp_path / "tb"))
    data = json.loads(config.read_text())
    data["eval"] = {"every_steps": 2, "num_examples": 4, "k": 2, "engine": "transformers", "poll_s": 0.2,
                    "best_metric": "mean_reward"}
    config.write_text(json.dumps(data))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([GRPO, "run", str(config)], capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout[-4000:]
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    versions = [r["version"] for r in records]
    # every eval.every_steps or more, and the final version when the learner finished (eval.final_wait_s)
    assert all(b - a >= 2 for a, b in zip([0, *versions[:-1]], versions[:-1])) and versions[-1] == 14
    # the generator takes versions over a gloo group (the default transport), yet the learner put every
    # eval.every_steps-th on the relay the evaluator reads (weight_sync.relay_every_versions); how many the evaluator
    # reached before the end depends on its start-up against the learner's pace
    learner_log = (run / "logs" / "learner.log").read_text()
    assert "joined (collective, gloo" in learner_log
    after_join = learner_log[learner_log.index("joined (collective, gloo"):]
    on_relay = [int(v) for v in re.findall(r"weight sync: version (\d+) on the relay", after_join)]
    # each at least eval.every_steps after the relay's previous one (a publish while the sender is busy is skipped),
    # and the final version at the end
    assert len(on_relay) >= 3 and on_relay[-1] == 14, on_relay
    assert all(b - a >= 2 for a, b in zip(on_relay, on_relay[1:-1])), on_relay
    assert all("error" not in r and 0 <= r["eval/arithmetic/accuracy"] <= 1 for r in records)
    best = json.loads((run / "best" / "best.json").read_text())
    assert best["value"] == max(r["eval/arithmetic/mean_reward"] for r in records)
    assert best["version"] == min(r["version"] for r in records if r["eval/arithmetic/mean_reward"] == best["value"])
    assert (run / "best" / "model.safetensors").is_file() and (run / "best" / "config.json").is_file()
    console = result.stdout.splitlines()
    assert any(line.startswith(f"[evaluator] version {versions[0]}: accuracy ") for line in console), console
    assert "[grpo run] the learner finished: the evaluator evaluates the final version" in result.stdout
    assert any(line.startswith(f"[grpo run] best model: {run / 'best'} (version {best['version']}, mean_reward ")
               for line in console), console
    assert any(line.startswith(f"[grpo run] evaluations: {run / 'eval.jsonl'} ({len(records)} done)")
               for line in console), console
    assert not [line for line in console if line.startswith("[evaluator] step")]   # no training-like line
    # metrics.jsonl: the learner's 14 steps and, beside them, each evaluation at step = version
    assert [r["step"] for r in read_records(tmp_path / "metrics.jsonl", "step")] == list(range(1, 15))
    assert [(r["version"], r["eval/arithmetic/accuracy"]) for r in read_records(tmp_path / "metrics.jsonl", "eval")] == \
        [(r["version"], r["eval/arithmetic/accuracy"]) for r in records]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/arithmetic/accuracy")] == versions
    assert stray_processes(str(config)) == []
