"""The agent endpoint over HTTP (uvicorn on 127.0.0.1, the tiny untrained chat model): an external agent claims
episodes and drives them with plain requests, and every bad request gets a 4xx in OpenAI's error shape that the
openai client reads."""

from __future__ import annotations

import threading

import openai
import pytest
import requests

from generator.agent.runner import AgentRollouts
from generator.engines.hf import TransformersEngine
from shared.config.schema.agent import AgentConfig
from shared.protocol.records import SamplingParams
from tests.generator import agent_kit

TOKEN = "s3cret"
SAMPLING = SamplingParams(temperature=1.0, max_tokens=5)


@pytest.fixture(scope="module")
def external(tmp_path_factory):
    """An endpoint without an agent function (external agents claim its episodes), with a token and small limits,
    and a batch of 3 episodes being generated on a thread."""
    from deploy.demo.tiny_model import TinyModelSpec, build_tiny_model, save_model_dir

    tokenizer = agent_kit.chat_tokenizer()
    folder = save_model_dir(build_tiny_model(tokenizer, TinyModelSpec(seed=1)), tokenizer,
                            tmp_path_factory.mktemp("agent-http"))
    engine = TransformersEngine(folder)
    agent = AgentRollouts(engine, engine.tokenizer, AgentConfig(port=0, token=TOKEN, max_request_bytes=4096,
                                                                max_turns=2, timeout_s=120), SAMPLING)
    result: dict = {}
    batch = threading.Thread(target=lambda: result.update(groups=agent.generate(
        [{"question": "2+2", "answer": "4"}], [[0]], SAMPLING, 3)[1]))
    batch.start()
    yield agent, result
    for _ in range(3):   # close whatever the tests left open, so the batch ends
        claimed = post(agent, "/episodes?wait_s=0").json()
        if claimed["id"]:
            post(agent, f"/episodes/{claimed['id']}/reward", json=0.0)
    batch.join(timeout=60)
    agent.close()


def post(agent, path: str, token: str | None = TOKEN, **kwargs) -> requests.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.post(agent.server.url + path, headers=headers, timeout=30, **kwargs)


def assert_openai_error(response: requests.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
    for word in words:
        assert word in error["message"], error["message"]
    return error


@pytest.mark.slow
def test_an_external_agent_claims_an_episode_and_drives_it_with_plain_requests(external):
    agent, _ = external
    claimed = post(agent, "/episodes?wait_s=5").json()
    assert claimed["example"] == {"question": "2+2", "answer": "4"}
    assert claimed["base_url"].endswith(f"/episodes/{claimed['id']}/v1")
    base = claimed["base_url"].removeprefix(agent.server.url)
    text = post(agent, f"{base}/completions", json={"prompt": "2+2=", "max_tokens": 3, "logprobs": 0}).json()
    choice = text["choices"][0]
    assert text["object"] == "text_completion" and len(choice["logprobs"]["token_logprobs"]) == \
        text["usage"]["completion_tokens"] <= 3
    assert all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"])
    # the next call resends the text so far: the recorded tokens are its prefix
    again = post(agent, f"{base}/completions", json={"prompt": "2+2=" + choice["text"] + " so", "max_tokens": 2})
    assert again.status_code == 200, again.text
    assert post(agent, f"/episodes/{claimed['id']}/reward", json={"steps": [0.25, 0.5]}).json() == {
        "id": claimed["id"], "reward": 0.75, "closed": True}
    assert_openai_error(post(agent, f"{base}/completions", json={"prompt": "x"}), 404, "closed by its reward")


@pytest.mark.slow
def test_bad_requests_get_openai_shaped_4xx_and_the_openai_client_reads_them(external):
    agent, _ = external
    base = post(agent, "/episodes?wait_s=5").json()["base_url"].removeprefix(agent.server.url)
    chat = f"{base}/chat/completions"
    assert assert_openai_error(post(agent, chat, token=None, json={}), 401, "token")["code"] == "invalid_api_key"
    assert_openai_error(post(agent, chat, data=b"{not json"), 400, "body")
    assert_openai_error(post(agent, chat, json={"messages": []}), 400, "messages")
    assert_openai_error(post(agent, chat, json={"messages": [{"role": "robot", "content": "x"}]}), 400, "role")
    assert_openai_error(post(agent, chat, json={"messages": [{"role": "user", "content": "x"}], "n": 2}), 400, "n")
    assert_openai_error(post(agent, chat, json={"messages": [{"role": "user", "content": "x"}], "stream": True}),
                        400, "stream")
    assert_openai_error(post(agent, chat, json={"messages": [{"role": "user", "content": "x" * 5000}]}), 413)
    assert_openai_error(post(agent, "/episodes/nope/v1/chat/completions",
                             json={"messages": [{"role": "user", "content": "x"}]}), 404, "nope")
    assert_openai_error(post(agent, "/v1/chat/completions", json={}), 404, "/episodes/{id}/v1/chat/completions")
    assert_openai_error(post(agent, f"{base.removesuffix('/v1')}/reward", json={"reward": 1, "steps": [1]}), 400)
    assert_openai_error(post(agent, f"{base.removesuffix('/v1')}/reward", json={"steps": [1.0]}), 400, "steps")
    client = openai.OpenAI(base_url=agent.server.url + base, api_key=TOKEN, max_retries=0)
    first = [{"role": "user", "content": "hi"}]
    answer = client.chat.completions.create(model="policy", messages=first)
    with pytest.raises(openai.ConflictError, match="message 0 differs"):   # a history that is not the episode's
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "bye"}])
    assert agent.stats.diverged == 1 and answer.choices[0].message.role == "assistant"
    with pytest.raises(openai.NotFoundError, match="failed"):   # the diverged episode is over
        client.chat.completions.create(model="policy", messages=first)
