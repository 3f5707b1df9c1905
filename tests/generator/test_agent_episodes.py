"""An agent's episodes through the real endpoint (uvicorn on 127.0.0.1, the openai client, the transformers engine
on tiny models): the recorded tokens are what the engine sampled, 32 episodes run at once, an episode without a
reward expires, a template that renders the history otherwise is detected."""

from __future__ import annotations

import time

import pytest

from generator.agent.runner import AgentRollouts
from generator.engines.hf import TransformersEngine
from shared.config.schema.agent import AgentConfig
from shared.protocol.records import SamplingParams
from tests.generator import agent_kit

GREEDY = SamplingParams(temperature=0.0, max_tokens=60)


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    return agent_kit.build_tool_model_dir(tmp_path_factory.mktemp("agent-tool-model"))


@pytest.fixture(scope="module")
def untrained_dir(tmp_path_factory):
    from deploy.demo.tiny_model import TinyModelSpec, build_tiny_model, save_model_dir

    tokenizer = agent_kit.chat_tokenizer()
    return str(save_model_dir(build_tiny_model(tokenizer, TinyModelSpec(seed=1)), tokenizer,
                              tmp_path_factory.mktemp("agent-untrained")))


def rollouts(model_dir, fn: str, sampling=GREEDY, template: str | None = None, **cfg):
    engine = agent_kit.SpyEngine(TransformersEngine(model_dir))
    if template is not None:
        engine.tokenizer.chat_template = template
    return engine, AgentRollouts(engine, engine.tokenizer, AgentConfig(fn=fn, port=0, **cfg), sampling, seed=3)


def check_record(engine, prompt: list[int], completion) -> list:
    """Every model token of ``completion`` is a turn the engine sampled after exactly the recorded tokens before
    it (the prompt and the completion so far: the prefix reused, never re-tokenised), with its logprobs and mask 1;
    every other token has mask 0 and logprob 0. Returns the turns in order."""
    sampled = engine.sampled()
    ids, mask, logprobs = completion.token_ids, completion.mask, completion.logprobs
    assert len(ids) == len(mask) == len(logprobs)
    turns, i = [], 0
    while i < len(ids):
        if mask[i] == 0:
            assert logprobs[i] == 0.0
            i += 1
            continue
        turn = next(t for t in sampled[tuple(prompt + ids[:i])] if ids[i:i + len(t.token_ids)] == t.token_ids)
        end = i + len(turn.token_ids)
        assert logprobs[i:end] == turn.logprobs and mask[i:end] == [1] * (end - i)
        turns.append(turn)
        i = end
    return turns


@pytest.mark.slow
def test_the_openai_client_drives_a_three_turn_tool_episode_recorded_token_for_token(tool_model_dir):
    engine, agent = rollouts(tool_model_dir, "tests.generator.agent_kit:tool_agent")
    try:
        example = {"question": agent_kit.QUESTION}
        prompts, groups = agent.generate([example], [[0]], GREEDY, 1)
    finally:
        agent.close()
    tokenizer, completion = engine.tokenizer, groups[0][0]
    turns = check_record(engine, prompts[0], completion)
    assert len(turns) == 3 and completion.env_reward == 1.0 and completion.env_failure is None
    # the answers the client read: two tool calls, then the answer, each with the sampled turn's logprobs
    answers = example["answers"]
    calls = [a.choices[0].message.tool_calls for a in answers]
    assert [(c[0].function.name, c[0].function.arguments) for c in calls[:2]] == [
        ("calc", '{"e": "7*8"}'), ("calc", '{"e": "56+1"}')]
    assert answers[2].choices[0].message.content == agent_kit.ANSWER and calls[2] is None
    assert [a.choices[0].finish_reason for a in answers] == ["tool_calls", "tool_calls", "stop"]
    for answer, turn in zip(answers, turns):
        assert [t.logprob for t in answer.choices[0].logprobs.content] == pytest.approx(turn.logprobs)
    # the whole episode is the template's rendering of the conversation, and nothing was rendered otherwise
    rendered = tokenizer.apply_chat_template(agent_kit.script_messages(), tools=agent_kit.TOOLS, tokenize=False)
    assert tokenizer.decode(prompts[0] + completion.token_ids, skip_special_tokens=False) == rendered.rstrip("\n")
    assert agent.stats.template_mismatches == 0 and agent.stats.turns == 3 and agent.stats.env_calls == 2


