"""The rule for user code that fails (generator/failures.py): a failure rate over a window of each source's last
completions or trajectories, the first failure's file:line, and a reward service that is down pausing instead of
failing. The same rule against the real `grpo generator`: tests/generator/test_failures_cli.py."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import requests

import generator
from generator.failures import (
    Failure,
    FailureRateExceeded,
    FailureRule,
    ServiceDown,
    ServicePause,
    is_user_file,
)
from generator.rewards import RewardSet
from shared.config.schema import RewardSpec

OK, BAD = None, Failure("ValueError: broken", "reward.py:3 in score")


def outcomes(pattern: str) -> list[Failure | None]:
    """``"..x."``: a failure where ``x``, a scored completion where ``.``."""
    return [BAD if c == "x" else OK for c in pattern]


def test_a_low_failure_rate_under_the_threshold_keeps_running():
    rule = FailureRule(window=8, max_rate=0.5)
    for _ in range(20):   # 3 failures in every 8: 37.5% < 50%, for as long as it goes on
        rule.record("reward 'r'", outcomes("x.x..x.."))
        rule.check()


def test_a_reward_that_starts_failing_after_good_batches_stops_once_the_window_reaches_the_rate():
    rule = FailureRule(window=8, max_rate=0.5)
    for _ in range(3):
        rule.record("reward 'r'", outcomes("...."))
        rule.check()
    rule.record("reward 'r'", [Failure("KeyError: 'label'", "mine.py:7 in score"), BAD, BAD])
    rule.check()   # 3 of the last 8: under 50%
    rule.record("reward 'r'", outcomes("x"))
    with pytest.raises(FailureRateExceeded) as info:
        rule.check()
    assert str(info.value) == (
        "reward 'r' failed on 4 of its last 8 completions (50%): the rule is to stop at 50% of a window of 8 "
        "(generator.failures.max_rate and .window), since training would learn from on_error scores alone; the "
        "first failure in the window: KeyError: 'label' (at mine.py:7 in score)")
    assert info.value.exit_code == 2


def test_the_first_failure_named_is_the_first_still_in_the_window():
    rule = FailureRule(window=4, max_rate=1.0)
    rule.record("environment 'e'", [Failure("old", "e.py:1 in step")] + outcomes("..."), "trajectories")
    rule.record("environment 'e'", outcomes("xxxx"), "trajectories")   # the old failure slid out
    with pytest.raises(FailureRateExceeded, match=r"environment 'e' failed on 4 of its last 4 trajectories "
                                                  r"\(100%\).*first failure in the window: ValueError: broken"):
        rule.check()


def test_everything_failed_so_far_stops_before_the_window_is_full_and_window_0_never_stops():
    rule = FailureRule(window=64, max_rate=0.5)
    rule.record("reward 'ok'", outcomes("......"))
    rule.record("reward 'broken'", outcomes("xxxxxx"))
    with pytest.raises(FailureRateExceeded, match="reward 'broken' failed on all 6 completions it was given so far"):
        rule.check()
    partly = FailureRule(window=64, max_rate=0.5)
    partly.record("reward 'r'", outcomes("xxxxx."))   # 5 of 6, but one scored and the window is not full
    partly.check()
    never = FailureRule(window=0, max_rate=0.5)
    never.record("reward 'r'", outcomes("x" * 200))
    never.check()


def parse(text):
    return json.loads(text)["value"]   # a library frame (json) below the user's line


def test_a_failure_names_the_innermost_line_of_the_users_code_not_the_librarys():
    try:
        parse("{not json")
    except ValueError as exc:
        failure = Failure.of(exc)
    line = parse.__code__.co_firstlineno + 1
    assert failure.where == f"{__file__}:{line} in parse"
    assert failure.what.startswith("JSONDecodeError: ") and "json/decoder.py" in failure.trace


def test_user_files_are_those_outside_grpo_stack_the_standard_library_and_installed_packages():
    project = Path(generator.__file__).resolve().parent.parent
    assert not is_user_file(str(project / "generator" / "loop.py"))
    assert is_user_file(str(project / "generator_rewards" / "mine.py"))   # a folder that only starts alike
    assert is_user_file(__file__) and is_user_file("/somewhere/else/reward.py")
    assert not is_user_file(json.__file__) and not is_user_file(requests.__file__)
    assert not is_user_file("<string>")


def test_service_pause_waits_for_the_service_and_resumes(caplog):
    answers = iter([ServiceDown("PRM", "http://x/pooling", "Connection refused")] * 3 + [[1.0]])

    def score():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    pause = ServicePause(retry_s=0.05)
    with caplog.at_level("WARNING", logger="grpo.generator"):
        assert pause.call(score, threading.Event()) == [1.0]
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["PRM at http://x/pooling unreachable (Connection refused): pausing generation, retrying every "
                     "0.05s (generator.failures.service_retry_s)",
                     f"PRM at http://x/pooling answers again: generation resumes (paused {pause.paused_s:.0f}s)"]
    assert pause.pauses == 1 and pause.down is None


def test_a_stop_ends_a_pause_promptly():
    stop = threading.Event()
    calls = []

    def down():
        calls.append(1)
        raise ServiceDown("HTTP reward", "http://x", "HTTP 503")

    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    assert ServicePause(retry_s=60).call(down, stop) is None
    assert time.monotonic() - started < 5 and len(calls) == 1
    pause = ServicePause(retry_s=60)
    pause.down = ServiceDown("HTTP reward", "http://x", "HTTP 503")   # down when the stop came: not asked again
    assert pause.call(down, stop) is None and len(calls) == 1


class _Reward(BaseHTTPRequestHandler):
    status, body = 200, b'{"scores": [1.0, 0.5]}'

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(self.status)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status, body, down", [
    (503, b"overloaded", True), (429, b"slow down", True), (500, b"", True),
    (400, b"bad request", False), (200, b"<html>", False), (200, b'{"scores": [1]}', False),
])
def test_http_reward_down_is_service_down_and_garbage_is_a_failure(status, body, down):
    handler = type("Handler", (_Reward,), {"status": status, "body": body})
    server = HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rewards = RewardSet.from_specs([RewardSpec(name="http", on_error=-1.0,
                                                   args={"url": f"http://127.0.0.1:{server.server_port}/"})])
        if down:
            with pytest.raises(ServiceDown, match=f"HTTP reward at http://127.0.0.1:{server.server_port}/ "
                                                  f"unreachable \\(HTTP {status}"):
                rewards.score_group("p", ["a", "b"], {})
        else:
            scores = rewards.score_group("p", ["a", "b"], {})
            assert scores.total == [-1.0, -1.0] and scores.errors == {"http": 2}
            assert all(f is not None and f.trace for f in scores.failures["http"])
    finally:
        server.shutdown()
        server.server_close()


def test_http_reward_with_nothing_listening_is_down():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]   # closed on leaving: nothing listens there
    rewards = RewardSet.from_specs([RewardSpec(name="http", args={"url": f"http://127.0.0.1:{port}/"})])
    with pytest.raises(ServiceDown, match="unreachable \\(ConnectionError"):
        rewards.score_group("p", ["a"], {})


def sleepy(seconds: float) -> str:
    time.sleep(seconds)   # the line a hung call is found at
    return "woke"


SLEEP_LINE = f"{__file__}:{sleepy.__code__.co_firstlineno + 1} in sleepy"


@pytest.mark.parametrize("where", ["main", "thread"])
def test_a_call_past_its_limit_is_cut_off_with_the_line_it_was_at(where, monkeypatch):
    """A reward that hangs (issue 36: rewards that fail, hang or say nothing): call_within ends the wait after
    timeout_s with CallHung naming the user's line. On the main thread the call itself is interrupted (it keeps the
    main thread, which math_verify's signal.alarm needs); elsewhere it runs in a thread that is abandoned."""
    import signal as signals

    from generator.failures import CallHung, call_within

    monkeypatch.setattr(generator.failures, "is_user_file", lambda filename: filename == __file__)
    outcome: dict = {}

    def attempt() -> None:
        started = time.monotonic()
        try:
            call_within(lambda: sleepy(30), 0.3, "timeout_s")
        except CallHung as exc:
            outcome.update(failure=exc.failure, took=time.monotonic() - started)
        outcome["quick"] = call_within(lambda: sleepy(0.01), 5, "timeout_s")
        with pytest.raises(ZeroDivisionError):
            call_within(lambda: 1 / 0, 5, "timeout_s")

    handler = signals.getsignal(signals.SIGUSR2)
    if where == "main":
        attempt()
    else:
        worker = threading.Thread(target=attempt)
        worker.start()
        worker.join(20)
    assert outcome["took"] < 5 and outcome["quick"] == "woke"
    assert outcome["failure"].what == "took longer than timeout_s = 0.3s" and outcome["failure"].where == SLEEP_LINE
    assert signals.getsignal(signals.SIGUSR2) == handler   # restored
    assert call_within(lambda: "direct", None, "timeout_s") == "direct"


