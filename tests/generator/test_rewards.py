import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from generator.rewards import REWARDS, RewardSet, gold_answer
from generator.sandbox import SandboxLimits, extract_code, run_tests
from shared.config.schema import RewardSpec


def score(name, completion, example=None, **args):
    return REWARDS.get(name)(**args)("prompt", [completion], example or {})[0]


@pytest.mark.parametrize("completion, expected", [
    ("<think>2+2 is 4</think><answer>4</answer>", 1.25),
    ("<think>multi\nline</think>\n<answer>4</answer>", 1.25),
    ("  <think>x</think><answer>4</answer>\n", 1.25),
    ("<answer>4</answer>", -1.0),
    ("<think>x</think><answer>4</answer> trailing", -1.0),
    ("", -1.0),
])
def test_format_reward(completion, expected):
    assert score("format", completion) == expected


@pytest.mark.parametrize("completion, answer, expected", [
    ("<answer>-3</answer>", "-3", 1.0),
    ("<answer>3</answer>", "-3", 0.0),
    ("<answer>\\frac{1}{2}</answer>", "0.5", 1.0),
    ("<answer>1/2</answer>", "\\frac{1}{2}", 1.0),
    ("so the total is \\boxed{72}", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),
    ("<answer>1,000</answer>", "1000", 1.0),
    ("I don't know", "5", 0.0),
    ("<answer></answer>", "5", 0.0),
    ("<answer>7</answer> but also <answer>5</answer>", "5", 1.0),
])
def test_math_reward(completion, answer, expected):
    assert score("math", completion, {"answer": answer}) == expected


def test_gsm8k_answer_extraction():
    assert gold_answer({"answer": "Step one.\n#### 1,234"}) == "1,234"
    with pytest.raises(KeyError, match="no 'answer' field"):
        gold_answer({"question": "q"})


@pytest.mark.parametrize("completion, expected", [
    ("<answer>82</answer>", 1.0), ("<answer> 82 </answer>", 1.0), ("<answer>83</answer>", 0.0),
    ("82", 0.0), ("<answer>82", 0.0),
])
def test_arithmetic_reward(completion, expected):
    assert score("arithmetic", completion, {"answer": "82"}) == expected


CODE_EXAMPLE = {"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]}


@pytest.mark.slow
@pytest.mark.parametrize("completion, expected", [
    ("```python\ndef add(a, b):\n    return a + b\n```", 2 / 3),
    ("def add(a, b):\n    return a + b", 2 / 3),
    ("```python\ndef add(a, b)\n    return a + b\n```", 0.0),          # syntax error
    ("```python\nwhile True:\n    pass\n```", 0.0),                      # infinite loop, killed
    ("```python\nx = 'a' * (2 ** 34)\n```", 0.0),                        # memory bomb
    ("no code at all", 0.0),
])
def test_code_reward(completion, expected):
    assert score("code", completion, CODE_EXAMPLE, timeout_s=2.0, memory_mb=256) == pytest.approx(expected)


@pytest.mark.slow
def test_sandbox_blocks_network_and_subprocesses_and_runs_in_an_empty_directory():
    cwd = run_tests("import os\nfiles = os.listdir('.')", ["assert sorted(files) == []"])
    assert cwd.passed == 1, cwd
    net = run_tests("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)", ["assert True"])
    assert net.status == "solution_error" and net.fraction_passed == 0.0
    sub = run_tests("import subprocess\nsubprocess.run(['true'])", ["assert True"])
    assert sub.status == "solution_error" and "not allowed" in sub.detail
    loop = run_tests("while True: pass", ["assert True"], SandboxLimits(timeout_s=1))
    assert loop.status == "timeout" and loop.fraction_passed == 0.0


def test_extract_code_takes_last_block():
    assert extract_code("```py\na = 1\n```\ntext\n```python\nb = 2\n```") == "b = 2\n"


def _reward_server(scores, port: int = 0):
    """An HTTP reward model on 127.0.0.1 answering ``{"scores": scores(body)}`` (``port`` again after a stop: the
    server reuses the address)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            payload = json.dumps({"scores": scores(body)}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_http_reward_model_scores_a_group_in_one_request():
    calls = []
    server = _reward_server(lambda body: calls.append(body) or [len(c) / 10 for c in body["completions"]])
    try:
        fn = REWARDS.get("http")(url=f"http://127.0.0.1:{server.server_port}/score")
        assert fn("p", ["ab", "abcd"], {}) == [0.2, 0.4]
        assert len(calls) == 1 and calls[0]["prompts"] == ["p", "p"]
    finally:
        server.shutdown()


def test_http_reward_wrong_count_is_an_error_scored_on_error():
    server = _reward_server(lambda body: [1.0])
    try:
        rewards = RewardSet.from_specs([RewardSpec(name="http", on_error=-0.5,
                                                   args={"url": f"http://127.0.0.1:{server.server_port}/"})])
        scores = rewards.score_group("p", ["a", "b"], {})
        assert scores.total == [-0.5, -0.5] and scores.errors == {"http": 2}
    finally:
        server.shutdown()


def length_reward(prompt, completion, example, scale=1.0):
    if completion == "boom":
        raise RuntimeError("boom")
    return len(completion) * scale


def test_python_reward_and_weighted_sum_with_contained_errors():
    rewards = RewardSet.from_specs([
        RewardSpec(name="python", weight=0.5, on_error=-1.0,
                   args={"function": "tests.generator.test_rewards:length_reward", "scale": 2.0}),
        RewardSpec(name="arithmetic", weight=2.0),
    ])
    scores = rewards.score_group("p", ["<answer>4</answer>", "boom", "x"], {"answer": "4"})
    assert scores.components["python"] == [36.0, -1.0, 2.0]
    assert scores.components["arithmetic"] == [1.0, 0.0, 0.0]
    assert scores.total == [0.5 * 36 + 2.0, -0.5, 1.0]
    assert scores.errors == {"python": 1}


def test_reward_config_errors_are_clear():
    with pytest.raises(ValueError, match="unknown reward 'bleu'"):
        RewardSpec(name="bleu")
    with pytest.raises(ValueError, match=r"generator.rewards\[0\] \(python\): function 'nope.mod:fn': cannot import module 'nope.mod'"):
        RewardSet.from_specs([RewardSpec(name="python", args={"function": "nope.mod:fn"})])
    with pytest.raises(ValueError, match="bad arguments"):
        RewardSet.from_specs([RewardSpec(name="format", args={"colour": "red"})])
    with pytest.raises(ValueError, match="unique"):
        RewardSet.from_specs([RewardSpec(name="format"), RewardSpec(name="format")])
    assert RewardSet.from_specs([RewardSpec(name="format"), RewardSpec(name="format", label="f2")])
