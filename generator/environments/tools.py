"""The built-in tool-calling environment for chat models (``generator.environment.name: tools``).

Tools are typed Python functions with docstrings, named in ``args.tools`` as ``package.module:function`` or
``path/to/file.py:function``; transformers' ``get_json_schema`` turns each into the JSON schema the chat template
shows the model (checked at start-up: a function without type hints or a docstring stops the run, naming
``generator.environment.args.tools[i]``). The prompt is the chat template rendered with ``tools=`` (how a template
that ignores tools is handled: :mod:`generator.environments.tool_chat`). After each model turn the calls it wrote
are parsed in the template's format, their arguments checked against the schema, the functions called, and the
results appended as the template's own tool messages plus the next generation prompt. A malformed call, an unknown
tool, arguments the schema does not allow or a tool that raises are answered with an error tool message the model
sees (counted in ``tool_errors``), never a failure of the trajectory. A turn without a call is the final answer.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable
from typing import Any

from generator.environments.base import ENVIRONMENTS
from generator.environments.tool_chat import (
    CALL_CLOSE,
    ToolCall,
    ToolCallError,
    parse_calls,
    template_shows_tools,
    tool_messages_text,
)
from shared.errors import UsageError
from shared.user_code import load_object

ARGS_KEY = "generator.environment.args"

_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict,
    "null": type(None)}


# -- the tools and their schemas --------------------------------------------------------------------------------
def tool_schema(fn: Any, key: str) -> dict:
    """The JSON schema of a typed, documented function (transformers' ``get_json_schema``); a UsageError naming
    ``key`` when it is not one."""
    from transformers.utils import get_json_schema

    if not inspect.isfunction(fn):
        raise UsageError(f"{key}: {fn!r} is not a Python function (a tool is a typed function with a docstring)")
    try:
        return get_json_schema(fn)
    except Exception as exc:  # noqa: BLE001 - transformers' Docstring/TypeHintParsingException and friends
        raise UsageError(f"{key}: {fn.__qualname__} cannot be a tool: {exc} (a tool needs a type hint on every "
                         "argument and a docstring with an Args: section describing each)") from None


def load_tools(specs: Any) -> dict[str, tuple[Callable, dict]]:
    """``{name: (function, schema)}`` of ``args.tools``; a UsageError naming the key of the first bad entry."""
    key = f"{ARGS_KEY}.tools"
    if not isinstance(specs, list) or not specs:
        raise UsageError(f"{key}: expected a non-empty list of 'package.module:function' or 'path/to/file.py:function'"
                         f", got {specs!r}")
    tools: dict[str, tuple[Callable, dict]] = {}
    for i, spec in enumerate(specs):
        fn = load_object(spec, f"{key}[{i}]")
        schema = tool_schema(fn, f"{key}[{i}]")
        name = schema["function"]["name"]
        if name in tools:
            raise UsageError(f"{key}[{i}]: a second tool named {name!r}")
        tools[name] = (fn, schema)
    return tools


# -- checking arguments against a schema ------------------------------------------------------------------------
def _type_matches(json_type: str, value: Any) -> bool:
    expected = _JSON_TYPES.get(json_type)
    if expected is None:
        return True   # a type this checker does not know: the function's own checks decide
    if isinstance(value, bool) and json_type in ("integer", "number"):
        return False
    return isinstance(value, expected)


def check_value(schema: dict, value: Any, where: str) -> None:
    """ToolCallError unless ``value`` is allowed by ``schema`` (the subset ``get_json_schema`` writes: type or
    list of types, nullable, enum, items, properties/required, additionalProperties, anyOf/oneOf)."""
    if value is None and schema.get("nullable"):
        return
    for combinator in ("anyOf", "oneOf"):
        if combinator in schema:
            problems = []
            for option in schema[combinator]:
                try:
                    check_value(option, value, where)
                    break
                except ToolCallError as exc:
                    problems.append(str(exc))
            else:
                raise ToolCallError(f"{where}: {json.dumps(value)[:60]} matches none of the allowed types")
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else list(types)
        if not any(_type_matches(t, value) for t in types):
            raise ToolCallError(f"{where} must be {' or '.join(types)}, got {json.dumps(value)[:60]}")
    if "enum" in schema and value not in schema["enum"]:
        raise ToolCallError(f"{where} must be one of {json.dumps(schema['enum'])[:80]}, got {json.dumps(value)[:60]}")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            check_value(schema["items"], item, f"{where}[{i}]")
    if isinstance(value, dict):
        check_object(schema, value, where)


def check_object(schema: dict, value: dict, where: str, closed: bool = False) -> None:
    """``value``'s keys and values against ``properties``, ``required`` and ``additionalProperties`` (``closed``:
    no keys beyond ``properties``, as for a function's arguments)."""
    properties = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in value]
    if missing:
        raise ToolCallError(f"{where + ': ' if where else ''}missing required argument{'s' if len(missing) > 1 else ''} "
                            f"{', '.join(map(repr, missing))}")
    extra = schema.get("additionalProperties", not closed)
    for k, v in value.items():
        if k in properties:
            check_value(properties[k], v, f"{where}.{k}" if where else k)
        elif extra is False:
            raise ToolCallError(f"{where + ': ' if where else ''}unknown argument {k!r} (arguments: "
                                f"{', '.join(properties) or 'none'})")
        elif isinstance(extra, dict):
            check_value(extra, v, f"{where}.{k}" if where else k)