def test_a_python_reward_that_hangs_fails_its_group_with_its_line(tmp_path):
    """timeout_s on a reward: a call past it scores the group on_error, its failure the line it hung at; python
    rewards get 300 s when it is not set, the built-in ones none (their own timeouts bound them)."""
    (tmp_path / "hangs.py").write_text("import time\n\ndef score(prompt, completion, example):\n"
                                       "    time.sleep(60)\n    return 1.0\n")
    spec = RewardSpec(name="python", on_error=-1.0, timeout_s=0.3, args={"function": f"{tmp_path}/hangs.py:score"})
    rewards = RewardSet.from_specs([spec, RewardSpec(name="format")])
    started = time.monotonic()
    scores = rewards.score_group("q", ["a", "b"], {})
    assert time.monotonic() - started < 5 and scores.components["python"] == [-1.0, -1.0]
    failure = scores.failures["python"][0]
    assert failure.what == "took longer than the reward's timeout_s (generator.rewards 'python') = 0.3s"
    assert failure.where == f"{tmp_path}/hangs.py:4 in score"
    assert [t.timeout_s for t in RewardSet.from_specs([spec.model_copy(update={"timeout_s": None}),
                                                        RewardSpec(name="format")]).terms] == [300.0, None]
    assert RewardSet.from_specs([spec.model_copy(update={"timeout_s": 0})]).terms[0].timeout_s is None
