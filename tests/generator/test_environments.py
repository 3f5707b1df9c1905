"""The environment interface's containment and the built-in calculator (generator/environments/, multiturn.py)."""

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from generator.environments.base import StepResult, environment_factory, stop_strings
from generator.environments.calculator import Calculator, CalculatorError, evaluate
from generator.multiturn import EnvironmentFailure, call_all, parse_step
from shared.config.schema.generator import EnvironmentConfig
from shared.errors import UsageError


@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=6), st.lists(st.sampled_from("+-*"), min_size=5,
                                                                          max_size=5))
def test_calculator_agrees_with_python_on_its_syntax(numbers, ops):
    expression = str(numbers[0]) + "".join(f" {op} {n}" for op, n in zip(ops, numbers[1:]))
    assert evaluate(expression, max_chars=200) == eval(expression)  # noqa: S307 - the reference, on our own text


@pytest.mark.parametrize("expression", ["", "2**3", "__import__('os')", "3*", "(1+2)", "1e3", "2 3",
                                        "1" * 13, "1+" * 40 + "1"])
def test_calculator_refuses_anything_else(expression):
    with pytest.raises(CalculatorError):
        evaluate(expression)


def test_calculator_steps():
    calc = Calculator()
    assert calc.reset({"question": "347*29="}) is None
    assert calc.step("so <calc>347*29</calc>") == "<result>10063</result>"
    assert calc.step("<calc>-3+4*5-6</calc>") == "<result>11</result>"
    assert calc.step("<calc>2**99</calc>") == "<result>error</result>"
    assert calc.step("the answer is 10063") is None  # no call: the model answered, the trajectory is done
    assert calc.calls == 3


def test_call_all_contains_raise_hang_and_value():
    def hang():
        time.sleep(30)

    def boom():
        raise RuntimeError("broken tool")

    started = time.monotonic()
    results = call_all([lambda: "ok", boom, hang, lambda: None], timeout_s=0.5)
    assert time.monotonic() - started < 5
    assert results[0] == ("ok", None) and results[3] == (None, None)
    raised, hung = results[1][1], results[2][1]
    line = boom.__code__.co_firstlineno + 1
    assert raised.what == "raised RuntimeError: broken tool" and raised.where == f"{__file__}:{line} in boom"
    assert "Traceback (most recent call last)" in raised.trace
    # a call that hangs: where it was when its time ran out (the sleep in hang, the user's line)
    assert hung.what == "took longer than generator.environment.timeout_s = 0.5s"
    assert hung.where == f"{__file__}:{hang.__code__.co_firstlineno + 1} in hang"


def test_parse_step_accepts_the_contract_and_refuses_garbage():
    assert parse_step("obs") == StepResult(observation="obs")
    assert parse_step(None).done
    assert parse_step(StepResult("x", reward=1.5)).reward == 1.5
    for bad, why in ((42, "returned int"), (StepResult(observation=b"x"), "observation of type bytes"),
                     (StepResult(reward=float("nan")), "not a finite number"),
                     (StepResult(reward=True), "not a finite number"), (StepResult(done="yes"), "not a bool")):
        with pytest.raises(EnvironmentFailure, match=why):
            parse_step(bad)


def test_environment_names_resolve_or_fail_naming_the_key(tmp_path):
    assert environment_factory(EnvironmentConfig(name="calculator")) is Calculator
    assert stop_strings(EnvironmentConfig(name="calculator"), Calculator) == ["</calc>"]
    assert stop_strings(EnvironmentConfig(name="calculator", stop=["END"]), Calculator) == ["END"]
    path = tmp_path / "env.py"
    path.write_text("class Echo:\n    def reset(self, sample):\n        return None\n"
                    "    def step(self, text):\n        return text\n\nclass Half:\n    def reset(self, s):\n"
                    "        return None\n")
    assert environment_factory(EnvironmentConfig(name=f"{path}:Echo")).__name__ == "Echo"
    with pytest.raises(UsageError, match=r"generator.environment.name: .*\(missing step\)"):
        environment_factory(EnvironmentConfig(name=f"{path}:Half"))
    with pytest.raises(ValueError, match="unknown environment 'calculater'; known: calculator, guess, tools, or a "
                                         "class as 'package.module:Class'"):
        EnvironmentConfig(name="calculater")  # at config load, before any environment is built
    with pytest.raises(UsageError, match="generator.environment.name: no such file"):
        environment_factory(EnvironmentConfig(name=f"{tmp_path}/nope.py:Echo"))


def test_environment_check_at_start_up_names_the_key_and_accepts_both_engines():
    from generator.main import check_environment
    from shared.config.schema import GRPOConfig

    with pytest.raises(ValueError, match="unknown environment 'nope'"):
        GRPOConfig.model_validate({"generator": {"environment": {"name": "nope"}}})
    for engine in ("transformers", "vllm"):  # the vLLM engine samples turns too (tests/vllm/test_multiturn_vllm.py)
        check_environment(GRPOConfig.model_validate({"generator": {"engine": engine,
                                                                   "environment": {"name": "calculator"}}}))


def test_progress_reports_the_environment():
    from generator.multiturn import EnvStats
    from generator.progress import environment_summary

    stats = EnvStats(trajectories=4, turns=10, env_calls=6, trajectories_with_calls=3, env_errors=1,
                     env_time_s=0.26, env_tokens=30, model_tokens=90)
    assert environment_summary(stats) == {"turns/traj": 2.5, "env_calls": 6, "tool_rate": 0.75, "env_errors": 1,
                                          "env_s": 0.3, "env_token_frac": 0.25}
    assert environment_summary(None) == {}