@pytest.mark.slow
def test_a_template_that_renders_the_history_otherwise_is_detected_and_the_sampled_tokens_kept(tool_model_dir):
    engine, agent = rollouts(tool_model_dir, "tests.generator.agent_kit:tool_agent",
                             template=agent_kit.QWEN_LAYOUT_TEMPLATE)
    try:
        prompts, groups = agent.generate([{"question": agent_kit.QUESTION}], [[0]], GREEDY, 1)
    finally:
        agent.close()
    turns = check_record(engine, prompts[0], groups[0][0])
    assert len(turns) == 3 and groups[0][0].env_reward == 1.0
    assert agent.stats.template_mismatches == 2   # each resent history holds a call laid out otherwise
    text = engine.tokenizer.decode(groups[0][0].token_ids, skip_special_tokens=False)
    assert "<tool_call>\n" not in text and text.count('<tool_call>{"name": "calc"') == 2


@pytest.mark.slow
def test_32_concurrent_episodes_are_each_recorded_and_rewarded_and_share_engine_calls(untrained_dir):
    sampling = SamplingParams(temperature=1.0, max_tokens=6)
    engine, agent = rollouts(untrained_dir, "tests.generator.agent_kit:chatty_agent", sampling=sampling)
    examples = [{"question": f"{i}+{i}", "reward": i / 10} for i in range(8)]
    try:
        prompts, groups = agent.generate(examples, [[0]] * 8, sampling, 4)
    finally:
        agent.close()
    assert agent.stats.trajectories == 32 and agent.stats.env_errors == 0 and agent.stats.turns == 64
    for example, prompt, group in zip(examples, prompts, groups):
        assert engine.tokenizer.decode(prompt).endswith(f"{example['question']}<|im_end|>\n<|im_start|>assistant\n")
        assert [c.env_reward for c in group] == [example["reward"]] * 4
        for completion in group:
            assert len(check_record(engine, prompt, completion)) == 2
    assert sum(len(contexts) for contexts, _ in engine.calls) == 64
    assert len(engine.calls) < 64 and max(len(contexts) for contexts, _ in engine.calls) > 1
    assert agent.sampler.batches == [len(contexts) for contexts, _ in engine.calls]   # one stop set: one call each


@pytest.mark.slow
def test_an_episode_without_a_reward_expires_counted_and_a_raising_agent_fails_its_episode_only(untrained_dir):
    sampling = SamplingParams(temperature=1.0, max_tokens=4)
    _, silent = rollouts(untrained_dir, "tests.generator.agent_kit:silent_agent", sampling=sampling, timeout_s=1.5)
    example = {"question": "hello", "sleep_s": 3.0}
    try:
        _, groups = silent.generate([example], [[0]], sampling, 1)
        assert silent.stats.expired == 1 and silent.stats.env_errors == 1
        assert groups[0][0].env_failed and sum(groups[0][0].mask) > 0   # the tokens of its call are kept
        deadline = time.monotonic() + 10
        while "late_status" not in example and time.monotonic() < deadline:
            time.sleep(0.1)
        assert example["late_status"] == 404   # its reward came after the batch ended: the episode is gone
    finally:
        silent.close()
    _, raising = rollouts(untrained_dir, "tests.generator.agent_kit:raising_agent", sampling=sampling)
    try:
        _, groups = raising.generate([{"question": "x"}], [[0]], sampling, 2)
    finally:
        raising.close()
    assert raising.stats.agent_errors == 2 and all("the agent broke" in str(c.env_failure) for c in groups[0])
    assert all(c.unusable for c in groups[0])   # nothing sampled: the group is never uploaded


@pytest.mark.slow
def test_an_async_agent_gets_an_async_client(untrained_dir):
    sampling = SamplingParams(temperature=1.0, max_tokens=3)
    _, agent = rollouts(untrained_dir, "tests.generator.agent_kit:async_agent", sampling=sampling)
    try:
        _, groups = agent.generate([{"question": "ab"}], [[0]], sampling, 2)
    finally:
        agent.close()
    for completion in groups[0]:
        text = agent.handler.decode(completion.token_ids)
        assert completion.env_reward == float(len(text)) and not completion.env_failed
