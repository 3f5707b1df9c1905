"""The text the model continues: a string prompt (:func:`render_prompt`) or TRL's conversational one
(:func:`render_messages`), chosen per example by :func:`render_example`."""

from __future__ import annotations

from generator.datasets.base import DatasetError, Example
from shared.errors import UsageError

# DeepSeek-R1-Zero style system prompt (DeepSeek-R1, Guo et al. 2025; as in simple_GRPO), the default for math datasets.
R1_SYSTEM_PROMPT = (
    "You are a helpful assistant. A conversation between User and Assistant. The user asks a question, and the "
    "Assistant solves it. The Assistant first thinks about the reasoning process in the mind and then provides "
    "the user with the answer. The reasoning process and answer are enclosed within <think> </think> and "
    "<answer> </answer> tags, respectively, i.e., <think> reasoning process here </think><answer> answer here "
    "</answer>."
)
# reasoning-gym's own default system prompt (reasoning_gym.utils.SYSTEM_PROMPTS["default"]): the answer between
# <answer> tags, where the reward reads it; the default of generator.dataset.system_prompt for
# dataset.kind reasoning_gym
REASONING_GYM_SYSTEM_PROMPT = (
    "Given a problem, your task is to answer the question by thinking step-by-step in a clear and specific manner.\n"
    "Once you have thought about the reasoning process, provide the answer in the following format:\n"
    "<answer>answer here</answer>\n"
    "Do not explain your reasoning inside the answer tags, provide only the final answer. When an example is "
    "provided, you should strictly follow the format of the output/answer in that example.\n"
)


def render_prompt(tokenizer, question: str, system_prompt: str | None, template: str | None = None,
                  tools: list[dict] | None = None) -> str:
    """The text the model continues.

    * ``template`` given: ``template.format(question=..., system=...)`` (no chat template is applied);
    * else, a tokenizer with a chat template: system + user messages, with the generation prompt (and ``tools``,
      the JSON schemas of a tool-calling environment: generator/environments/tool_chat.py);
    * else: the question itself (after the system prompt and a newline, if there is one).
    """
    if tools:
        if template is not None or not getattr(tokenizer, "chat_template", None):
            raise UsageError("generator.environment: tool calling renders the prompt with the tokenizer's chat "
                             "template; set generator.dataset.template to null and use a chat model")
        from generator.environments.tool_chat import render_tool_prompt

        return render_tool_prompt(tokenizer, question, system_prompt, tools)
    if template is not None:
        return template.format(question=question, system=system_prompt or "")
    if getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
        messages.append({"role": "user", "content": question})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"{system_prompt}\n{question}" if system_prompt else question


def render_messages(tokenizer, example: Example, system_prompt: str | None) -> str:
    """TRL's conversational prompt: ``example.prompt_messages`` through the tokenizer's chat template, with the
    generation prompt. A system message in the data wins: ``system_prompt`` (generator.dataset.system_prompt, or its
    default) is put first only when the messages have none. A tokenizer without a chat template is refused (no plain
    rendering is guessed)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DatasetError(f"{example.example_id}: a conversational prompt (a list of messages) is rendered with the "
                           "tokenizer's chat template, and this model's tokenizer has none: use a chat model or give "
                           "the prompt as a string")
    messages = list(example.prompt_messages or [])
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def render_example(tokenizer, example: Example, system_prompt: str | None, template: str | None = None,
                   tools: list[dict] | None = None) -> str:
    """:func:`render_prompt` of the example's question, or for a conversational example :func:`render_messages`
    (which takes neither ``template`` nor the tools of a tool-calling environment)."""
    if example.prompt_messages is None:
        return render_prompt(tokenizer, example.question, system_prompt, template, tools)
    if template is not None or tools:
        raise UsageError(f"{example.example_id}: a conversational prompt is rendered with the chat template alone; "
                         "generator.dataset.template and a tool-calling generator.environment apply to string "
                         "prompts only")
    return render_messages(tokenizer, example, system_prompt)
