"""Text calls whose answer leaves out tokens the model sampled (OpenAI's text omits the stop string that ended a
turn, and special tokens): a client that continues the text it was answered is not told it diverged; the episode
keeps the tokens as sampled and appends what the client added. Real endpoint, the tiny model that has memorised a
calculator episode, greedy."""

from __future__ import annotations

import pytest

from generator.agent.runner import AgentRollouts
from generator.engines.hf import TransformersEngine
from shared.config.schema.agent import AgentConfig
from shared.protocol.records import SamplingParams
from tests.generator import agent_kit

GREEDY = SamplingParams(temperature=0.0, max_tokens=60)


def stop_string_agent(client, example) -> float:
    """Stops its first turn at ``"calc"`` and continues from the answer's text (without it), adding ``"x"``."""
    prompt = example["prompt"]
    first = client.completions.create(model="policy", prompt=prompt, stop=["calc"], max_tokens=60)
    example["first"] = first.choices[0]
    second = client.completions.create(model="policy", prompt=prompt + first.choices[0].text + "x", max_tokens=3)
    example["second"] = second.choices[0]
    return 1.0


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    return agent_kit.build_tool_model_dir(tmp_path_factory.mktemp("agent-text-model"))


@pytest.mark.slow
def test_a_client_continuing_the_text_it_was_answered_keeps_its_episode_and_the_sampled_tokens(tool_model_dir):
    engine = TransformersEngine(tool_model_dir)
    tokenizer = engine.tokenizer
    prompt = tokenizer.apply_chat_template(agent_kit.script_messages()[:1], tools=agent_kit.TOOLS,
                                           add_generation_prompt=True, tokenize=False)
    agent = AgentRollouts(engine, tokenizer, AgentConfig(
        fn="tests.generator.test_agent_text_round_trip:stop_string_agent", port=0), GREEDY, seed=3)
    example = {"prompt": prompt}
    try:
        _, groups = agent.generate([example], [[0]], GREEDY, 1)
    finally:
        agent.close()
    (completion,) = groups[0]
    assert completion.env_failure is None and completion.env_reward == 1.0
    first = example["first"]
    assert first.finish_reason == "stop" and first.stop_reason == "calc" and not first.text.endswith("calc")
    # the recorded tokens: the first turn as sampled (through "calc"), the client's "x" (mask 0), the second turn
    ids = completion.token_ids
    sampled_first = tokenizer(first.text + "calc", add_special_tokens=False)["input_ids"]
    x = tokenizer("x", add_special_tokens=False)["input_ids"]
    assert ids[:len(sampled_first)] == sampled_first
    assert ids[len(sampled_first):len(sampled_first) + len(x)] == x
    assert completion.mask == [1] * len(sampled_first) + [0] * len(x) + [1] * (len(ids) - len(sampled_first) - len(x))
    assert agent.stats.template_mismatches == 1 and agent.stats.diverged == 0 and agent.stats.turns == 2
