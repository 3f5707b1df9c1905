"""The agent endpoint's pieces without a server: the text appended after a recorded turn, the assistant message of
a sampled turn, a group's shared prompt, an episode's record and deadline, the config's rules."""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError

from generator.agent.chat import ChatRenderer, Diverged, continuation_text, normalized, reply_message
from generator.agent.episodes import AgentStats, EpisodeBook, EpisodeGone
from generator.agent.runner import load_agent, shared_prefix
from generator.agent.sampler import cut
from generator.engines.base import SampledTurn
from shared.config.schema.generator import GeneratorConfig
from shared.errors import UsageError
from tests.generator import agent_kit


@pytest.fixture(scope="module")
def renderer():
    return ChatRenderer(agent_kit.chat_tokenizer())


def test_the_text_after_a_turn_is_the_templates_closing_less_the_eos_the_model_wrote_then_the_new_messages(renderer):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                {"role": "tool", "content": "42"}]
    recorded = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\na<|im_end|>"
    text, same = continuation_text(renderer, messages, 1, None, recorded, "<|im_end|>")
    assert text == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n" and same
    # a turn cut before its EOS gets the whole closing
    text, same = continuation_text(renderer, messages, 1, None, recorded.removesuffix("<|im_end|>"), "")
    assert text.startswith("<|im_end|>\n<|im_start|>tool") and same
    # sampled 'A', resent as 'a': the template's history is not what was sampled
    assert continuation_text(renderer, messages, 1, None, recorded.replace("a<", "A<"), "<|im_end|>")[1] is False


def test_a_template_that_rewrites_earlier_messages_cannot_be_continued():
    tokenizer = agent_kit.chat_tokenizer()
    # renders only the last message: the history changes as messages are added
    tokenizer.chat_template = "{{- messages[-1].content }}{%- if add_generation_prompt %}>{%- endif %}"
    with pytest.raises(Diverged, match="renders the earlier messages differently"):
        continuation_text(ChatRenderer(tokenizer), [{"role": "user", "content": "q"},
                                                    {"role": "assistant", "content": "a"},
                                                    {"role": "user", "content": "b"}], 1, None, "q>a", "")


def test_a_turn_with_tool_calls_becomes_openai_tool_calls_and_a_broken_one_stays_text():
    tokenizer = agent_kit.chat_tokenizer()
    reply = reply_message(tokenizer, 'let me <tool_call>{"name": "calc", "arguments": {"e": "1+1"}}</tool_call>',
                          agent_kit.TOOLS)
    assert reply["content"] == "let me" and len(reply["tool_calls"]) == 1
    call = reply["tool_calls"][0]
    assert call["type"] == "function" and call["function"] == {"name": "calc", "arguments": '{"e": "1+1"}'}
    broken = '<tool_call>{"name": </tool_call>'
    assert reply_message(tokenizer, broken, agent_kit.TOOLS) == {"role": "assistant", "content": broken}
    assert reply_message(tokenizer, broken, None) == {"role": "assistant", "content": broken}
    # a resent message is the same message whatever ids, extra fields or argument spacing the client uses
    resent = {"role": "assistant", "content": "let me", "refusal": None, "tool_calls": [
        {"id": "other", "type": "function", "function": {"name": "calc", "arguments": '{"e":"1+1"}'}}]}
    assert normalized(resent) == normalized(reply)


def test_a_group_prompt_is_what_its_episodes_first_prompts_share():
    assert shared_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == [1, 2]
    assert shared_prefix([[7, 8]]) == [7, 8] and shared_prefix([]) == []


def test_an_episode_record_puts_its_own_prompt_tail_first_and_its_steps_on_its_turns():
    book = EpisodeBook(AgentStats())
    episode = book.open({"question": "q"}, timeout_s=60)
    episode.prompt = [1, 2, 3]
    episode.append([10, 11], [-0.5, -0.25], model=True)
    episode.append([4], None, model=False)
    episode.append([12], [-1.0], model=True)
    with pytest.raises(ValueError, match="3 step rewards for 2 model turns"):
        book.reward(episode.id, None, [1.0, 2.0, 3.0])
    book.reward(episode.id, None, [0.5, 1.0])
    completion = episode.completion(prompt_length=2)
    assert completion.token_ids == [3, 10, 11, 4, 12] and completion.mask == [0, 1, 1, 0, 1]
    assert completion.logprobs == [0.0, -0.5, -0.25, 0.0, -1.0]
    assert completion.token_steps == [(2, 0.5), (4, 1.0)] and completion.env_reward == 1.5
    with pytest.raises(EpisodeGone, match="closed by its reward"):
        book.begin_call(episode.id)


def test_an_episode_past_its_deadline_expires_counted_once():
    stats = AgentStats()
    book = EpisodeBook(stats)
    late, done = book.open({}, timeout_s=0.05), book.open({}, timeout_s=60)
    book.reward(done.id, 1.0, None)
    started = time.monotonic()
    book.wait_closed([late, done], poll_s=0.01)
    assert time.monotonic() - started < 5
    assert late.failure is not None and stats.expired == 1 and stats.env_errors == 1
    with pytest.raises(EpisodeGone, match="failed"):
        book.reward(late.id, 1.0, None)


def test_a_turn_cut_at_its_own_limit_ends_with_length():
    turn = SampledTurn([1, 2, 3], [-1.0, -2.0, -3.0], "eos")
    assert cut(turn, 5) is turn
    assert cut(turn, 2) == SampledTurn([1, 2], [-1.0, -2.0], "length")


def test_the_config_names_what_contradicts_an_agent():
    assert GeneratorConfig(agent="my_agent.py:run").agent.fn == "my_agent.py:run"
    assert GeneratorConfig(agent="my_agent.py:run").rewards == []   # the agent's reward alone scores
    for extra, words in [({"environment": {"name": "calculator"}}, "both set"),
                         ({"rewards": [{"name": "arithmetic"}]}, "generator.agent.reward is 'agent'")]:
        with pytest.raises(ValidationError, match=words):
            GeneratorConfig(agent="my_agent.py:run", **extra)
    assert GeneratorConfig(agent={"fn": "a.py:f", "reward": "rewards"}).rewards[0].name == "arithmetic"
    assert GeneratorConfig(agent="my_agent.py:run", schedule={"mode": "continuous"}).agent is not None   # both run


def test_an_agent_function_is_checked_at_start(tmp_path):
    source = tmp_path / "agents.py"
    source.write_text("def good(client, example):\n    return 1.0\n\ndef one_arg(client):\n    return 1.0\n")
    assert load_agent(f"{source}:good")(None, None) == 1.0
    with pytest.raises(UsageError, match=r"generator.agent.fn: one_arg.*cannot be called as fn\(client, example\)"):
        load_agent(f"{source}:one_arg")
    with pytest.raises(UsageError, match="generator.agent.fn"):
        load_agent(f"{source}:missing")
