"""The agent endpoint under hostile requests, by property: any JSON (deep, NaN/Infinity literals, huge numbers,
wrong types in OpenAI's field names) or non-JSON bytes posted to any route gets a 2xx or a 4xx in OpenAI's error
shape, never a 5xx, and the endpoint keeps answering."""

from __future__ import annotations

import json
import threading

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from generator.agent.runner import AgentRollouts
from generator.engines.hf import TransformersEngine
from shared.config.schema.agent import AgentConfig
from shared.protocol.records import SamplingParams
from tests.generator import agent_kit

TOKEN = "fuzz"
SAMPLING = SamplingParams(temperature=1.0, max_tokens=3)
EPISODES = 6
KEYS = ["messages", "prompt", "model", "max_tokens", "max_completion_tokens", "stop", "tools", "logprobs", "n",
        "stream", "echo", "reward", "steps", "role", "content", "tool_calls", "tool_call_id", "name", "function",
        "arguments", "type", "x"]
LEAVES = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
          | st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e999", "9" * 400, "user", "assistant",
                             "tool", "system"]))
HOSTILE = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.sampled_from(KEYS), inner, max_size=5), max_leaves=16)
BARE = ("NaN", "Infinity", "-Infinity")


def as_text(value) -> str:
    """``value`` as JSON text, the sampled number literals written bare."""
    if isinstance(value, str) and (value in BARE or value[:1].isdigit() or value.startswith("-1e")):
        return value
    if isinstance(value, list):
        return "[" + ",".join(as_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{as_text(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    """An endpoint for external agents (a token, small limits) with a batch of episodes being generated."""
    from deploy.demo.tiny_model import TinyModelSpec, build_tiny_model, save_model_dir

    tokenizer = agent_kit.chat_tokenizer()
    folder = save_model_dir(build_tiny_model(tokenizer, TinyModelSpec(seed=2)), tokenizer,
                            tmp_path_factory.mktemp("agent-fuzz"))
    engine = TransformersEngine(folder)
    agent = AgentRollouts(engine, engine.tokenizer, AgentConfig(port=0, token=TOKEN, max_request_bytes=8192,
                                                                max_turns=3, max_total_tokens=64, timeout_s=300),
                          SAMPLING)
    batch = threading.Thread(target=lambda: agent.generate([{"question": "2+2", "answer": "4"}], [[0]], SAMPLING,
                                                           EPISODES))
    batch.start()
    bases = []
    for _ in range(EPISODES - 1):   # one episode left unclaimed: the claim route keeps a real answer to give
        claimed = send(agent, "POST", "/episodes?wait_s=10", b"").json()
        bases.append(claimed["base_url"].removeprefix(agent.server.url).removesuffix("/v1"))
    yield agent, bases
    for base in bases:   # whatever the fuzzing left open ends, so the batch ends
        send(agent, "POST", f"{base}/reward", b"0")
    claimed = send(agent, "POST", "/episodes?wait_s=0", b"").json()
    if claimed.get("id"):
        send(agent, "POST", f"/episodes/{claimed['id']}/reward", b"0")
    batch.join(timeout=60)
    assert not batch.is_alive(), "the batch did not end: an episode was left open"
    agent.close()


def send(agent, method: str, path: str, body: bytes) -> requests.Response:
    return requests.request(method, agent.server.url + path, data=body, timeout=60,
                            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})


@pytest.mark.slow
def test_no_request_gets_a_server_error_and_every_refusal_is_openai_shaped(endpoint):
    agent, bases = endpoint
    seen: dict[int, int] = {}

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(route=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/reward", "/v1/models", ""]),
           episode=st.integers(0, EPISODES) | st.just(-1), method=st.sampled_from(["POST", "POST", "GET", "PUT"]),
           body=HOSTILE.map(lambda v: as_text(v).encode()) | st.binary(max_size=64))
    def fuzz(route, episode, method, body):
        base = "/episodes/unknown" if episode < 0 or episode >= len(bases) else bases[episode]
        response = send(agent, method, (base + route) if route else "/episodes?wait_s=0", body)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        if not route and response.status_code == 200 and response.json().get("id"):   # claimed: closed at the end
            bases.append(response.json()["base_url"].removeprefix(agent.server.url).removesuffix("/v1"))
        assert response.status_code < 500, (method, route, body[:200], response.text[:300])
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)

    fuzz()
    assert requests.get(agent.server.url + "/healthz", timeout=10).status_code == 200
    assert any(400 <= s < 500 and s != 404 for s in seen), seen   # the fuzzer reached the handlers' checks
