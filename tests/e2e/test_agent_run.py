"""End to end, an agent: `grpo run` with generator.agent naming the calculator agent (deploy/demo/calc_agent.py) on
a tiny model that calls the calculator. The learner trains on the episodes the endpoint recorded: two or more model
turns per episode, masks 0 exactly on the calculator's results the agent added (the checks of the calculator
environment's own run, tests/e2e/test_multiturn_run.py), on both schedules."""

from pathlib import Path

import pytest

from .test_multiturn_run import calculator_run, check_calculator_rows

AGENT = str(Path(__file__).resolve().parents[2] / "deploy" / "demo" / "calc_agent.py") + ":calculator_agent"


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["batch", "continuous"])
def test_grpo_run_with_an_agent_file_trains_on_the_recorded_episodes(calc_model_dir, tmp_path, schedule):
    rows = calculator_run(tmp_path, calc_model_dir, schedule={"mode": schedule},
                          agent={"fn": AGENT, "reward": "rewards", "max_total_tokens": 64, "timeout_s": 120})
    check_calculator_rows(rows, calc_model_dir)
    generator_log = (tmp_path / "run" / "logs" / "gen-0.log").read_text()
    assert "Traceback" not in generator_log and "agent endpoint at http://127.0.0.1:" in generator_log
    if schedule == "continuous":   # the schedule's closing line: its engine stepped the episodes' calls
        assert "continuous schedule: " in generator_log and "engine steps" in generator_log, generator_log[-2000:]
