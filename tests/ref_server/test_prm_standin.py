"""The PRM stand-in (ref_server/tool_api/prm.py, prm_routes.py): vLLM's /pooling numbers equal a direct forward."""

import json

import numpy as np
import pytest
import requests
import torch

from ref_server.tool_api.prm import PRMInputError, PRMLoadError, PRMScorer
from ref_server.tool_api.prm_tiny import build_tiny_prm
from tests.live_server import LiveServer, make_config

CHAT = [{"role": "system", "content": "Please reason step by step."}, {"role": "user", "content": "17+25-8=?"},
        {"role": "assistant", "content": "17+25=42<extra_0>42-8=34<extra_0>"}]


@pytest.fixture(scope="module")
def prm_dir(tmp_path_factory):
    return build_tiny_prm(tmp_path_factory.mktemp("tiny-prm"), seed=3)


@pytest.fixture(scope="module")
def scorer(prm_dir):
    return PRMScorer.load(str(prm_dir))


def close(got, want, atol=1e-6):
    np.testing.assert_allclose(np.asarray(got, dtype=float), np.asarray(want, dtype=float), atol=atol, rtol=0)


def direct(scorer, ids):
    """Softmax of the model's logits for one unpadded row, at the step tag's positions (the model card's recipe)."""
    with torch.no_grad():
        logits = scorer.model(input_ids=torch.tensor([ids])).logits[0]
    probs = logits.softmax(-1)
    return probs[torch.tensor(ids) == scorer.step_tag_id].tolist(), logits.tolist()


def test_pool_equals_direct_forward_at_the_tags(scorer):
    text = scorer.tokenizer.apply_chat_template(CHAT, tokenize=False)
    other = text.replace("42-8=34", "42-8=35")
    ids = scorer.encode_text([text, other])
    want = [direct(scorer, row)[0] for row in ids]
    got = scorer.pool(ids)
    assert [len(rows) for rows in got] == [2, 2]  # one row per <extra_0>
    for g, w in zip(got, want):
        close(g, w)
        close([sum(row) for row in g], [1.0] * len(g))
    close(got[0][0], got[1][0])  # causal: the first step does not see the change
    assert abs(got[0][1][1] - got[1][1][1]) > 1e-4
    assert scorer.encode_chat(CHAT) == ids[0]  # the chat template renders the same tokens as the text


def test_per_token_and_logits(scorer):
    ids = scorer.encode_text([scorer.tokenizer.apply_chat_template(CHAT, tokenize=False)])[0]
    per_token = PRMScorer(scorer.model, scorer.tokenizer, name="t", per_token=True)
    rows = per_token.pool([ids])[0]
    assert len(rows) == len(ids)
    tags = [row for row, t in zip(rows, ids) if t == scorer.step_tag_id]
    close(tags, direct(scorer, ids)[0])
    close(per_token.pool([ids], activation=False)[0], direct(scorer, ids)[1], atol=1e-5)


def test_request_bounds(scorer):
    small = PRMScorer(scorer.model, scorer.tokenizer, name="t", max_inputs=2, max_tokens=10)
    with pytest.raises(PRMInputError, match="3 inputs exceed the limit of 2") as err:
        small.pool([[5], [6], [7]])
    assert err.value.status == 413
    with pytest.raises(PRMInputError, match="11 tokens exceed the limit of 10") as err:
        small.pool([[5] * 6, [6] * 5])
    assert err.value.status == 413
    with pytest.raises(PRMInputError, match=r"input\[1\] is empty") as err:
        small.pool([[5], []])
    assert err.value.status == 400
    with pytest.raises(PRMInputError, match="context is 1024") as err:
        scorer.pool([[5] * 1025])
    assert err.value.status == 413


def test_step_tag_must_be_one_token(scorer, tmp_path):
    with pytest.raises(PRMLoadError, match=r"step tag '<step>' as 6 tokens"):
        PRMScorer(scorer.model, scorer.tokenizer, name="t", step_tag="<step>")
    with pytest.raises(PRMLoadError, match="has no config.json"):
        PRMScorer.load(str(tmp_path))


