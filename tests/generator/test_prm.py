"""The 'prm' reward (generator/rewards/prm.py): a process reward model over vLLM's /pooling, against the real
stand-in (ref_server/tool_api/prm_routes.py) and tiny local servers that misbehave, all on 127.0.0.1."""

import json
import math
import socket

import numpy as np
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from generator.rewards import RewardSet, RewardTerm, ServiceDown
from generator.rewards.prm import PRMError, prm_reward, step_pieces
from generator.rewards.steps import StepScores
from ref_server.tool_api.prm import PRMScorer
from ref_server.tool_api.prm_routes import create_prm_app
from ref_server.tool_api.prm_tiny import build_tiny_prm
from tests.live_server import AppServer

PROBLEM = "17+25-8=?"
SYSTEM = "Please reason step by step."
GROUP = ["17+25=42\n\n42-8=34", "17+25=41\n\n41-8=33\n\n", "", "\n\nanswer 34"]


@pytest.fixture(scope="module")
def scorer(tmp_path_factory):
    return PRMScorer.load(str(build_tiny_prm(tmp_path_factory.mktemp("tiny-prm"), seed=5)))


def expected(scorer, completion):
    """The model card's recipe by hand: chat template, steps joined with <extra_0>, softmax class 1 at each tag."""
    steps = step_pieces(completion, "\n\n")
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROBLEM},
            {"role": "assistant", "content": "".join(s + "<extra_0>" for s in steps)}]
    ids = scorer.tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=False)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    with torch.no_grad():
        probs = scorer.model(input_ids=torch.tensor([ids])).logits[0].softmax(-1)
    return probs[torch.tensor(ids) == scorer.step_tag_id, 1].tolist()


# ---- the step count rule: the same as StepScores.char_ends --------------------------------------------------

@pytest.mark.parametrize("text, pieces", [
    ("a\n\nb", ["a", "b"]), ("\n\na\n\n", ["a"]), ("a\n\n\n\nb", ["a", "b"]), ("", []), ("\n\n\n\n", []),
    ("a\n\n\nb", ["a", "\nb"]), ("\n", ["\n"]), ("a", ["a"]),
])
def test_step_pieces_edge_cases(text, pieces):
    assert step_pieces(text, "\n\n") == pieces
    assert len(StepScores([0.5] * len(pieces), separator="\n\n").char_ends(text)) == len(pieces)


@given(st.text(alphabet="ab\n ", max_size=40), st.sampled_from(["\n\n", "\n", "ab"]))
def test_step_pieces_match_char_ends(text, separator):
    pieces = step_pieces(text, separator)
    ends = StepScores([0.0] * len(pieces), separator=separator).char_ends(text)
    assert [text[e - len(p):e] for p, e in zip(pieces, ends)] == pieces


def test_bad_arguments_are_config_errors():
    with pytest.raises(ValueError, match="step_separator must not be empty"):
        prm_reward(url="http://127.0.0.1:9", step_separator="")
    with pytest.raises(ValueError, match="chat must be 'text' or 'messages'"):
        prm_reward(url="http://127.0.0.1:9", chat="jinja")


# ---- through HTTP: the stand-in's numbers ------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("chat, per_token", [("text", False), ("messages", False), ("text", True),
                                             ("messages", True)])
def test_client_gets_the_direct_forward_numbers(scorer, chat, per_token):
    """Both response shapes (a row per step tag, a row per token) and both chat modes give the same rewards."""
    served = PRMScorer(scorer.model, scorer.tokenizer, name="tiny", per_token=per_token)
    with AppServer(create_prm_app(served)) as server:
        reward = prm_reward(url=server.url, model="tiny", system_prompt=SYSTEM, chat=chat, retries=0,
                            prompt_template="<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{problem}"
                                            "<|im_end|>\n<|im_start|>assistant\n{response}<|im_end|>\n")
        results = reward(PROBLEM, GROUP, {})
    assert all(isinstance(r, StepScores) and r.separator == "\n\n" for r in results)
    assert [len(r.rewards) for r in results] == [2, 2, 0, 1]
    for completion, result in zip(GROUP, results):
        np.testing.assert_allclose(result.rewards, expected(scorer, completion), atol=1e-6, rtol=0)
        assert len(result.char_ends(completion)) == len(result.rewards)
    assert 0 < min(r for res in results for r in res.rewards) <= max(r for res in results for r in res.rewards) < 1


