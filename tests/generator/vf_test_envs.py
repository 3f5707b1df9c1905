"""Small verifiers environments (classic API) for tests/generator/test_verifiers_env.py, loaded by env_id
(``tests.generator.vf_test_envs``: verifiers imports the module and calls its load_environment(kind=...)).

* ``single``: a SingleTurnEnv over numbered questions; its rubric's reward is a checksum of the answer's text plus
  the row's answer, so a test recomputes it from the tokens the engine sampled;
* ``tools``: a ToolEnv with the ``calc`` tool of tests/generator/agent_kit.py over its memorised question (two tool
  calls, then the answer); reward 1.0 for the right answer;
* ``raising``: a MultiTurnEnv whose env_response raises for rows whose info says so (the others score 1.0).
"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

from tests.generator import agent_kit


def checksum(text: str) -> float:
    return (sum(map(ord, text)) % 97) / 97


def answer_text(completion) -> str:
    """The last assistant message's text; "" when the rollout ended before one (an empty answer)."""
    return next(((m.content or "") for m in reversed(completion) if m.role == "assistant"), "")


def checksum_reward(completion, answer: str, **kwargs) -> float:
    return checksum(answer_text(completion)) + float(answer)


def calc(e: str) -> str:
    """Compute an arithmetic expression.

    Args:
        e: An expression.
    """
    return agent_kit.VALUES.get(e, "error")


def right_answer(completion, answer: str, **kwargs) -> float:
    return float(answer_text(completion).strip() == answer)


class RaisingEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        if state["info"].get("explode"):
            raise RuntimeError("the environment broke")
        return [{"role": "user", "content": "again"}]


def load_environment(kind: str = "single", rows: int = 4):
    if kind == "single":
        data = Dataset.from_list([{"question": f"{i}+{i}", "answer": str(i)} for i in range(rows)])
        evals = Dataset.from_list([{"question": f"{i}*{i}", "answer": str(i * i)} for i in range(2)])
        return vf.SingleTurnEnv(dataset=data, eval_dataset=evals, rubric=vf.Rubric(funcs=[checksum_reward]))
    if kind == "tools":
        data = Dataset.from_list([{"question": agent_kit.QUESTION, "answer": agent_kit.ANSWER}])
        return vf.ToolEnv(dataset=data, tools=[calc], max_turns=4, rubric=vf.Rubric(funcs=[right_answer]))
    if kind == "raising":
        data = Dataset.from_list([{"question": "go", "answer": "1", "info": {"explode": bool(i % 2)}}
                                  for i in range(rows)])
        return RaisingEnv(dataset=data, max_turns=2, rubric=vf.Rubric(funcs=[lambda **kw: 1.0]))
    raise ValueError(f"unknown kind {kind!r}")
