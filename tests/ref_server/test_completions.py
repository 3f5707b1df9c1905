"""OpenAI-style /v1/completions, the tokenizer endpoints and /v1/models against a live server with the tiny model."""

import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoTokenizer

from shared.protocol.logprob_messages import encode_logprob_request
from shared.protocol.wire import encode

pytestmark = pytest.mark.slow  # every test uses the live shared_server (autouse _no_nagle)


@pytest.fixture(scope="module", autouse=True)
def _no_nagle(shared_server):
    """Answers come in two writes (headers, body); on a listening socket made with proto 0 asyncio does not set
    TCP_NODELAY on accepted connections, so each keep-alive request would wait ~40 ms for a delayed ACK (lm-eval's
    remote tokenizer makes hundreds). `grpo ref-server` binds by host/port and is not affected."""
    shared_server.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def full_log_softmax(model, ids: list[int]) -> torch.Tensor:
    """[T, V] next-token logprobs of every position (the naive way, for checking)."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)


def complete(server, **body):
    response = server.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_echo_scores_every_prompt_token_with_top_logprobs(shared_server, tiny_model, tokenizer):
    prompts = [tokenizer("hello there").input_ids, tokenizer("2 + 3 = 5").input_ids]
    out = complete(shared_server, model="tiny", prompt=prompts, echo=True, logprobs=3, max_tokens=1, temperature=0,
                   seed=1234)
    assert out["object"] == "text_completion" and out["model"] == "tiny"
    assert out["usage"] == {"prompt_tokens": 20, "completion_tokens": 2, "total_tokens": 22}
    for choice, ids in zip(sorted(out["choices"], key=lambda c: c["index"]), prompts):
        lp = choice["logprobs"]
        full = full_log_softmax(tiny_model, ids)
        generated = int(full[-1].argmax())
        all_ids = ids + [generated]
        assert len(lp["tokens"]) == len(all_ids) and lp["tokens"] == [tokenizer.decode([t]) for t in all_ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = full[torch.arange(len(all_ids) - 1), torch.tensor(all_ids[1:])]
        torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:]), want, atol=1e-5, rtol=0)
        for j in range(1, len(all_ids)):
            top = lp["top_logprobs"][j]
            values, indices = full[j - 1].topk(3)
            expected = {tokenizer.decode([int(t)]): float(v) for t, v in zip(indices, values)}
            expected.setdefault(lp["tokens"][j], lp["token_logprobs"][j])  # the chosen token is always there
            assert top.keys() == expected.keys()
            assert all(abs(top[key] - expected[key]) < 1e-5 for key in top)
        # the generated (greedy) token's logprob is exactly the best of its top_logprobs, as lm-eval checks
        assert lp["token_logprobs"][-1] == max(lp["top_logprobs"][-1].values())
        assert choice["text"] == tokenizer.decode(all_ids) and choice["finish_reason"] == "length"
        assert lp["text_offset"] == [len(tokenizer.decode(all_ids[:j])) for j in range(len(all_ids))]


def test_echo_agrees_with_v1_logprobs_and_text_prompts_with_token_ids(shared_server, tokenizer):
    texts = ["the cat sat", "a", "1 + 1 = 2"]
    ids = [tokenizer(t).input_ids for t in texts]
    by_text = complete(shared_server, prompt=texts, echo=True, logprobs=0, max_tokens=0)
    by_ids = complete(shared_server, prompt=ids, echo=True, logprobs=0, max_tokens=0)
    reference = shared_server.post("/v1/logprobs", json={"input_ids": ids, "prompt_lengths": [1] * 3}).json()
    for a, b, want, text in zip(by_text["choices"], by_ids["choices"], reference["logprobs"], texts):
        assert a["logprobs"] == b["logprobs"] and a["text"] == b["text"] == text
        torch.testing.assert_close(torch.tensor(a["logprobs"]["token_logprobs"][1:]), torch.tensor(want),
                                   atol=1e-5, rtol=0)
        # logprobs=0: only the chosen token in each top_logprobs entry
        assert all(len(entry) == 1 for entry in a["logprobs"]["top_logprobs"][1:])
    assert by_text["usage"]["completion_tokens"] == 0


def test_greedy_generation_with_max_tokens(shared_server, tiny_model, tokenizer):
    ids = tokenizer("abc").input_ids
    out = complete(shared_server, prompt=ids, max_tokens=4, temperature=0, logprobs=1)
    expected = list(ids)
    for _ in range(4):
        expected.append(int(full_log_softmax(tiny_model, expected)[-1].argmax()))
    choice = out["choices"][0]
    assert choice["text"] == tokenizer.decode(expected[3:]) and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["tokens"] == [tokenizer.decode([t]) for t in expected[3:]] and lp["text_offset"] == [0, 1, 2, 3]
    full = full_log_softmax(tiny_model, expected)
    want = full[torch.arange(2, 6), torch.tensor(expected[3:])]
    torch.testing.assert_close(torch.tensor(lp["token_logprobs"]), want, atol=1e-5, rtol=0)
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    # without logprobs: text only; a stop string cuts the text (and ends generation)
    plain = complete(shared_server, prompt="abc", max_tokens=4, temperature=0)["choices"][0]
    assert plain["logprobs"] is None and plain["text"] == choice["text"]
    stop = choice["text"][2]
    cut = complete(shared_server, prompt="abc", max_tokens=4, temperature=0, stop=[stop], logprobs=0)["choices"][0]
    assert cut["text"] == choice["text"][:choice["text"].index(stop)] and cut["finish_reason"] == "stop"
    assert "".join(cut["logprobs"]["tokens"]).startswith(cut["text"])


def test_concurrent_requests_are_micro_batched_and_answered_right(shared_server, tokenizer):
    prompts = [tokenizer(f"row {i} of many").input_ids for i in range(12)]
    single = [complete(shared_server, prompt=p, echo=True, logprobs=2, max_tokens=1, temperature=0)["choices"][0]
              for p in prompts[:3]]
    before = shared_server.state.scorer.forward_batches
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda p: complete(shared_server, prompt=p, echo=True, logprobs=2, max_tokens=1,
                                                   temperature=0), prompts))
    for got, want in zip(answers, single):
        got = got["choices"][0]["logprobs"]["token_logprobs"]
        assert all(abs(a - b) < 1e-5 for a, b in zip(got[1:], want["logprobs"]["token_logprobs"][1:]))
    assert shared_server.state.scorer.forward_batches - before <= len(prompts)


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [[]]}, 400, "prompt"),
    ({"prompt": [1, "a"]}, 400, "prompt"),
    ({"prompt": [[1, 2], [5, 100000]]}, 400, "prompt"),
    ({"prompt": [-1]}, 400, "prompt"),
    ({"prompt": [[1, 10**30]]}, 400, "prompt"),
    ({"prompt": "x" * 250, "max_tokens": 10}, 400, "prompt"),
    ({"prompt": [[1] * 200] * 30, "max_tokens": 0}, 413, "prompt"),
    ({"prompt": "hi", "temperature": 0.7}, 400, "temperature"),
    ({"prompt": "hi", "temperature": 0.7, "max_tokens": None}, 400, "temperature"),  # null is 16 tokens
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "hi", "max_tokens": 65}, 400, "max_tokens"),
    ({"prompt": "hi", "n": 2}, 400, "n"),
    ({"prompt": "hi", "stream": True}, 400, "stream"),
    ({"prompt": "hi", "stop": ["a", ""]}, 400, "stop"),
    ({"prompt": "hi", "logit_bias": {"5": 1.0}}, 400, "logit_bias"),
    ({}, 400, "prompt"),
])
def test_bad_requests_get_openai_errors(shared_server, body, status, param):
    response = shared_server.post("/v1/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_malformed_and_oversized_bodies(shared_server):
    response = shared_server.post("/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and "error" in response.json()
    response = shared_server.post("/v1/completions", data=b'{"prompt": "hi", "temperature": NaN, "max_tokens": 0}')
    assert response.status_code == 400 and response.json()["error"]["param"] == "temperature"
    response = shared_server.post("/v1/completions", data=b"x" * 300_000)
    assert response.status_code == 413 and response.json()["error"]["type"] == "invalid_request_error"
    assert shared_server.get("/healthz").status_code == 200


def test_tokenizer_endpoints(shared_server, tokenizer):
    info = shared_server.get("/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.eos_token and info["model_max_length"] == 256
    out = shared_server.post("/tokenize", json={"prompt": "2 + 2 = 4", "add_special_tokens": False}).json()
    assert out["tokens"] == tokenizer("2 + 2 = 4", add_special_tokens=False).input_ids and out["count"] == 9
    assert shared_server.post("/detokenize", json={"tokens": out["tokens"]}).json() == {"prompt": "2 + 2 = 4"}
    bad = shared_server.post("/detokenize", json={"tokens": [1, 10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert shared_server.post("/tokenize", json={"prompt": 5}).status_code == 400
    models = shared_server.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["max_model_len"] == 256


def test_lm_eval_discovers_the_remote_tokenizer(shared_server):
    utils = pytest.importorskip("lm_eval.utils")
    assert utils.check_remote_tokenizer_support(shared_server.url + "/v1/completions")


def test_no_model_means_503_and_auth_is_required(server_factory, tmp_path):
    no_model = server_factory(model=False, path=tmp_path / "a")
    for response in (no_model.post("/v1/completions", json={"prompt": "hi"}), no_model.get("/tokenizer_info"),
                     no_model.post("/tokenize", json={"prompt": "hi"})):
        assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"
    assert no_model.get("/v1/models").json()["data"] == []
    secured = server_factory(path=tmp_path / "b", token="s3cret")
    assert secured.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0}).status_code == 401
    ok = secured.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "temperature": 0},
                      headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1
    metrics = secured.get("/metrics", headers={"Authorization": "Bearer s3cret"}).text
    assert 'grpo_ref_requests_total{endpoint="/v1/completions",status="200"} 1.0' in metrics



def test_binary_logprobs_checks_stay_row_by_row(shared_server):
    """/v1/logprobs validates a binary request with tensor operations but names the first bad row as before."""
    octet = {"Content-Type": "application/octet-stream"}
    body = encode_logprob_request([[1, 2, 3], [4, 500, 6], [7, 8]], [1, 1, 5], 1.0)
    response = shared_server.post("/v1/logprobs", data=body, headers=octet)
    assert response.status_code == 422 and "row 1, position 1: token id 500" in response.json()["detail"]
    body = encode_logprob_request([[1, 2, 3], [4, 5, 6], [7, 8]], [1, 0, 1], 1.0)
    assert "row 1: prompt_length 0" in shared_server.post("/v1/logprobs", data=body, headers=octet).json()["detail"]
    as_int32 = encode("logprob_request/v1", {"input_ids": torch.tensor([1, 2, 3], dtype=torch.int32),
                                             "row_lengths": torch.tensor([3]), "prompt_lengths": torch.tensor([1])},
                      {"temperature": 1.0})
    assert shared_server.post("/v1/logprobs", data=as_int32, headers=octet).status_code == 200
    as_float = encode("logprob_request/v1", {"input_ids": torch.tensor([1.0, 2.0]), "row_lengths": torch.tensor([2]),
                                             "prompt_lengths": torch.tensor([1])}, {"temperature": 1.0})
    response = shared_server.post("/v1/logprobs", data=as_float, headers=octet)
    assert response.status_code == 400 and "integer" in response.json()["detail"]
    huge = shared_server.post("/v1/logprobs", json={"input_ids": [[1, 10**30]], "prompt_lengths": [1]})
    assert huge.status_code == 422 and "row 0, position 1" in huge.json()["detail"]


def test_scorer_keeps_plain_and_top_k_requests_apart(tiny_model):
    """Plain (/v1/logprobs) and top-k (/v1/completions) requests share the scorer but never a micro-batch; each
    gets its own kind of result, in order, through the results thread."""
    from ref_server.scoring.scorer import ReferenceScorer, Row, TopRow

    scorer = ReferenceScorer(tiny_model, vocab_size=86, max_context=256, batch_tokens=64)
    try:
        rows = [Row([5, 6, 7, 8, 9 + i], 2) for i in range(6)]
        futures = [scorer.submit(rows[:3]), scorer.submit(rows[3:], top_k=2), scorer.submit(rows[:1], top_k=1)]
        plain, top, single = (f.result(timeout=60) for f in futures)
    finally:
        scorer.close()
    assert all(isinstance(t, torch.Tensor) and t.shape == (3,) for t in plain)
    assert all(isinstance(t, TopRow) and t.top_ids.shape == (4, 2) for t in top)
    assert single[0].top_logprobs.shape == (4, 1)
    torch.testing.assert_close(single[0].logprobs, plain[0], atol=1e-6, rtol=0)
    for row, got in zip(rows[3:], top):
        full = full_log_softmax(tiny_model, row.input_ids)
        torch.testing.assert_close(got.logprobs, full[torch.arange(1, 4), torch.tensor(row.input_ids[2:])],
                                   atol=1e-5, rtol=0)