@pytest.mark.slow
def test_too_many_steps_scores_that_completion_nan(scorer):
    with AppServer(create_prm_app(scorer)) as server:
        reward = prm_reward(url=server.url, system_prompt=SYSTEM, max_steps=2, retries=0)
        results = reward(PROBLEM, ["a\n\nb\n\nc", "a\n\nb"], {})
    assert math.isnan(results[0])
    assert len(results[1].rewards) == 2
    assert reward.failures[0].what == "a completion of 3 steps, more than the prm reward's max_steps = 2, was not sent"
    assert reward.failures[1] is None
    rewards = RewardSet([RewardTerm("prm", reward, weight=1.0, on_error=-1.0)])
    scores = rewards.score_group(PROBLEM, ["a\n\nb\n\nc"], {})   # nothing sent: the server is gone already
    assert scores.total == [-1.0] and str(scores.failures["prm"][0]).startswith("a completion of 3 steps")


# ---- retries, a server that is down, RewardSet ----------------------------------------------------------------

def flaky_app(failures: list[int], good_body: dict) -> tuple[FastAPI, list[int]]:
    """Answers each status in ``failures`` once (in order), then ``good_body``; records every request."""
    app, seen = FastAPI(), []

    @app.post("/pooling")
    async def pooling(request: Request) -> Response:
        seen.append(len(seen))
        if len(seen) <= len(failures):
            return Response(b'{"error": "busy"}', status_code=failures[len(seen) - 1])
        return Response(json.dumps(good_body), media_type="application/json")

    return app, seen


@pytest.mark.slow
def test_retries_then_success():
    good = {"object": "list", "data": [{"index": 0, "object": "pooling", "data": [[0.25, 0.75], [0.9, 0.1]]}]}
    app, seen = flaky_app([503, 429, 502], good)
    with AppServer(app) as server:
        reward = prm_reward(url=server.url, retries=3, backoff_s=0.01)
        (result,) = reward(PROBLEM, ["one\n\ntwo"], {})
    assert result.rewards == (0.75, 0.1)
    assert len(seen) == 4


@pytest.mark.slow
def test_retries_exhausted_are_service_down_and_4xx_a_clear_error():
    app, seen = flaky_app([503] * 10, {})
    with AppServer(app) as server:
        with pytest.raises(ServiceDown, match=r"/pooling unreachable \(3 attempts; the last: HTTP 503"):
            prm_reward(url=server.url, retries=2, backoff_s=0.01)(PROBLEM, ["x"], {})
        assert len(seen) == 3
        app_400, _ = flaky_app([400], {})
    with AppServer(app_400) as server:
        with pytest.raises(PRMError, match="refused the request: HTTP 400"):
            prm_reward(url=server.url, retries=5, backoff_s=0.01)(PROBLEM, ["x"], {})


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_server_that_is_down_is_service_down_which_the_reward_set_does_not_contain():
    """Down (connection refused) is not a failure of the reward: no on_error scores, the generator waits for it
    (generator/failures.py ServicePause; tests/generator/test_failures_cli.py runs that against a real server)."""
    url = f"http://127.0.0.1:{closed_port()}"
    reward = prm_reward(url=url, retries=2, backoff_s=0.01, timeout_s=2)
    with pytest.raises(ServiceDown, match=rf"PRM at {url}/pooling unreachable \(3 attempts; the last: "
                                          "ConnectionError"):
        reward(PROBLEM, ["a\n\nb"], {})
    rewards = RewardSet([RewardTerm("prm", reward, weight=1.0, on_error=-0.5)])
    with pytest.raises(ServiceDown):
        rewards.score_group(PROBLEM, ["a\n\nb", "c", "d"], {})


def test_a_group_without_steps_sends_nothing():
    reward = prm_reward(url=f"http://127.0.0.1:{closed_port()}", retries=0)
    assert reward(PROBLEM, ["", "\n\n"], {}) == [StepScores((), separator="\n\n")] * 2


# ---- malformed answers: a clear PRMError with the reason, never a silent zero -----------------------------------

STEPS = [2, 1]  # the group below: "a\n\nb" and "c"
finite = st.floats(0, 1)
junk = st.one_of(st.none(), st.booleans(), st.text(max_size=5), st.integers(-3, 3), st.just({}))
bad_row = st.one_of(junk, st.lists(finite, max_size=1), st.lists(st.one_of(st.just("x"), st.none(), st.just(True)),
                                                                  min_size=2, max_size=2),
                    st.tuples(finite, st.floats(1.0001, 1e6)).map(list), st.just("NaN"), st.just("Infinity"))


