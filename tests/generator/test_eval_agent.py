"""``grpo eval`` with ``generator.agent``: the agent's episodes are what is evaluated, scored as in training."""

import socket
from pathlib import Path

import pytest

from generator.evaluate import evaluate
from shared.config.schema import GRPOConfig
from shared.errors import UsageError
from tests.generator.test_evaluate import write_jsonl

CALC_AGENT = str(Path(__file__).resolve().parents[2] / "deploy" / "demo" / "calc_agent.py") + ":calculator_agent"

# an agent that grades itself: one call, its reward 1 when the text holds the right product (reward: agent)
SELF_GRADING = '''
def agent(client, example):
    text = client.completions.create(model="policy", prompt=example["question"], max_tokens=24).choices[0].text
    return 1.0 if example["answer"] in text else 0.0
'''


def problems(tmp_path):
    from tests.calc_model import PROBLEMS

    questions = [f"{e}=" for e in PROBLEMS] + ["6*7=", "3+4="]   # memorised (calls the calculator) and not
    return write_jsonl(tmp_path / "problems.jsonl", questions), len(questions)


PYTHON_REWARD = [{"name": "python", "args": {"function": "tests.generator.test_evaluate:final_after_result"}}]


def calc_config(data, count: int, rewards=PYTHON_REWARD, **rollouts) -> GRPOConfig:
    return GRPOConfig.model_validate({
        "generator": {"dataset": {"kind": "jsonl", "path": str(data), "system_prompt": ""},
                      **({"rewards": rewards} if rewards else {}), "sampling": {"max_tokens": 24}, **rollouts},
        "eval": {"num_examples": count, "k": 2, "engine": "transformers", "path": str(data)}})


@pytest.mark.slow   # the agent endpoint: a uvicorn server
def test_eval_of_the_calculator_agent_equals_the_calculator_environment(calc_model_dir, tmp_path):
    data, count = problems(tmp_path)
    environment = evaluate(calc_config(data, count, environment={"name": "calculator", "max_turns": 2,
                                                                 "max_total_tokens": 64}), str(calc_model_dir))
    with socket.socket() as held:   # the configured port is taken (a training generator's): eval takes its own
        held.bind(("127.0.0.1", 0))
        held.listen()
        agent = evaluate(calc_config(data, count, agent={"fn": CALC_AGENT, "reward": "rewards", "max_total_tokens": 64,
                                                         "port": held.getsockname()[1]}), str(calc_model_dir))
    # greedy: the agent's episodes are the environment's trajectories token for token (docs/agents.md), so the
    # same problems are right and the same ones call the tool
    assert environment.greedy_accuracy >= 4 / count and environment.tool_call_rate >= 4 / count
    assert agent.greedy_accuracy == environment.greedy_accuracy
    assert agent.tool_call_rate == environment.tool_call_rate
    assert agent.turns_per_trajectory == environment.turns_per_trajectory and agent.env_errors == 0
    assert agent.num_examples == count and 0.0 <= agent.pass_at_k <= 1.0 and agent.k == 2


@pytest.mark.slow   # the agent endpoint: a uvicorn server
def test_eval_with_an_agent_that_returns_its_reward_judges_by_it(calc_model_dir, tmp_path):
    data, count = problems(tmp_path)
    agent_file = tmp_path / "grader.py"
    agent_file.write_text(SELF_GRADING)
    config = calc_config(data, count, rewards=None, agent={"fn": f"{agent_file}:agent", "reward": "agent"})
    result = evaluate(config, str(calc_model_dir))
    assert result.accuracy_reward == "agent" and set(result.greedy_rewards) == {"agent"}
    # what is judged is the agent's own 0/1, one call each: no tool output in any episode
    assert result.greedy_accuracy == pytest.approx(result.greedy_rewards["agent"]) and result.tool_call_rate == 0.0
    assert result.turns_per_trajectory == 1.0 and result.env_errors == 0
    with pytest.raises(UsageError, match=r"'python' is not one of the generator's rewards \['agent'\] \(generator.agent.reward: agent scores"):
        evaluate(config.model_copy(update={"eval": config.eval.model_copy(update={"accuracy_reward": "python"})}),
                 str(calc_model_dir))


def test_eval_with_an_external_agent_is_refused_naming_the_key(calc_model_dir, tmp_path):
    data, count = problems(tmp_path)
    with pytest.raises(UsageError, match="generator.agent.fn"):
        evaluate(calc_config(data, count, agent={"fn": None, "reward": "rewards"}), str(calc_model_dir))