@pytest.mark.slow
def test_ref_server_hosts_the_pooling_endpoint(prm_dir, scorer, tmp_path):
    """ref_server.prm_model: vLLM's /pooling request and response shapes, through real uvicorn."""
    text = scorer.tokenizer.apply_chat_template(CHAT, tokenize=False)
    want = direct(scorer, scorer.encode_text([text])[0])[0]
    with LiveServer(make_config(tmp_path, prm_model=str(prm_dir), max_request_tokens=400)) as server:
        body = server.post("/pooling", json={"model": "x", "input": [text, text], "task": "token_classify",
                                             "encoding_format": "float"}).json()
        assert body["object"] == "list" and body["model"] == str(prm_dir)
        assert [item["index"] for item in body["data"]] == [0, 1]
        assert all(item["object"] == "pooling" for item in body["data"])
        close(body["data"][1]["data"], want)
        assert body["usage"]["prompt_tokens"] == 2 * len(scorer.encode_text([text])[0])
        chat = server.post("/pooling", json={"messages": CHAT}).json()
        close(chat["data"][0]["data"], want)
        single = server.post("/pooling", json={"input": text}).json()
        assert len(single["data"]) == 1
        too_long = server.post("/pooling", json={"input": [text] * 6})
        assert too_long.status_code == 413 and "exceed the limit of 400" in too_long.json()["error"]["message"]
        bad_task = server.post("/pooling", json={"input": text, "task": "embed"})
        assert bad_task.status_code == 400 and "task" in bad_task.json()["error"]["message"]
        not_json = server.post("/pooling", data=b"{", headers={"content-type": "application/json"})
        assert not_json.status_code == 400 and "not strict JSON" in not_json.json()["error"]["message"]
        for hostile, reason in [(b'{"input": NaN}', "non-finite number at .input"),
                                (b"[" * 5000, "nested more than 200 levels")]:
            refused = server.post("/pooling", data=hostile, headers={"content-type": "application/json"})
            assert refused.status_code == 400 and reason in refused.json()["error"]["message"]
        bad_ids = server.post("/pooling", json={"input": [[1, 10**6]]})
        assert bad_ids.status_code == 400 and "token ids must be in" in bad_ids.json()["error"]["message"]
        no_input = server.post("/pooling", json={"model": "x"})
        assert no_input.status_code == 400 and no_input.json()["error"]["message"].startswith("input")


@pytest.mark.slow
def test_ref_server_without_prm_has_no_pooling(tmp_path):
    with LiveServer(make_config(tmp_path)) as server:
        assert server.post("/pooling", data=json.dumps({"input": "x"})).status_code == 404


def test_unreachable_is_not_a_silent_pass():
    """The ref server's stand-in is a real endpoint; a closed port is an error (what the client tests rely on)."""
    with pytest.raises(requests.ConnectionError):
        requests.post("http://127.0.0.1:9/pooling", json={"input": "x"}, timeout=2)


@pytest.mark.slow
def test_prm_reward_through_the_ref_server_with_a_token(prm_dir, scorer, tmp_path):
    """The generator's 'prm' reward against the ref server's stand-in, behind its bearer token."""
    from generator.rewards.prm import PRMError, prm_reward

    system, problem, completion = "sys", "17+25-8=?", "17+25=42\n\n42-8=34\n\n"
    chat = [{"role": "system", "content": system}, {"role": "user", "content": problem},
            {"role": "assistant", "content": "17+25=42<extra_0>42-8=34<extra_0>"}]
    want = [row[1] for row in direct(scorer, scorer.encode_chat(chat))[0]]
    with LiveServer(make_config(tmp_path, prm_model=str(prm_dir), token="s3cret")) as server:
        (result,) = prm_reward(url=server.url, token="s3cret", system_prompt=system, retries=0)(problem, [completion], {})
        close(result.rewards, want)
        assert result.char_ends(completion) == [8, 17]  # "17+25=42" | "\n\n" | "42-8=34"
        with pytest.raises(PRMError, match="refused the request: HTTP 401"):
            prm_reward(url=server.url, system_prompt=system, retries=3)(problem, [completion], {})


def test_tiny_prm_tokenizer_keeps_whitespace_next_to_tags(scorer):
    """The saved tokenizer (what the stand-in and vLLM load) splits like the built one: no whitespace is eaten
    next to <extra_0> or the chat tokens, so a step ending in a newline keeps it."""
    from ref_server.tool_api.prm_tiny import build_tiny_prm_tokenizer

    built = build_tiny_prm_tokenizer()
    for text in ["<|im_start|>sys\n<extra_0>ab", "a\n\n<extra_0>\n<|im_end|>\n x <extra_0> "]:
        ids = scorer.tokenizer.encode(text)
        assert ids == built.encode(text)
        assert scorer.tokenizer.decode(ids) == text
    assert scorer.tokenizer.encode("a\n<extra_0>") == [scorer.tokenizer.convert_tokens_to_ids(c) for c in "a\n"] + [2]
