"""The built-in calculator environment re-expressed as an agent (``generator.agent:
deploy/demo/calc_agent.py:calculator_agent``, docs/agents.md): the same prompt, the same ``</calc>`` stop, the same
``<result>...</result>`` observations and the same turn limit as ``generator.environment: {name: calculator,
max_turns: 2}`` of the calculator demo (deploy/configs/tiny-calculator-cpu.yaml), through the OpenAI-compatible text completions of the agent endpoint instead of the engine."""

from __future__ import annotations

import re

from generator.environments.calculator import CalculatorError, evaluate

CALL = re.compile(r"<calc>(.*)$", re.DOTALL)
MAX_TURNS = 2   # the calculator demo's environment.max_turns: a call, then the answer
MAX_TURN_TOKENS = 24


def calculator_agent(client, example) -> None:
    """Up to MAX_TURNS model turns; a turn that ends at ``</calc>`` is answered as the calculator answers it. The
    reward is left to generator.rewards (``generator.agent.reward: rewards``), as with the environment."""
    text = example["question"]
    for _ in range(MAX_TURNS):
        choice = client.completions.create(model="policy", prompt=text, max_tokens=MAX_TURN_TOKENS,
                                           stop=["</calc>"]).choices[0]
        call = CALL.search(choice.text)
        if getattr(choice, "stop_reason", None) != "</calc>" or call is None:
            return None   # EOS, its length, or no call: the model's answer
        try:
            value = str(evaluate(call.group(1)))
        except CalculatorError:
            value = "error"
        text += f"{choice.text}</calc><result>{value}</result>"
    return None
