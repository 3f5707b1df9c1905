"""Tool calling through a chat template: the prompt that shows the tools, the calls in a model turn, and the tool
messages that answer them, as the exact text the tokenizer's own template renders.

* The prompt: ``apply_chat_template(messages, tools=schemas, add_generation_prompt=True)``. A template that ignores
  ``tools`` (SmolLM2's renders the same text with and without them) gets the tool list the way its family is
  prompted for function calling instead: a system message listing the JSON schemas in ``<tools></tools>`` and
  asking for calls as ``<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>`` (:data:`TOOLS_SYSTEM_PROMPT`,
  after the dataset's own system prompt, if any).
* The calls: ``tokenizer.parse_response`` when the tokenizer carries a ``response_template`` (transformers' own
  parser, arguments cast by the tools' schemas); else the Hermes/Qwen/SmolLM2 format every ChatML tool model uses:
  ``<tool_call>`` JSON ``</tool_call>``, the JSON one call ``{"name": ..., "arguments": {...}}`` or a list of them.
* The answer: the text the template renders after the assistant's content for ``{"role": "tool", ...}`` messages
  plus the next generation prompt, found by rendering ``[user, assistant]`` and ``[user, assistant, tool...]`` and
  taking the suffix (:func:`tool_messages_text`). It starts with the close of the assistant message (the turn
  stopped at ``</tool_call>``, before ``<|im_end|>``), so the appended tokens continue the model's own exactly as a
  re-rendering of the whole conversation would, without ever re-rendering the history.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from shared.errors import UsageError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
# stands for the assistant's content when the tool message suffix is rendered; never in a real conversation
_SENTINEL = "\x00grpo-assistant-content\x00"
_PROBE_QUESTION = "?"

# Written for this project in the shape SmolLM2's function-calling data uses (<tools> with the JSON schemas, calls
# as a JSON list in <tool_call> tags); used only for a template that ignores ``tools``.
TOOLS_SYSTEM_PROMPT = (
    "You can call functions to answer. Their JSON schemas:\n<tools>{tools}</tools>\n"
    "To call functions, reply with only a JSON list of calls inside <tool_call></tool_call> tags, e.g.\n"
    "<tool_call>[{example}]</tool_call>\n"
    "Each result comes back as a tool message. Once you know the answer, reply with it and no tool call."
)


class ToolCallError(ValueError):
    """A call the model wrote that cannot be run: the message is shown to the model as the tool's answer."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def _render(tokenizer, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def template_shows_tools(tokenizer, tools: list[dict]) -> bool:
    """Whether the chat template renders ``tools`` at all (SmolLM2's does not)."""
    probe = [{"role": "user", "content": _PROBE_QUESTION}]
    try:
        return _render(tokenizer, probe, tools, True) != _render(tokenizer, probe, None, True)
    except Exception as exc:  # noqa: BLE001 - a template's own error (raise_exception, a missing key) is reported
        raise UsageError(f"generator.environment: the chat template cannot render a user message with tools "
                         f"({type(exc).__name__}: {exc})") from exc


def tools_system_prompt(tools: list[dict]) -> str:
    """The family-style tool prompt (:data:`TOOLS_SYSTEM_PROMPT`) for a template that ignores ``tools``."""
    first = tools[0]["function"]
    params = list(first.get("parameters", {}).get("properties", {}))
    example = json.dumps({"name": first["name"], "arguments": {p: "..." for p in params[:1]}})
    listed = "\n".join(json.dumps(t) for t in tools)
    return TOOLS_SYSTEM_PROMPT.format(tools=f"\n{listed}\n", example=example)


def render_tool_prompt(tokenizer, question: str, system_prompt: str | None, tools: list[dict]) -> str:
    """The prompt of a tool-calling trajectory: system (if any) and user messages with the tools, ending in the
    generation prompt. A template that ignores ``tools`` gets :func:`tools_system_prompt` as (part of) its system
    message instead."""
    if template_shows_tools(tokenizer, tools):
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
        messages.append({"role": "user", "content": question})
        return _render(tokenizer, messages, tools, True)
    system = tools_system_prompt(tools)
    if system_prompt:
        system = f"{system_prompt}\n\n{system}"
    return _render(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": question}],
                   None, True)


