"""The real ``openai`` client against a real ref server on 127.0.0.1: it parses our answers (/v1/models,
/v1/completions with logprobs) into its own types with the values the server sent, and our errors into its own
exceptions (status, code, param and message), as docs/http-api.md shows it."""

import re
from pathlib import Path

import openai
import pytest
import requests

from tests.live_server import LiveServer, make_config

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    config = make_config(tmp_path_factory.mktemp("openai"), tiny_model_dir, token=TOKEN, device="cpu",
                         dtype="float32")
    with LiveServer(config) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key=TOKEN, max_retries=0, timeout=60)
        yield live, client


@pytest.mark.slow
def test_the_client_lists_and_retrieves_the_served_model(served):
    live, client = served
    models = client.models.list()
    raw = requests.get(live.url + "/v1/models", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).json()
    assert [m.id for m in models.data] == [m["id"] for m in raw["data"]] and len(models.data) == 1
    model = client.models.retrieve(models.data[0].id)
    assert model.id == models.data[0].id and model.object == "model"


@pytest.mark.slow
def test_the_client_parses_completions_with_logprobs_as_the_server_sent_them(served):
    live, client = served
    model = client.models.list().data[0].id
    request = {"model": model, "prompt": ["12+3=", "7-5="], "max_tokens": 3, "temperature": 0, "logprobs": 2,
               "echo": True}
    completion = client.completions.create(**request)
    raw = requests.post(live.url + "/v1/completions", json=request, headers={"Authorization": f"Bearer {TOKEN}"},
                        timeout=60).json()
    assert completion.object == "text_completion" and completion.model == model
    assert [c.index for c in completion.choices] == [0, 1]
    assert completion.usage.prompt_tokens == raw["usage"]["prompt_tokens"]
    assert completion.usage.completion_tokens == raw["usage"]["completion_tokens"]
    for choice, sent in zip(completion.choices, raw["choices"]):
        assert choice.text == sent["text"] and choice.finish_reason == sent["finish_reason"]
        logprobs = choice.logprobs
        assert logprobs.tokens == sent["logprobs"]["tokens"]
        assert logprobs.token_logprobs == sent["logprobs"]["token_logprobs"]   # the same floats, parsed
        assert logprobs.top_logprobs == sent["logprobs"]["top_logprobs"]
        assert logprobs.text_offset == sent["logprobs"]["text_offset"]
        assert logprobs.token_logprobs[0] is None                             # nothing predicts the first token
        assert all(lp < 0 for lp in logprobs.token_logprobs[1:])
        prompt = request["prompt"][choice.index]
        assert choice.text.startswith(prompt)                                 # echo: the prompt, then the answer
        # greedy: each generated token is the most likely one, its logprob the best of its top-k
        generated = len(logprobs.tokens) - len(prompt)        # the tiny model's tokenizer: one token a character
        assert 1 <= generated <= 3
        for lp, top in zip(logprobs.token_logprobs[-generated:], logprobs.top_logprobs[-generated:]):
            assert lp == max(top.values()) and len(top) >= 2


@pytest.mark.slow
def test_the_client_raises_its_own_exceptions_with_our_status_code_and_message(served):
    live, client = served
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt="hi", max_tokens=2, temperature=0.5)
    assert bad.value.status_code == 400 and bad.value.param == "temperature" and bad.value.code is None
    assert bad.value.type == "invalid_request_error" and "greedily" in bad.value.message
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=model, prompt="1" * 400, max_tokens=0)
    assert too_long.value.code == "context_length_exceeded" and "context of 256" in too_long.value.message
    with pytest.raises(openai.NotFoundError) as unknown:
        client.models.retrieve("gpt-4")
    assert unknown.value.status_code == 404 and unknown.value.code == "model_not_found"
    assert "'gpt-4' does not exist" in unknown.value.message
    with pytest.raises(openai.NotFoundError) as chat:     # a route the server does not have: 404 in its shape
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    assert "Invalid URL (POST /v1/chat/completions)" in chat.value.message
    wrong_key = openai.OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as denied:
        wrong_key.models.list()
    assert denied.value.status_code == 401 and denied.value.code == "invalid_api_key"
    assert denied.value.message.endswith("missing or wrong bearer token")


@pytest.mark.slow
def test_the_http_api_pages_example_runs_as_written(served, capsys):
    """docs/http-api.md's openai block, only its URL and key pointed at this server: it prints the greedy completion
    with its logprobs, then the 400 for a sampling temperature."""
    live, _ = served
    page = (Path(__file__).resolve().parents[2] / "docs" / "http-api.md").read_text()
    start = page.index("### With the openai client")
    block = re.compile(r"```python\n(.*?)```", re.DOTALL).search(page, start).group(1)
    assert 'base_url="http://127.0.0.1:8470/v1"' in block
    block = block.replace("http://127.0.0.1:8470/v1", live.url + "/v1").replace(
        '"<ref_server.token, or any text without one>"', repr(TOKEN))
    exec(compile(block, "docs/http-api.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("12+3=") and "None" in printed[0]      # echo, the first logprob None
    assert printed[-1].startswith("400 temperature ")
