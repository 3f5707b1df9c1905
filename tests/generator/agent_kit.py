"""What the agent tests share: a ChatML character tokenizer, chat templates, a tiny model that has memorised a
three-turn tool-calling episode, an engine wrapper that keeps what the engine sampled, and agent functions the
runner loads by name (``tests.generator.agent_kit:...``)."""

from __future__ import annotations

import json
import string
import time

import requests
import torch

from deploy.demo.tiny_model import TinyModelSpec, build_char_tokenizer, build_tiny_model, save_model_dir
from tests.calc_model import memorise

# ChatML; tools shown by name; an assistant's tool calls written back exactly as the model writes them
TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}{%- for t in tools %}{{- ' ' + t.function.name }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}{{- '<tool_call>' + {'name': c.function.name, 'arguments': "
    "c.function.arguments} | tojson + '</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# the same, but tool calls laid out as Qwen's template writes them (newlines inside the tags): the history it
# renders differs from what the model sampled
QWEN_LAYOUT_TEMPLATE = TEMPLATE.replace("'<tool_call>' +", "'<tool_call>\\n' +").replace(
    "+ '</tool_call>'", "+ '\\n</tool_call>'")
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Compute.", "parameters": {
    "type": "object", "properties": {"e": {"type": "string", "description": "An expression."}}, "required": ["e"]}}}]
QUESTION = "7*8+1"
# the memorised episode: call, result, call, result, answer
SCRIPT = [("calc", "7*8", "56"), ("calc", "56+1", "57")]
ANSWER = "57"
VALUES = {expression: result for _, expression, result in SCRIPT}


def chat_tokenizer():
    tokenizer = build_char_tokenizer(corpus_chars=string.printable,
                                     special_tokens=("<pad>", "<|im_start|>", "<|im_end|>", "<unk>"),
                                     tag_tokens=("<tool_call>", "</tool_call>"))
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def call_text(name: str, expression: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {{"e": "{expression}"}}}}</tool_call>'


def script_messages() -> list[dict]:
    """The memorised episode as messages (the last one the final answer)."""
    messages = [{"role": "user", "content": QUESTION}]
    for name, expression, result in SCRIPT:
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": {"e": expression}}}]})
        messages.append({"role": "tool", "content": result})
    messages.append({"role": "assistant", "content": ANSWER})
    return messages


def build_tool_model_dir(folder) -> str:
    """The untrained tiny model supervised on the scripted episode (its assistant turns), one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokenizer = chat_tokenizer()
        model = build_tiny_model(tokenizer, TinyModelSpec(seed=1))
        ids = tokenizer.apply_chat_template(script_messages(), tools=TOOLS, tokenize=False)
        row = tokenizer(ids, add_special_tokens=False)["input_ids"]
        prompt = tokenizer(tokenizer.apply_chat_template(script_messages()[:1], tools=TOOLS, tokenize=False,
                                                         add_generation_prompt=True),
                           add_special_tokens=False)["input_ids"]
        memorise(model, [row], [len(prompt)], tokenizer.pad_token_id, steps=120)
        return str(save_model_dir(model, tokenizer, folder))
    finally:
        torch.set_num_threads(threads)


class SpyEngine:
    """A real engine whose ``generate_turns`` calls are kept: each call's contexts and what it sampled."""

    def __init__(self, engine) -> None:
        self.engine, self.name, self.tokenizer = engine, engine.name, engine.tokenizer
        self.calls: list[tuple[list[list[int]], list]] = []

    def generate_turns(self, contexts, sampling, n, stops, seed=None):
        turns = self.engine.generate_turns(contexts, sampling, n, stops, seed=seed)
        self.calls.append(([list(c) for c in contexts], [group[0] for group in turns]))
        return turns

    def sampled(self) -> dict[tuple[int, ...], list]:
        """Context -> the turns sampled after it (several episodes may start from one prompt)."""
        found: dict[tuple[int, ...], list] = {}
        for contexts, turns in self.calls:
            for context, turn in zip(contexts, turns):
                found.setdefault(tuple(context), []).append(turn)
        return found


# -- agents (loaded by the runner through generator.agent.fn) ---------------------------------------------------
def tool_agent(client, example) -> float:
    """Runs the tools the model calls (calc: the expression's value) until it answers; 1.0 for the right answer.
    Every answer is kept on the example for the test to read."""
    messages = [{"role": "user", "content": example["question"]}]
    answers = example.setdefault("answers", [])
    for _ in range(4):
        answer = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, logprobs=True,
                                                max_tokens=60)
        answers.append(answer)
        message = answer.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float((message.content or "").strip() == ANSWER)
        for call in message.tool_calls:
            value = VALUES.get(json.loads(call.function.arguments).get("e"), "error")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": value})
    return 0.0


def chatty_agent(client, example) -> float:
    """Two calls with a tool message between them; the reward names the example (its ``reward`` field)."""
    messages = [{"role": "user", "content": example["question"]}]
    for _ in range(2):
        answer = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
        messages.append({"role": "tool", "content": "ok"})
    return float(example["reward"])


def silent_agent(client, example) -> float:
    """One call, then no reward until long after the episode's deadline; then the episode is gone."""
    client.completions.create(model="policy", prompt=example["question"], max_tokens=4)
    time.sleep(float(example["sleep_s"]))
    url = str(client.base_url).removesuffix("/").removesuffix("/v1") + "/reward"
    example["late_status"] = requests.post(url, json=1.0, timeout=10).status_code
    return 1.0


def raising_agent(client, example) -> float:
    raise RuntimeError("the agent broke")


async def async_agent(client, example) -> float:
    answer = await client.completions.create(model="policy", prompt=example["question"], max_tokens=3)
    return float(len(answer.choices[0].text))


def holding_agent(client, example) -> float:
    """One call; then, for an example with a ``gate`` (a threading.Event), the episode holds until the gate is set,
    each held episode releasing ``held`` (a semaphore) and noting its reward URL in ``urls`` first."""
    client.completions.create(model="policy", prompt=example["question"], max_tokens=3)
    gate = example.get("gate")
    if gate is not None:
        example["urls"].append(str(client.base_url).removesuffix("/").removesuffix("/v1") + "/reward")
        example["held"].release()
        gate.wait(60)
    return float(example["reward"])