def bodies():
    """Answers that are wrong for two completions of 2 and 1 steps, each for one reason."""
    ok = [[[0.5, 0.5], [0.5, 0.5]], [[0.2, 0.8]]]
    item = lambda i, rows: {"index": i, "object": "pooling", "data": rows}  # noqa: E731
    return st.one_of(
        junk, st.just({"object": "list"}), st.builds(lambda d: {"data": d}, junk),
        st.lists(st.just(item(0, ok[0])), max_size=3).filter(lambda x: len(x) != 2).map(lambda d: {"data": d}),
        st.just({"data": [item(0, ok[0]), item(0, ok[1])]}),                       # duplicate index
        st.just({"data": [item(0, ok[0]), item(2, ok[1])]}),                       # index out of range
        st.just({"data": [item(0, ok[0]), {"index": 1}]}),                        # no rows
        st.builds(lambda rows: {"data": [item(0, rows), item(1, ok[1])]}, st.one_of(junk, st.lists(junk, max_size=3))),
        st.builds(lambda rows: {"data": [item(0, rows), item(1, ok[1])]},          # wrong row count
                  st.lists(st.just([0.5, 0.5]), max_size=5).filter(lambda r: len(r) != 2)),
        st.builds(lambda r, j: {"data": [item(0, [[0.5, 0.5], r] if j else [r, [0.5, 0.5]]), item(1, ok[1])]},
                  bad_row, st.booleans()),
    )


@pytest.fixture(scope="module")
def scripted():
    """A local server answering /pooling with whatever body the test sets (raw JSON text); no /tokenize."""
    app, holder = FastAPI(), {"body": "{}"}

    @app.post("/pooling")
    async def pooling() -> Response:
        return Response(holder["body"], media_type="application/json")

    with AppServer(app) as server:
        yield server, holder


@pytest.mark.slow
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies())
def test_malformed_answers_are_clear_errors(scripted, body):
    server, holder = scripted
    raw = json.dumps(body).replace('"NaN"', "NaN").replace('"Infinity"', "Infinity")
    holder["body"] = raw
    reward = prm_reward(url=server.url, retries=0, timeout_s=5)
    with pytest.raises(PRMError, match=f"PRM at {server.url}") as err:
        reward(PROBLEM, ["a\n\nb", "c"], {})
    assert any(word in str(err.value) for word in ("expected", "not an item", "rows", "row", "non-JSON",
                                                   "probability", "non-number", "class")), str(err.value)


@pytest.mark.slow
def test_well_formed_scripted_answer_in_any_item_order(scripted):
    server, holder = scripted
    holder["body"] = json.dumps({"data": [{"index": 1, "data": [[0.2, 0.8]]},
                                          {"index": 0, "data": [[0.6, 0.4], [0.3, 0.7]]}]})
    first, second = prm_reward(url=server.url, retries=0)(PROBLEM, ["a\n\nb", "c"], {})
    assert (first.rewards, second.rewards) == ((0.4, 0.7), (0.8,))
    holder["body"] = json.dumps({"data": [{"index": 0, "data": [[2.0, 0.0], [0.0, 0.0]]},
                                          {"index": 1, "data": [[0.0, 1.0]]}]})
    first, second = prm_reward(url=server.url, retries=0, softmax=True)(PROBLEM, ["a\n\nb", "c"], {})
    assert first.rewards == pytest.approx((1 / (1 + math.e ** 2), 0.5))
    assert second.rewards == pytest.approx((math.e / (1 + math.e),))


@pytest.mark.slow
def test_prm_from_config_gives_the_reward_set_its_steps(scorer):
    """The registered 'prm' reward, built from a config entry as the generator builds it, hands RewardSet one
    (character end, weight x probability) per step, at the ends StepScores.char_ends gives."""
    from shared.config.schema.generator import RewardSpec

    served = PRMScorer(scorer.model, scorer.tokenizer, name="tiny", per_token=False)
    with AppServer(create_prm_app(served)) as server:
        spec = RewardSpec(name="prm", weight=2.0, args={"url": server.url, "model": "tiny", "chat": "messages",
                                                          "system_prompt": SYSTEM, "retries": 0})
        scores = RewardSet.from_specs([spec]).score_group(PROBLEM, GROUP, {})
    assert scores.errors == {} and scores.step_errors == 0
    for completion, steps in zip(GROUP, scores.steps):
        ends = [end for end, _ in steps]
        assert ends == StepScores((0.0,) * len(ends), separator="\n\n").char_ends(completion)
        np.testing.assert_allclose([r for _, r in steps], [2 * p for p in expected(scorer, completion)], atol=1e-6)
    assert [len(s) for s in scores.steps] == [2, 2, 0, 1]
