"""One call of an episode, answered and recorded: the context it conditions the model on (the recorded tokens and
what the call adds), the sampled turn, and the OpenAI-shaped answer. Runs on a worker thread of the endpoint (it
renders, tokenizes and waits for the sampler), one call of an episode at a time (:class:`EpisodeBook`)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from generator.agent.chat import ChatRenderer, Diverged, continuation_text, normalized, reply_message
from generator.agent.episodes import Episode, EpisodeBook
from generator.agent.sampler import TurnSampler
from shared.config.schema.agent import AgentConfig

MODEL_NAME = "policy"   # the one model an episode's endpoint serves (GET /v1/models)


class CallError(Exception):
    """An answer with a 4xx status in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@dataclass
class Turn:
    """A sampled turn as the answer shows it."""

    ids: list[int]
    logprobs: list[float]
    text: str
    finish: str
    prompt_tokens: int
    stop_reason: str | None   # the stop string that ended it (vLLM's field); None: EOS or its length


class CallHandler:
    """Answers the chat and text calls of the episodes in ``book`` with ``sampler``'s engine."""

    def __init__(self, book: EpisodeBook, sampler: TurnSampler, tokenizer, cfg: AgentConfig,
                 default_max_tokens: int) -> None:
        self.book, self.sampler, self.tokenizer, self.cfg = book, sampler, tokenizer, cfg
        self.default_max_tokens = default_max_tokens
        self.renderer = ChatRenderer(tokenizer)
        eos = tokenizer.eos_token_id
        self.eos_text = tokenizer.decode([eos], skip_special_tokens=False) if eos is not None else ""

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int], special: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=not special)

    # -- chat ----------------------------------------------------------------------------------------------
    def chat(self, episode: Episode, request: Any) -> dict:
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        tools = request.tools or None
        norm = [normalized(m) for m in messages]
        if episode.prompt is None:
            prompt, added = self.encode(self.renderer.render(messages, tools, True)), []
        else:
            prompt, added = None, self._chat_continuation(episode, messages, norm, tools)
        turn = self._sample(episode, prompt, added, request.max_completion_tokens or request.max_tokens,
                            _stops(request.stop))
        reply = reply_message(self.tokenizer, turn.text, tools)
        episode.conversation = [*norm, normalized(reply)]
        finish = "tool_calls" if reply.get("tool_calls") else turn.finish
        choice = {"index": 0, "message": reply, "finish_reason": finish, "stop_reason": turn.stop_reason,
                  "logprobs": {"content": self._token_logprobs(turn)} if request.logprobs else None}
        return _answer("chat.completion", "chatcmpl", choice, turn)

    def _chat_continuation(self, episode: Episode, messages: list[dict], norm: list[tuple],
                           tools: list[dict] | None) -> list[int]:
        known = episode.conversation or []
        if norm[:len(known)] != known:
            where = next((i for i, (a, b) in enumerate(zip(norm, known)) if a != b), len(norm))
            self._diverged(episode, f"message {where} differs from the episode's recorded conversation (an "
                           "episode's calls resend its earlier messages and the replies as they were answered)")
        ended_with = self.eos_text if episode.last_ended == "eos" else ""
        try:
            text, same = continuation_text(self.renderer, messages, len(known) - 1, tools,
                                           self.decode(episode.context, special=True), ended_with)
        except Diverged as exc:
            self._diverged(episode, str(exc))
        if not same:
            with self.book.lock:
                self.book.stats.template_mismatches += 1
        return self.encode(text)

    # -- text ----------------------------------------------------------------------------------------------
    def completion(self, episode: Episode, request: Any) -> dict:
        prompt = request.prompt
        if episode.prompt is None:
            ids = list(prompt) if isinstance(prompt, list) else self.encode(prompt)
            first, added = ids, []
        else:
            first, added = None, self._text_continuation(episode, prompt)
        turn = self._sample(episode, first, added, request.max_tokens, _stops(request.stop))
        episode.shown = (prompt if isinstance(prompt, str) else self.decode(list(prompt), special=True)) + turn.text
        logprobs = None
        if request.logprobs is not None:
            tokens = [self.decode([t], special=True) for t in turn.ids]
            offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
            logprobs = {"tokens": tokens, "token_logprobs": turn.logprobs, "top_logprobs": None,
                        "text_offset": offsets}
        choice = {"index": 0, "text": turn.text, "finish_reason": turn.finish, "logprobs": logprobs,
                  "stop_reason": turn.stop_reason}
        return _answer("text_completion", "cmpl", choice, turn)

    def _text_continuation(self, episode: Episode, prompt: str | list[int]) -> list[int]:
        recorded = episode.context
        if isinstance(prompt, list):
            if prompt[:len(recorded)] != recorded:
                self._diverged(episode, "prompt: the token ids do not start with the episode's recorded tokens")
            return prompt[len(recorded):]
        recorded_text = self.decode(recorded, special=True)
        if prompt.startswith(recorded_text):
            added = self.encode(prompt[len(recorded_text):])
            mismatch = self.encode(prompt) != recorded + added   # the whole text tokenizes otherwise: detected
        elif episode.shown is not None and prompt.startswith(episode.shown):
            # the client continued the text it was answered, which leaves out what the model sampled but the text
            # does not show (the stop string, special tokens): the recorded tokens stay, the rest is appended
            added, mismatch = self.encode(prompt[len(episode.shown):]), True
        else:
            self._diverged(episode, "prompt: the text does not start with the episode's recorded text (nor with "
                           "the last prompt and its answer's text)")
        if mismatch:
            with self.book.lock:
                self.book.stats.template_mismatches += 1
        return added

    # -- both ----------------------------------------------------------------------------------------------
    def _diverged(self, episode: Episode, why: str) -> None:
        self.book.fail(episode, f"call {episode.calls + 1}: {why}", "diverged")
        raise CallError(409, f"episode {episode.id} failed: {why}", param="messages", code="episode_diverged")

    def _sample(self, episode: Episode, prompt: list[int] | None, added: list[int], max_tokens: int | None,
                stops: list[str]) -> Turn:
        cfg = self.cfg
        if episode.calls >= cfg.max_turns:
            self.book.fail(episode, f"more than generator.agent.max_turns = {cfg.max_turns} calls")
            raise CallError(400, f"episode {episode.id} has made max_turns = {cfg.max_turns} calls; it failed",
                            code="max_turns_exceeded")
        room = cfg.max_total_tokens - len(episode.tokens) - len(added)
        if room < 1:
            episode.finish = "length"
            raise CallError(400, f"the episode's completion would pass generator.agent.max_total_tokens = "
                            f"{cfg.max_total_tokens} tokens", code="context_length_exceeded")
        context = (prompt if prompt is not None else episode.context) + added
        sampled = self.sampler.sample(context, min(max_tokens or self.default_max_tokens, room), stops)
        if prompt is not None:
            episode.prompt = prompt
        else:
            episode.append(added, None, model=False)
        episode.append(sampled.token_ids, sampled.logprobs, model=True, versions=sampled.versions)
        episode.calls, episode.last_ended = episode.calls + 1, sampled.ended
        if sampled.ended == "length" and len(episode.tokens) >= cfg.max_total_tokens:
            episode.finish = "length"
        with self.book.lock:
            stats = self.book.stats
            stats.turns += 1
            stats.env_calls += bool(added)
        text = self.decode(sampled.token_ids)
        stop_reason = next((s for s in stops if sampled.ended == "stop_string" and text.endswith(s)), None)
        if stop_reason is not None:   # OpenAI leaves the stop sequence out of the text
            text = text[:-len(stop_reason)]
        finish = "length" if sampled.ended == "length" else "stop"
        return Turn(sampled.token_ids, sampled.logprobs, text, finish, len(context), stop_reason)

    def _token_logprobs(self, turn: Turn) -> list[dict]:
        out = []
        for token_id, logprob in zip(turn.ids, turn.logprobs):
            token = self.decode([token_id], special=True)
            out.append({"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []})
        return out


def _stops(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def _answer(kind: str, prefix: str, choice: dict, turn: Turn) -> dict:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": MODEL_NAME,
            "choices": [choice], "usage": {"prompt_tokens": turn.prompt_tokens, "completion_tokens": len(turn.ids),
                                           "total_tokens": turn.prompt_tokens + len(turn.ids)}}
