"""The agent endpoint's threads (uvicorn on 127.0.0.1, the tiny untrained chat model): a call holds a thread until
its turn is sampled and a claim until an episode is free, so neither may be capped by a pool the other fills:
64 episodes' calls all wait on the engine at once (anyio's shared pool of 40 threads capped them at 40), and
waiting claims do not stall the calls of episodes already claimed."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from generator.agent.runner import AgentRollouts
from generator.engines.hf import TransformersEngine
from shared.config.schema.agent import AgentConfig
from shared.protocol.records import SamplingParams
from tests.generator import agent_kit

SAMPLING = SamplingParams(temperature=1.0, max_tokens=3)
TOKEN = "s3cret"
EPISODES = 64        # 16 prompts x G 4, more than anyio's default 40 threads


@pytest.fixture(scope="module")
def untrained_dir(tmp_path_factory):
    from deploy.demo.tiny_model import TinyModelSpec, build_tiny_model, save_model_dir

    tokenizer = agent_kit.chat_tokenizer()
    return str(save_model_dir(build_tiny_model(tokenizer, TinyModelSpec(seed=1)), tokenizer,
                              tmp_path_factory.mktemp("agent-threads")))


class InCall:
    """Wraps a handler's answer function: how many calls are inside it at once (the peak)."""

    def __init__(self, answer) -> None:
        self.answer, self.now, self.peak, self.lock = answer, 0, 0, threading.Lock()

    def __call__(self, episode, call):
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        try:
            return self.answer(episode, call)
        finally:
            with self.lock:
                self.now -= 1


class HeldFirstCall:
    """The real engine, whose first call waits (up to 20 s) until ``ready()``: the calls that come meanwhile queue."""

    def __init__(self, engine, ready) -> None:
        self.engine, self.name, self.tokenizer, self.ready, self.first = engine, engine.name, engine.tokenizer, ready, True

    def generate_turns(self, contexts, sampling, n, stops, seed=None):
        deadline = time.monotonic() + 20
        while self.first and not self.ready() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.first = False
        return self.engine.generate_turns(contexts, sampling, n, stops, seed=seed)


@pytest.mark.slow
def test_every_open_episodes_call_waits_on_the_engine_at_once(untrained_dir):
    inside: list[InCall] = []
    engine = HeldFirstCall(TransformersEngine(untrained_dir), lambda: bool(inside) and inside[0].peak >= EPISODES)
    agent = AgentRollouts(engine, engine.tokenizer, AgentConfig(fn="tests.generator.agent_kit:holding_agent",
                                                                port=0), SAMPLING, seed=3)
    inside.append(InCall(agent.handler.completion))
    agent.handler.completion = inside[0]     # the routes look the answer function up per request
    try:
        examples = [{"question": f"{i}+{i}", "reward": i / 16} for i in range(EPISODES // 4)]
        _, groups = agent.generate(examples, [[0]] * len(examples), SAMPLING, 4)
    finally:
        agent.close()
    assert inside[0].peak == EPISODES
    assert [[c.env_reward for c in group] for group in groups] == [[e["reward"]] * 4 for e in examples]
    assert agent.stats.env_errors == 0 and sum(agent.sampler.batches) == EPISODES


@pytest.mark.slow
def test_claims_waiting_for_episodes_do_not_stall_a_claimed_episodes_calls(untrained_dir):
    engine = TransformersEngine(untrained_dir)
    agent = AgentRollouts(engine, engine.tokenizer, AgentConfig(port=0, token=TOKEN, timeout_s=120), SAMPLING,
                          seed=3)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    result: dict = {}
    batch = threading.Thread(target=lambda: result.update(groups=agent.generate(
        [{"question": "2+2"}], [[0]], SAMPLING, 1)[1]))
    batch.start()
    waiting: list[threading.Thread] = []
    try:
        episode = requests.post(f"{agent.server.url}/episodes?wait_s=30", headers=headers, timeout=60).json()
        assert episode["id"] is not None
        # 50 idle agents ask for work there is none of, each waiting up to 8 s
        claims: list[int] = []
        for _ in range(50):
            waiting.append(threading.Thread(target=lambda: claims.append(requests.post(
                f"{agent.server.url}/episodes?wait_s=8", headers=headers, timeout=60).status_code)))
            waiting[-1].start()
        time.sleep(1.0)
        started = time.monotonic()
        answer = requests.post(episode["base_url"] + "/chat/completions", headers=headers, timeout=6,
                               json={"model": "policy", "messages": [{"role": "user", "content": "hi"}]})
        assert answer.status_code == 200, answer.text
        assert time.monotonic() - started < 5       # not behind the claims' 8 s
        posted = requests.post(episode["base_url"].removesuffix("/v1") + "/reward", headers=headers, json=1.0,
                               timeout=30)
        assert posted.status_code == 200, posted.text
        batch.join(timeout=60)
        for thread in waiting:
            thread.join(timeout=30)
        assert claims == [200] * 50          # each answered, with no episode, when its wait ended
    finally:
        agent.close()
    assert [[c.env_reward for c in group] for group in result["groups"]] == [[1.0]]
