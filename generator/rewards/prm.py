"""A process reward model over HTTP in vLLM's ``/pooling`` schema: one reward per reasoning step (issue 23, 4b).

``vllm serve Qwen/Qwen2.5-Math-PRM-7B`` serves a PRM with STEP pooling (task ``token_classify``). Its input is a
chat: system prompt, the problem, and the completion's steps each followed by the step tag (``step1<extra_0>
step2<extra_0>``); the model gives 2 class probabilities per token and the step reward is the positive class's
probability at each tag. Steps are the non-empty pieces of the completion between ``step_separator``s, counted by
exactly the rule of :meth:`generator.rewards.steps.StepScores.char_ends`, and each completion's result is a
``StepScores(rewards, separator=step_separator)``.

Request (one per group, ``chat: text``; the prompt formatted here with ``prompt_template``)::

    POST {url}/pooling {"model": "...", "input": ["<|im_start|>system\\n...step1<extra_0>step2<extra_0>..."]}
    -> {"object": "list", "model": "...", "data": [{"index": 0, "object": "pooling",
        "data": [[0.08, 0.92], [0.71, 0.29]]}], "usage": {...}}

vLLM has returned two shapes: one row per step tag (STEP pooling with ``step_tag_id`` set: vLLM 0.32.0 sets it to
151651, ``<extra_0>``, for Qwen2ForProcessRewardModel) or one row per prompt token (``step_tag_id`` unset); for
the second the rows at the tag's positions are taken, the positions found through vLLM's ``POST /tokenize``.
``chat: messages`` sends the chat as ``messages`` and the server applies the model's chat template (vLLM's pooling
chat request holds one conversation, so that is one request per completion). A malformed answer (wrong count,
shape, non-finite or out-of-range value) or a refusal (4xx) is a :class:`PRMError` naming the reason, never a
silent zero: the group is scored ``on_error`` and counted under the rule on failing rewards (generator/failures.py).
Network failures, timeouts, 5xx and 429 are retried with backoff, then raised as
:class:`~generator.rewards.base.ServiceDown` naming the URL: the PRM is down, and the generator pauses until it
answers (generator/loop.py) instead of uploading groups without step rewards.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any, Literal

import requests

from generator.failures import Failure, ServiceDown
from generator.rewards.base import REWARDS, GroupReward, RewardConfigError
from generator.rewards.steps import StepScores

log = logging.getLogger("grpo.generator.rewards.prm")

QWEN_PRM_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
# Qwen2.5's chat template rendered with add_generation_prompt=False, as Qwen2.5-Math-PRM's model card does
QWEN_CHAT_TEMPLATE = ("<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{problem}<|im_end|>\n"
                      "<|im_start|>assistant\n{response}<|im_end|>\n")
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


class PRMError(RuntimeError):
    """The PRM could not be reached or gave an answer that cannot be step rewards; the message says which."""


def step_pieces(text: str, separator: str) -> list[str]:
    """The completion's steps: its non-empty pieces between ``separator``s (StepScores.char_ends's rule)."""
    pieces, start = [], 0
    while start <= len(text):
        found = text.find(separator, start)
        stop = len(text) if found < 0 else found
        if stop > start:
            pieces.append(text[start:stop])
        if found < 0:
            break
        start = found + len(separator)
    return pieces


class PRMClient:
    """Posts to a vLLM-compatible ``/pooling`` endpoint and turns its rows into step rewards."""

    def __init__(self, url: str, model: str | None, *, step_tag: str, positive_index: int, timeout_s: float,
                 retries: int, backoff_s: float, token: str | None, task: str | None, softmax: bool) -> None:
        self.url = url.rstrip("/")
        self.model, self.step_tag, self.positive_index = model, step_tag, positive_index
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.task, self.softmax = task, softmax
        self.session = requests.Session()
        if token:
            self.session.headers["Authorization"] = f"Bearer {token}"
        self._tag_id: int | None = None

    def post(self, path: str, payload: dict[str, Any]) -> Any:
        """The JSON answer of ``POST url+path``; transient failures retried, then :class:`ServiceDown`; a refusal or
        an answer that is not JSON: a :class:`PRMError`."""
        where = self.url + path
        failure = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                response = self.session.post(where, json=payload, timeout=self.timeout_s)
            except (requests.ConnectionError, requests.Timeout) as exc:
                failure = f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code in RETRY_STATUS:
                failure = f"HTTP {response.status_code}: {response.text[:300]}"
                continue
            if response.status_code >= 400:
                raise PRMError(f"PRM at {where} refused the request: HTTP {response.status_code}: "
                               f"{response.text[:500]}")
            try:
                return response.json()
            except ValueError:
                raise PRMError(f"PRM at {where} answered non-JSON: {response.text[:200]!r}") from None
        raise ServiceDown("PRM", where, f"{self.retries + 1} attempts; the last: {failure}")

    def _with_model(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.model is not None:
            body["model"] = self.model
        if self.task is not None:
            body["task"] = self.task
        return body

    def pool(self, inputs: list[str] | list[dict]) -> list[Any]:
        """The ``data`` rows of each input, in input order (text prompts, or one chat as ``messages``)."""
        if inputs and isinstance(inputs[0], dict):
            return [self._items(self.post("/pooling", self._with_model(dict(chat))), 1)[0] for chat in inputs]
        return self._items(self.post("/pooling", self._with_model({"input": list(inputs)})), len(inputs))

    def _items(self, body: Any, count: int) -> list[Any]:
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list) or len(data) != count:
            got = f"{len(data)} items" if isinstance(data, list) else repr(body)[:200]
            raise PRMError(f"PRM at {self.url}/pooling: expected 'data' with {count} items, got {got}")
        ordered: list[Any] = [None] * count
        for position, item in enumerate(data):
            index = item.get("index", position) if isinstance(item, dict) else None
            if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count \
                    or ordered[index] is not None or "data" not in item:
                raise PRMError(f"PRM at {self.url}/pooling: data[{position}] is not an item "
                               f"{{'index': 0..{count - 1} (each once), 'data': rows}}: {repr(item)[:200]}")
            ordered[index] = item["data"]
        return ordered

    def tag_id(self) -> int:
        """The step tag's token id, asked once from the server's ``/tokenize``."""
        if self._tag_id is None:
            tokens = self.tokens({"prompt": self.step_tag, "add_special_tokens": False})
            if len(tokens) != 1:
                raise PRMError(f"PRM at {self.url}: the step tag {self.step_tag!r} is {len(tokens)} tokens "
                               f"{tokens}, not one")
            self._tag_id = tokens[0]
        return self._tag_id

    def tokens(self, payload: dict[str, Any]) -> list[int]:
        body = self.post("/tokenize", ({"model": self.model} if self.model else {}) | payload)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise PRMError(f"PRM at {self.url}/tokenize: expected {{'tokens': [ids]}}, got {repr(body)[:200]}")
        return tokens

    def step_values(self, rows: Any, steps: int, tokenize: dict[str, Any]) -> list[float]:
        """Each step's positive-class probability from one input's rows (per step tag, or per token)."""
        where = f"PRM at {self.url}/pooling"
        if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
            raise PRMError(f"{where}: expected a list of rows (one list of class values per step or per token), "
                           f"got {repr(rows)[:200]}")
        if len(rows) != steps:  # one row per token: keep the rows at the step tag's positions
            try:
                ids = self.tokens(tokenize)
            except PRMError as exc:
                raise PRMError(f"{where}: {len(rows)} rows for {steps} steps; reading them as one row per token "
                               f"needs the server's /tokenize, which failed: {exc}") from None
            if len(ids) != len(rows):
                raise PRMError(f"{where}: {len(rows)} rows for {steps} steps, and not one per token either "
                               f"({len(ids)} tokens)")
            rows = [row for row, token in zip(rows, ids) if token == self.tag_id()]
            if len(rows) != steps:
                raise PRMError(f"{where}: the prompt holds {len(rows)} step tags for {steps} steps")
        return [self.positive(row, j) for j, row in enumerate(rows)]

    def positive(self, row: list, step: int) -> float:
        where = f"PRM at {self.url}/pooling, step {step}"
        if len(row) <= self.positive_index:
            raise PRMError(f"{where}: row {row!r} has no class {self.positive_index}")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in row):
            raise PRMError(f"{where}: row {repr(row)[:200]} holds a non-number or non-finite value")
        if self.softmax:
            top = max(row)
            exps = [math.exp(v - top) for v in row]
            return exps[self.positive_index] / sum(exps)
        value = float(row[self.positive_index])
        if not 0.0 <= value <= 1.0:
            raise PRMError(f"{where}: {value} is not a probability (logits? set softmax: true)")
        return value


@REWARDS.register("prm")
def prm_reward(url: str, model: str | None = None, step_separator: str = "\n\n", step_tag: str = "<extra_0>",
               system_prompt: str = QWEN_PRM_SYSTEM, chat: Literal["text", "messages"] = "text",
               prompt_template: str = QWEN_CHAT_TEMPLATE, timeout_s: float = 60.0, retries: int = 3,
               backoff_s: float = 1.0, token: str | None = None, positive_index: int = 1,
               max_steps: int = 64, task: str | None = None, softmax: bool = False) -> GroupReward:
    """Step rewards from a process reward model behind vLLM's ``/pooling`` (docs/process-rewards.md).

    ``chat: text`` formats each completion with ``prompt_template`` ({system}, {problem}, {response}) and scores
    the group in one request; ``chat: messages`` lets the server apply its chat template (one request per
    completion). A completion with more than ``max_steps`` steps is not sent and scores NaN (the reward's
    ``on_error``, counted). ``task`` (e.g. ``token_classify``) is sent only when set; ``softmax: true`` is for a
    server that answers logits.
    """
    if not step_separator:
        raise RewardConfigError("prm reward: step_separator must not be empty")
    if chat not in ("text", "messages"):
        raise RewardConfigError(f"prm reward: chat must be 'text' or 'messages', got {chat!r}")
    if positive_index < 0 or max_steps < 1 or retries < 0 or timeout_s <= 0 or backoff_s < 0:
        raise RewardConfigError("prm reward: positive_index >= 0, max_steps >= 1, retries >= 0, timeout_s > 0 "
                                "and backoff_s >= 0 are required")
    client = PRMClient(url, model, step_tag=step_tag, positive_index=positive_index, timeout_s=timeout_s,
                       retries=retries, backoff_s=backoff_s, token=token, task=task, softmax=softmax)

    def render(problem: str, steps: list[str]) -> tuple[Any, dict[str, Any]]:
        response = "".join(step + step_tag for step in steps)
        if chat == "messages":
            messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": problem},
                        {"role": "assistant", "content": response}]
            # stated in both requests: vLLM's /tokenize adds the generation prompt by default, /pooling does not
            chat_request = {"messages": messages, "add_generation_prompt": False, "add_special_tokens": False}
            return chat_request, chat_request
        text = prompt_template.format(system=system_prompt, problem=problem, response=response)
        return text, {"prompt": text, "add_special_tokens": True}

    def group(prompt: str, completions: Sequence[str], example: dict[str, Any]) -> list[StepScores | float]:
        steps = [step_pieces(c, step_separator) for c in completions]
        results: list[StepScores | float] = [StepScores((), separator=step_separator) for _ in completions]
        group.failures = [None] * len(completions)   # what the reward set reports for a NaN here
        sent = [i for i, s in enumerate(steps) if 0 < len(s) <= max_steps]
        for i, s in enumerate(steps):
            if len(s) > max_steps:
                log.warning("prm: completion %d has %d steps (max_steps %d); scored on_error", i, len(s), max_steps)
                results[i] = math.nan
                group.failures[i] = Failure(f"a completion of {len(s)} steps, more than the prm reward's "
                                            f"max_steps = {max_steps}, was not sent")
        if not sent:
            return results
        rendered = [render(prompt, steps[i]) for i in sent]
        all_rows = client.pool([inputs for inputs, _ in rendered])
        for i, rows, (_, tokenize) in zip(sent, all_rows, rendered):
            results[i] = StepScores(client.step_values(rows, len(steps[i]), tokenize), separator=step_separator)
        return results

    group.__name__ = "prm"
    group.failures = []
    return group
