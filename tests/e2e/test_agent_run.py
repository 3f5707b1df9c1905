"""End to end, an agent: `grpo run` with generator.agent naming the calculator agent (deploy/demo/calc_agent.py) on
a tiny model that calls the calculator. The learner trains on the episodes the endpoint recorded: two or more model
turns per episode, masks 0 exactly on the calculator's results the agent added."""

import json
import os
from pathlib import Path

import pytest

from generator.environments.calculator import Calculator
from tests import service_forks as forks
from tests.calc_model import PROBLEMS

from .test_multiturn_run import runs
from .test_run import GRPO, free_port, stray_processes, write_config

AGENT = str(Path(__file__).resolve().parents[2] / "deploy" / "demo" / "calc_agent.py") + ":calculator_agent"


@pytest.mark.slow
def test_grpo_run_with_an_agent_file_trains_on_the_recorded_episodes(calc_model_dir, tmp_path):
    from transformers import AutoTokenizer

    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"question": f"{e}=", "answer": str(v)}) + "\n" for e, v in PROBLEMS.items()))
    config = write_config(tmp_path, calc_model_dir, free_port(), max_steps=2, lr=1e-4,
                          advantages_jsonl=str(tmp_path / "advantages.jsonl"))
    cfg = json.loads(config.read_text())
    cfg["generator"].update(
        dataset={"kind": "jsonl", "path": str(data), "system_prompt": ""}, rewards=[{"name": "arithmetic"}],
        sampling={"max_tokens": 24, "temperature": 0.5},
        agent={"fn": AGENT, "reward": "rewards", "max_total_tokens": 64, "timeout_s": 120})
    config.write_text(json.dumps(cfg))
    result = forks.run([GRPO, "run", str(config)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-4000:]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    tokenizer = AutoTokenizer.from_pretrained(calc_model_dir)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    rows = [row for line in (tmp_path / "advantages.jsonl").read_text().splitlines()
            for row in json.loads(line)["rows"]]
    assert len(rows) == 2 * 2 * 4  # 2 steps x 2 groups x G = 4
    for row in rows:
        ids, mask = row["completion_ids"], row["mask"]
        pieces = runs(mask)
        assert sum(model for _, _, model in pieces) >= 2, decode(ids)
        calculator, turn_text = Calculator(), ""
        for start, end, model in pieces:   # what the agent added is what the calculator answers, and only that
            if model:
                turn_text = decode(ids[start:end])
            else:
                assert ids[start:end] == tokenizer(calculator.step(turn_text), add_special_tokens=False)["input_ids"]
        assert pieces[0][2] and pieces[-1][2]
    generator_log = (tmp_path / "run" / "logs" / "gen-0.log").read_text()
    assert "Traceback" not in generator_log and "agent endpoint at http://127.0.0.1:" in generator_log
    assert stray_processes(str(config)) == []
