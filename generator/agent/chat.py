"""Chat calls as tokens: what a ``/chat/completions`` call of an episode conditions the model on, and the assistant
message its sampled turn becomes.

Token in, token out. The first call's messages are rendered by the tokenizer's chat template (``tools`` too; a
template that ignores them gets them the way generator/environments/tool_chat.py shows them) and tokenized once.
A later call must resend the episode's conversation: the messages of the previous call, then the assistant message
this endpoint returned, then new messages (tool results, the user's next turn). The recorded tokens (prompt and
every sampled token) are reused as they are; only the new messages are rendered, as the text the template puts
after the assistant's turn (:func:`continuation_text`), tokenized on its own and appended as non-model tokens. When
the template renders the recorded history differently from what the model sampled (tool calls in its own JSON
layout, trimmed content), the difference is detected and counted (``template_mismatches``): the recorded tokens are
still what is trained on, never a re-tokenised rendering.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from generator.environments.tool_chat import (
    CALL_OPEN,
    ToolCall,
    parse_calls,
    template_shows_tools,
    tools_system_prompt,
)

# stands for an assistant's content when the text after it is rendered; never in a real conversation
_SENTINEL = "\x00grpo-agent-content\x00"


class Diverged(ValueError):
    """A call whose messages do not continue the episode's recorded conversation (the message says where)."""


def content_text(content: Any) -> str:
    """A message's content as text: a string, None, or OpenAI's list of parts (the text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def normalized(message: dict) -> tuple:
    """What identifies a message when a conversation is resent: role, content text and tool calls (name, parsed
    arguments); ids, names and other fields a client adds or drops are not compared."""
    calls = tuple(json.dumps([(c.get("function") or {}).get("name"), _arguments((c.get("function") or {})
                                                                                .get("arguments"))], sort_keys=True)
                  for c in message.get("tool_calls") or [])
    return message.get("role"), content_text(message.get("content")), calls


def template_message(message: dict) -> dict:
    """A message as chat templates read it: content as text, tool calls' arguments as objects (most templates
    write them with ``tojson``)."""
    out = {"role": message["role"], "content": content_text(message.get("content"))}
    if message.get("tool_calls"):
        out["tool_calls"] = [{"type": "function", "id": c.get("id"),
                              "function": {"name": (c.get("function") or {}).get("name"),
                                           "arguments": _arguments((c.get("function") or {}).get("arguments"))}}
                             for c in message["tool_calls"]]
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


class ChatRenderer:
    """The tokenizer's chat template over OpenAI-shaped messages (and ``tools``)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._shows_tools: dict[str, bool] = {}

    def _prepared(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
        converted = [template_message(m) for m in messages]
        if not tools:
            return converted, None
        key = json.dumps(tools, sort_keys=True)
        if key not in self._shows_tools:
            self._shows_tools[key] = template_shows_tools(self.tokenizer, tools)
        if self._shows_tools[key]:
            return converted, tools
        listing = tools_system_prompt(tools)   # a template that ignores tools: list them in the system message
        if converted and converted[0]["role"] == "system":
            return [{**converted[0], "content": f"{converted[0]['content']}\n\n{listing}"}, *converted[1:]], None
        return [{"role": "system", "content": listing}, *converted], None

    def render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        prepared, shown = self._prepared(messages, tools)
        return self.tokenizer.apply_chat_template(prepared, tools=shown, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def closing(self, history: list[dict], tools: list[dict] | None) -> str:
        """What the template writes after an assistant message's content (``<|im_end|>\\n`` for ChatML)."""
        text = self.render([*history, {"role": "assistant", "content": _SENTINEL}], tools, False)
        cut = text.rfind(_SENTINEL)
        return text[cut + len(_SENTINEL):] if cut >= 0 else ""


def continuation_text(renderer: ChatRenderer, messages: list[dict], reply_at: int, tools: list[dict] | None,
                      recorded_text: str, ended_with: str) -> tuple[str, bool]:
    """The text to append after the recorded tokens for a call resending ``messages`` whose message ``reply_at`` is
    the episode's last sampled turn, and whether the template renders the recorded history as it was sampled.

    ``recorded_text``: the recorded tokens decoded (special tokens kept); ``ended_with``: the text of the token that
    ended the last turn when it was an EOS the template also writes (else ""). The text is what the template puts
    after that turn (its closing, less the EOS the model already wrote) and the new messages through the next
    generation prompt. Diverged when the template is not append-only for this conversation."""
    history = renderer.render(messages[:reply_at + 1], tools, False)
    full = renderer.render(messages, tools, True)
    if not full.startswith(history):
        raise Diverged("the chat template renders the earlier messages differently once the new ones follow, so the "
                       "new messages cannot be appended to the recorded tokens")
    closing = renderer.closing(messages[:reply_at], tools)
    if ended_with and closing.startswith(ended_with):
        closing = closing[len(ended_with):]
    return closing + full[len(history):], history == recorded_text + closing


def reply_message(tokenizer, text: str, tools: list[dict] | None) -> dict:
    """The assistant message of a sampled turn's text (special tokens left out): its tool calls parsed in the
    template's format when the call offered ``tools`` (a turn whose calls cannot all be parsed stays plain
    content, for the agent to read)."""
    if tools and CALL_OPEN in text or (tools and getattr(tokenizer, "response_template", None) is not None):
        calls = parse_calls(tokenizer, text, tools)
        if calls and all(isinstance(c, ToolCall) for c in calls):
            content = text.split(CALL_OPEN, 1)[0].strip()
            return {"role": "assistant", "content": content or None,
                    "tool_calls": [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                                    "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                   for c in calls]}
    return {"role": "assistant", "content": text}
