"""Tool calling end to end on the transformers engine: a tiny chat model that has memorised calling the calculator
as a chat tool runs two turns through MultiTurnRollouts, and the mask covers exactly the tool message the template
renders. (SmolLM2-135M-Instruct does not call the tool greedily at this size, so a memorising tiny model makes the
two turns certain; SmolLM2's template itself is tested in test_tools.py.)"""

import string

import pytest
import torch

from deploy.demo.tiny_model import TinyModelSpec, build_char_tokenizer, build_tiny_model, save_model_dir
from generator.datasets import render_prompt
from generator.engines.hf import TransformersEngine
from generator.environments.base import prompt_tools
from generator.multiturn import MultiTurnRollouts
from shared.config.schema.generator import EnvironmentConfig
from shared.protocol.records import SamplingParams
from tests.calc_model import memorise

# a short ChatML template that shows the tools by name (the tiny model's context is 256 tokens)
SHORT_TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}{%- for t in tools %}{{- ' ' + t.function.name }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
PROBLEMS = {"7*8": 56, "12*5": 60}
CFG = EnvironmentConfig(name="tools", args={"tools": ["generator.environments.calculator:calculate"]},
                        max_turns=3, max_env_tokens=64, max_total_tokens=200)


def call_text(expression: str) -> str:
    return f'<tool_call>{{"name": "calculate", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


@pytest.fixture(scope="module")
def chat_tool_model(tmp_path_factory):
    """Supervised on prompt -> call, tool message (the environment's own text) -> answer, EOS; one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        tokenizer = build_char_tokenizer(corpus_chars=string.printable,
                                         special_tokens=("<pad>", "<|im_start|>", "<|im_end|>", "<unk>"),
                                         tag_tokens=("<tool_call>", "</tool_call>"))
        tokenizer.chat_template = SHORT_TOOLS_TEMPLATE
        model = build_tiny_model(tokenizer, TinyModelSpec(seed=1))
        kit = MultiTurnRollouts(type("E", (), {"generate_turns": None, "name": "x"})(), tokenizer, CFG).make_env().kit
        encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        rows, starts = [], []
        for expression, value in PROBLEMS.items():
            prompt = encode(render_prompt(tokenizer, expression, None, None, prompt_tools(CFG)))
            rest = encode(call_text(expression) + kit.answer_text([("calculate", str(value))]) + f"{value}<|im_end|>")
            rows.append(prompt + rest)
            starts.append(len(prompt))
        memorise(model, rows, starts, tokenizer.pad_token_id, steps=100)
        return save_model_dir(model, tokenizer, tmp_path_factory.mktemp("chat-tool-model"))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_two_turns_with_a_chat_tool_and_the_mask_covers_exactly_the_tool_message(chat_tool_model):
    engine = TransformersEngine(chat_tool_model)
    tokenizer = engine.tokenizer
    runner = MultiTurnRollouts(engine, tokenizer, CFG)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    questions = list(PROBLEMS)
    prompts = [encode(render_prompt(tokenizer, q, None, None, prompt_tools(CFG))) for q in questions]
    _, groups = runner.generate([{"question": q} for q in questions], prompts,
                                SamplingParams(temperature=0.0, max_tokens=80), 1, seed=0)
    kit = runner.make_env().kit
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for expression, group in zip(questions, groups):
        value = str(PROBLEMS[expression])
        turn1, message = encode(call_text(expression)), encode(kit.answer_text([("calculate", value)]))
        turn2 = encode(value) + [eos]
        sample = group[0]
        assert tokenizer.decode(message).startswith("<|im_end|>\n<|im_start|>tool\n" + value)
        assert sample.token_ids == turn1 + message + turn2
        assert sample.mask == [1] * len(turn1) + [0] * len(message) + [1] * len(turn2)
        assert sample.finish_reason == "stop" and not sample.env_failed
    stats = runner.stats
    assert (stats.turns, stats.env_calls, stats.tool_calls, stats.tool_errors, stats.env_errors) == (4, 2, 2, 0, 0)
