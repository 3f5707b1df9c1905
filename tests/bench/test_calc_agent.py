"""bench/calc_agent.py's arms (valid run configs: the calculator environment, or its agent), its tool-call rates
from a hand-made advantages file and its table, on hand-made runs (no grpo run)."""

import json
from pathlib import Path

import pytest

from bench.calc_agent import AGENT, ARMS, arm_settings, first_step_at, table, tool_call_rates
from bench.vs_trl import prepare_config
from bench.vs_trl_runs import grpo_config
from shared.config.loader import load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("arm", ARMS)
def test_every_arm_is_a_config_the_run_accepts(tmp_path, arm):
    config = prepare_config(str(ROOT / "deploy/configs/tiny-calculator-cpu.yaml"), 10, [])
    run_dir = tmp_path / arm
    run_dir.mkdir()
    loaded = load_config(str(grpo_config(config, run_dir, 8489, "cpu", str(tmp_path / "model"), seed=2,
                                         **arm_settings(arm, run_dir))), [])
    assert loaded.seed == 2 and Path(loaded.learner.advantages_jsonl) == run_dir / "advantages.jsonl"
    if arm == "environment":
        assert loaded.generator.agent is None and loaded.generator.environment.name == "calculator"
        assert loaded.generator.environment.max_turns == 2
    else:
        agent = loaded.generator.agent
        assert loaded.generator.environment is None and agent.fn == AGENT and Path(AGENT.split(":")[0]).is_file()
        assert (agent.reward, agent.max_total_tokens) == ("rewards", 64)
    assert [r.name for r in loaded.generator.rewards] == ["arithmetic"]   # both scored by the demo's reward


def test_tool_call_rates_are_the_share_of_sampled_rows_with_calculator_text(tmp_path):
    path = tmp_path / "advantages.jsonl"
    called, direct = {"reward": 1.0, "mask": [1, 1, 0, 0, 1]}, {"reward": 0.0, "mask": [1, 1, 1]}
    lines = [{"step": step, "rows": [called] * step + [direct] * (10 - step)} for step in range(1, 11)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    early, late = tool_call_rates(path)
    assert early == pytest.approx((1 + 2 + 3 + 4 + 5) / 50) and late == pytest.approx((6 + 7 + 8 + 9 + 10) / 50)
    assert tool_call_rates(tmp_path / "missing.jsonl") == (None, None)


def test_the_table_gives_each_run_its_curve_its_first_step_at_the_target_and_the_medians():
    run = {"arm": "agent", "seed": 0, "accuracy": {"10": 0.1, "20": None, "30": 0.35}, "total_s": 61.7,
           "load_avg_at_start": [2.04, 1.0, 1.0], "sampled_tool_calls_first_5": 0.3, "sampled_tool_calls_last_5": 0.55}
    assert first_step_at(run, 0.35) == 30 and first_step_at(run, 0.4) is None
    run["first_step_at_target"] = 30
    summary = {"target_accuracy": 0.35, "eval_steps": [10, 20, 30], "runs": {"agent-seed0": run},
               "final_accuracy": {"environment": [0.3, None], "agent": [0.35]}}
    lines = table(summary).splitlines()
    assert lines[2] == "| agent | 0 | 10.0% / - / 35.0% | 30 | 30.0% -> 55.0% | 62 | 2.0 |"
    assert "environment: final accuracy median 30.0% (seeds: 30.0%, -)" in lines
