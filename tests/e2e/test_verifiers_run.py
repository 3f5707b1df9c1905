"""End to end, a verifiers environment: `grpo run` with generator.environment {name: verifiers} naming the ToolEnv
of tests/generator/vf_test_envs.py (loaded by env_id) on a tiny model that has memorised its two tool calls. The
learner trains on the episodes the endpoint recorded, each rewarded by the environment's rubric."""

import json
import os
from pathlib import Path

import pytest

from tests import service_forks as forks
from tests.generator import agent_kit

from .test_multiturn_run import runs
from .test_run import GRPO, free_port, stray_processes, write_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_grpo_run_with_a_verifiers_tool_environment_trains_on_its_rubrics_rewards(tmp_path):
    from transformers import AutoTokenizer

    model_dir = agent_kit.build_tool_model_dir(tmp_path / "model")
    config = write_config(tmp_path, model_dir, free_port(), max_steps=3, lr=1e-4,
                          advantages_jsonl=str(tmp_path / "advantages.jsonl"))
    cfg = json.loads(config.read_text())
    del cfg["generator"]["rewards"]   # the rubric's reward scores the episodes
    cfg["generator"].update(
        sampling={"max_tokens": 60, "temperature": 1.0}, agent={"timeout_s": 120},
        environment={"name": "verifiers", "args": {"env_id": "tests.generator.vf_test_envs",
                                                   "env_args": {"kind": "tools"}}})
    config.write_text(json.dumps(cfg))
    # the environment's module imports from the checkout, as an installed environment package would be
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    result = forks.run([GRPO, "run", str(config)], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path})
    assert result.returncode == 0, result.stdout[-4000:]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [row for line in (tmp_path / "advantages.jsonl").read_text().splitlines()
            for row in json.loads(line)["rows"]]
    assert len(rows) == 3 * 2 * 4   # 3 steps x 2 groups x G = 4
    for row in rows:
        ids, mask = row["completion_ids"], row["mask"]
        pieces = runs(mask)
        assert pieces[0][2] and pieces[-1][2]   # the model's turn first and last, tool results between
        # the rubric's reward: 1.0 exactly when the last turn the model wrote is the answer
        start, end, _ = pieces[-1]
        answered = tokenizer.decode(ids[start:end], skip_special_tokens=True).strip() == agent_kit.ANSWER
        assert row["reward"] == float(answered), tokenizer.decode(ids)
    assert any(len([p for p in runs(row["mask"]) if p[2]]) == 3 for row in rows)   # two tool calls, then the answer
    assert any(row["reward"] == 1.0 for row in rows)
    generator_log = (tmp_path / "run" / "logs" / "gen-0.log").read_text()
    assert "Traceback" not in generator_log
    assert "verifiers environment tests.generator.vf_test_envs" in generator_log
    assert stray_processes(str(config)) == []
