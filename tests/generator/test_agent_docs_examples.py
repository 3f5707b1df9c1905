"""docs/agents.md's examples, run as written: the ``openai`` client agent of "Write an agent" as the generator's
``agent.fn`` (only ``my_tool``, which the page leaves to the user, is added), and an external agent that claims an
episode and drives it with ``openai.OpenAI(base_url=episode["base_url"], api_key=TOKEN)`` as the page says. Both
against the real endpoint (uvicorn on 127.0.0.1) and the tiny model that has memorised a two-call calculator
episode, sampled greedily: each reward is the page's own check of the answer."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import openai
import pytest
import requests

from generator.agent.runner import AgentRollouts
from generator.engines.hf import TransformersEngine
from shared.config.schema.agent import AgentConfig
from shared.protocol.records import SamplingParams
from tests.generator import agent_kit

PAGE = Path(__file__).resolve().parents[2] / "docs" / "agents.md"
GREEDY = SamplingParams(temperature=0.0, max_tokens=60)
TOKEN = "s3cret"
# what the page leaves to the user: the tool (the memorised episode's two expressions)
MY_TOOL = """

def my_tool(call):
    import json
    return {"7*8": "56", "56+1": "57"}.get(json.loads(call.function.arguments)["e"], "error")
"""


def python_block_after(heading: str) -> str:
    """The first fenced python block of the page's section ``heading``."""
    text = PAGE.read_text()
    start = text.index(heading)
    match = re.compile(r"```python\n(.*?)```", re.DOTALL).search(text, start)
    assert match and text.find("\n## ", start + len(heading)) > match.start(), f"no python block under {heading!r}"
    return match.group(1)


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    return agent_kit.build_tool_model_dir(tmp_path_factory.mktemp("docs-agent-model"))


@pytest.mark.slow
def test_the_pages_agent_runs_unchanged_and_earns_the_memorised_answers_reward(tool_model_dir, tmp_path,
                                                                              monkeypatch):
    block = python_block_after("## Write an agent")
    assert "def run(client, example)" in block and "my_tool(call)" in block
    (tmp_path / "docs_agent.py").write_text(block + MY_TOOL)
    monkeypatch.syspath_prepend(str(tmp_path))
    engine = TransformersEngine(tool_model_dir)
    agent = AgentRollouts(engine, engine.tokenizer, AgentConfig(fn="docs_agent:run", port=0), GREEDY, seed=3)
    try:
        prompts, groups = agent.generate([{"question": agent_kit.QUESTION, "answer": agent_kit.ANSWER}], [[0]],
                                         GREEDY, 2)
    finally:
        agent.close()
    (group,) = groups
    assert [c.env_reward for c in group] == [1.0, 1.0]    # the page's check: the content is the answer
    # each episode is the memorised conversation: two tool calls the model wrote, the results my_tool gave
    rendered = engine.tokenizer.apply_chat_template(agent_kit.script_messages(), tools=agent_kit.TOOLS,
                                                    tokenize=False).rstrip("\n")
    for completion in group:
        assert engine.tokenizer.decode(prompts[0] + completion.token_ids, skip_special_tokens=False) == rendered
        assert 0 in completion.mask and 1 in completion.mask    # the tool's text is not the model's


@pytest.mark.slow
def test_an_external_agent_drives_a_claimed_episode_with_the_openai_client_as_the_page_says(tool_model_dir):
    page = PAGE.read_text()
    assert 'openai.OpenAI(base_url=episode["base_url"], api_key=TOKEN)' in " ".join(page.split())
    engine = TransformersEngine(tool_model_dir)
    agent = AgentRollouts(engine, engine.tokenizer, AgentConfig(port=0, token=TOKEN, timeout_s=120), GREEDY, seed=3)
    result: dict = {}
    batch = threading.Thread(target=lambda: result.update(groups=agent.generate(
        [{"question": agent_kit.QUESTION, "answer": agent_kit.ANSWER}], [[0]], GREEDY, 1)[1]))
    batch.start()
    try:
        episode = requests.post(f"{agent.server.url}/episodes?wait_s=30", headers={"Authorization": f"Bearer {TOKEN}"},
                                timeout=60).json()
        assert episode["example"]["question"] == agent_kit.QUESTION and episode["base_url"].endswith("/v1")
        client = openai.OpenAI(base_url=episode["base_url"], api_key=TOKEN, max_retries=0)
        messages = [{"role": "user", "content": episode["example"]["question"]}]
        for _ in range(4):
            message = client.chat.completions.create(model="policy", messages=messages, tools=agent_kit.TOOLS,
                                                     logprobs=True).choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                value = agent_kit.VALUES.get(json.loads(call.function.arguments)["e"], "error")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": value})
        assert messages[-1]["content"] == agent_kit.ANSWER and len(messages) == 6   # two calls, two results, answer
        reward_url = episode["base_url"].removesuffix("/v1") + "/reward"
        posted = requests.post(reward_url, json={"reward": 0.75}, headers={"Authorization": f"Bearer {TOKEN}"},
                               timeout=30)
        assert posted.status_code == 200, posted.text
        batch.join(timeout=120)
        assert not batch.is_alive()
    finally:
        agent.close()
    (group,) = result["groups"]
    assert [c.env_reward for c in group] == [0.75]