def result_text(value: Any, max_chars: int) -> str:
    """A tool's return value as a tool message's content: a string as it is, anything else as JSON (``str`` for
    what JSON cannot hold), cut to ``max_chars``."""
    if not isinstance(value, str):
        try:
            value = json.dumps(value)
        except (TypeError, ValueError):
            value = str(value)
    return value if len(value) <= max_chars else value[:max_chars] + "..."


# -- the environment ----------------------------------------------------------------------------------------------
class ToolKit:
    """What every trajectory of a run shares: the tools, their schemas and the tokenizer's template."""

    def __init__(self, tools: dict[str, tuple[Callable, dict]], tokenizer) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise UsageError("generator.environment.name: tools needs a model whose tokenizer has a chat template")
        self.tools, self.tokenizer = tools, tokenizer
        self.schemas = [schema for _, schema in tools.values()]
        self.shown = self.schemas if template_shows_tools(tokenizer, self.schemas) else None
        tool_messages_text(tokenizer, [("probe", "probe")], self.shown)   # fails here, at start-up, not per call

    def parse(self, text: str) -> list[ToolCall | ToolCallError]:
        return parse_calls(self.tokenizer, text, self.schemas)

    def answer_text(self, results: list[tuple[str, str]]) -> str:
        return tool_messages_text(self.tokenizer, results, self.shown)


@ENVIRONMENTS.register("tools")
class ToolCalling:
    """One trajectory's tool calls. ``args``: ``tools`` (the functions), ``max_calls_per_turn`` (calls beyond it
    are answered with an error), ``max_result_chars`` (a longer result is cut)."""

    stop = [CALL_CLOSE]

    def __init__(self, tools: list[str], max_calls_per_turn: int = 4, max_result_chars: int = 1000, *,
                 _kit: ToolKit | None = None) -> None:
        if _kit is None:
            raise TypeError("ToolCalling is built by ToolCalling.with_tokenizer (it needs the chat template)")
        self.kit, self.max_calls_per_turn, self.max_result_chars = _kit, max_calls_per_turn, max_result_chars
        self.tool_calls = 0    # calls the model wrote (each answered)
        self.tool_errors = 0   # of those, answered with an error

    # hooks generator.environments.base and generator.multiturn call on the class
    @classmethod
    def check_args(cls, args: dict[str, Any]) -> None:
        """Start-up check of ``generator.environment.args``: known keys, sane limits, every tool loadable."""
        try:
            inspect.signature(cls.__init__).bind(None, **args)
        except TypeError as exc:
            raise UsageError(f"{ARGS_KEY}: {exc} (keys: tools, max_calls_per_turn, max_result_chars)") from None
        if "_kit" in args:
            raise UsageError(f"{ARGS_KEY}: unknown key '_kit'")
        for name in ("max_calls_per_turn", "max_result_chars"):
            value = args.get(name, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{ARGS_KEY}.{name}: expected a positive integer, got {value!r}")
        load_tools(args.get("tools"))

    @classmethod
    def chat_tools(cls, args: dict[str, Any]) -> list[dict]:
        """The tools' JSON schemas, for the prompt (``apply_chat_template(..., tools=...)``)."""
        return [schema for _, schema in load_tools(args.get("tools")).values()]

    @classmethod
    def with_tokenizer(cls, tokenizer, args: dict[str, Any]) -> Callable[[], ToolCalling]:
        """A factory of trajectories sharing one :class:`ToolKit` (tools loaded and the template probed once)."""
        cls.check_args(args)
        return functools.partial(cls, **args, _kit=ToolKit(load_tools(args["tools"]), tokenizer))

    # the environment
    def reset(self, sample: dict[str, Any]) -> str | None:
        return None

    def step(self, model_turn_text: str) -> str | None:
        calls = self.kit.parse(model_turn_text)
        if not calls:
            return None   # no call: the final answer
        results = [self.run(call, i) for i, call in enumerate(calls)]
        return self.kit.answer_text(results)

    def run(self, call: ToolCall | ToolCallError, index: int) -> tuple[str, str]:
        """``(tool name, message content)`` of one call: the result, or ``error: ...`` (counted)."""
        self.tool_calls += 1
        name = call.name if isinstance(call, ToolCall) else "error"
        try:
            if isinstance(call, ToolCallError):
                raise call
            if index >= self.max_calls_per_turn:
                raise ToolCallError(f"more than {self.max_calls_per_turn} calls in one turn")
            if call.name not in self.kit.tools:
                raise ToolCallError(f"unknown tool {call.name!r} (tools: {', '.join(self.kit.tools)})")
            fn, schema = self.kit.tools[call.name]
            check_object(schema["function"].get("parameters", {}), call.arguments, "", closed=True)
            return name, result_text(fn(**call.arguments), self.max_result_chars)
        except ToolCallError as exc:
            self.tool_errors += 1
            return name, f"error: {exc}"
        except Exception as exc:  # noqa: BLE001 - a raising tool is answered to the model, not a failed trajectory
            self.tool_errors += 1
            return name, f"error: {call.name} raised {type(exc).__name__}: {str(exc)[:200]}"