def tool_messages_text(tokenizer, results: list[tuple[str, str]], shown_tools: list[dict] | None = None) -> str:
    """What the template renders after an assistant message's content when tool messages ``(name, content)``
    follow it, through the next generation prompt (e.g. ``<|im_end|>\\n<|im_start|>tool\\n56<|im_end|>\\n
    <|im_start|>assistant\\n`` for SmolLM2). ``shown_tools``: the schemas, for a template that shows them (None
    for one that ignores them). UsageError when the template renders the history differently once a tool message
    follows (the suffix would then not continue the model's tokens)."""
    shown = shown_tools
    head = [{"role": "user", "content": _PROBE_QUESTION}, {"role": "assistant", "content": _SENTINEL}]
    tail = [{"role": "tool", "name": name, "content": content} for name, content in results]
    try:
        before = _render(tokenizer, head, shown, False)
        after = _render(tokenizer, head + tail, shown, True)
    except Exception as exc:  # noqa: BLE001 - a template's own error (raise_exception, a missing key) is reported
        raise UsageError(f"generator.environment: the chat template cannot render a tool message after an assistant "
                         f"message ({type(exc).__name__}: {exc})") from exc
    cut = before.find(_SENTINEL)
    if cut < 0 or not after.startswith(before):
        raise UsageError("generator.environment: the chat template renders the conversation differently once a "
                         "tool message follows, so a tool message cannot be appended as tokens")
    return after[cut + len(_SENTINEL):]


# -- parsing a model turn ---------------------------------------------------------------------------------------
def _call_of(value: Any) -> ToolCall:
    if not isinstance(value, dict):
        raise ToolCallError(f"a tool call must be a JSON object with name and arguments, got {json.dumps(value)[:80]}")
    if "function" in value and isinstance(value["function"], dict):   # {"type": "function", "function": {...}}
        value = value["function"]
    name, arguments = value.get("name"), value.get("arguments", {})
    if not isinstance(name, str) or not name:
        raise ToolCallError("a tool call needs a \"name\" string")
    if isinstance(arguments, str):   # OpenAI style: the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ToolCallError(f"the arguments of {name!r} are not JSON") from None
    if not isinstance(arguments, dict):
        raise ToolCallError(f"the arguments of {name!r} must be a JSON object")
    return ToolCall(name, arguments)


def parse_hermes_calls(text: str) -> list[ToolCall | ToolCallError]:
    """The calls of ``<tool_call>`` JSON ``</tool_call>`` blocks (one call or a list of them per block); a block
    that is not a call is a :class:`ToolCallError` in its place. No block: an empty list (the final answer)."""
    calls: list[ToolCall | ToolCallError] = []
    for block in _CALL_BLOCK.findall(text):
        try:
            value = json.loads(block.strip())
        except json.JSONDecodeError as exc:
            calls.append(ToolCallError(f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})"))
            continue
        for item in (value if isinstance(value, list) else [value]):
            try:
                calls.append(_call_of(item))
            except ToolCallError as exc:
                calls.append(exc)
    return calls


def render_hermes_call(call: ToolCall) -> str:
    """``call`` as a model writes it in the Hermes/Qwen format (the inverse of :func:`parse_hermes_calls`)."""
    return f"{CALL_OPEN}\n{json.dumps({'name': call.name, 'arguments': call.arguments})}\n{CALL_CLOSE}"


def parse_calls(tokenizer, text: str, tools: list[dict]) -> list[ToolCall | ToolCallError]:
    """The calls of a model turn: transformers' ``parse_response`` when the tokenizer has a ``response_template``,
    else :func:`parse_hermes_calls`."""
    if getattr(tokenizer, "response_template", None) is None:
        return parse_hermes_calls(text)
    try:
        message = tokenizer.parse_response(text, prefix="", tools=tools)
    except (ValueError, KeyError, TypeError) as exc:
        return [ToolCallError(f"the tool call cannot be parsed ({exc})")]
    calls: list[ToolCall | ToolCallError] = []
    for item in message.get("tool_calls") or []:
        try:
            calls.append(_call_of(item))
        except ToolCallError as exc:
            calls.append(exc)
    return calls
