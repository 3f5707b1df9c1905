"""What a config means, checked when it is loaded or by `grpo check-config` (issue 36, item 3): one source of
rewards for a multi-turn environment, a user environment's args against its constructor, a stop string that stays
one string, every address derived from ref_server.port, every error at once with did-you-mean, and the reward
check without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy.cli import main
from generator.environments.base import stop_strings
from shared.config.loader import ConfigError, load_config
from shared.config.schema.generator import EnvironmentConfig

ROOT = Path(__file__).resolve().parents[2]
LONG_RESET = ROOT / "tests" / "generator" / "long_reset_env.py"


def check_config(tmp_path, data: dict, *overrides: str, capsys) -> tuple[int, str, str]:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    argv = ["check-config", str(path), "--schema-only"]
    for item in overrides:
        argv += ["--set", item]
    status = main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


# -- reward: environment ------------------------------------------------------------------------------------------
def test_an_environment_reward_alone_runs_no_default_reward(tmp_path, capsys):
    status, out, _ = check_config(tmp_path, {"generator": {"environment": {"name": "guess", "reward": "environment"}}},
                                  capsys=capsys)
    assert status == 0 and yaml.safe_load(out)["generator"]["rewards"] == []   # the default [arithmetic] is not run
    status, out, _ = check_config(tmp_path, {"generator": {"environment": {"name": "guess"}}}, capsys=capsys)
    assert status == 0 and yaml.safe_load(out)["generator"]["rewards"][0]["name"] == "arithmetic"  # reward: rewards


def test_rewards_listed_beside_an_environment_reward_are_an_error_naming_both_keys(tmp_path, capsys):
    data = {"generator": {"environment": {"name": "guess", "reward": "environment"},
                          "rewards": [{"name": "format"}]}}
    status, out, err = check_config(tmp_path, data, capsys=capsys)
    assert status == 2 and out == "" and "Traceback" not in err
    assert "generator.rewards lists ['format'], but generator.environment.reward is 'environment'" in err
    with pytest.raises(ConfigError, match="generator.rewards is empty: at least one reward is needed"):
        load_config(None, ["generator.rewards=[]"])


# -- a user environment's args ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "args", "message"), [
    (f"{LONG_RESET}:LongReset", {"lenght": 3}, "unknown argument 'lenght' (did you mean 'length'?); LongReset takes "
                                               "length, shared"),
    ("guess", {"digit": 2}, "unknown argument 'digit' (did you mean 'digits'?); DigitGuess takes digits, "
                            "secret_field"),
    ("calculator", {"anything": 1}, "unknown argument 'anything'; Calculator takes max_chars, max_digits"),
])
def test_environment_args_are_checked_against_the_class_at_start(tmp_path, capsys, name, args, message):
    data = {"generator": {"model": None, "environment": {"name": name, "args": args}}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"generator.environment.args: {message}" in err and "Traceback" not in err


def test_good_environment_args_pass(tmp_path):
    from generator.environments.base import environment_factory

    cls = environment_factory(EnvironmentConfig(name=f"{LONG_RESET}:LongReset", args={"length": 5}))
    assert cls(length=5).reset({}).startswith("0")


# -- stop ---------------------------------------------------------------------------------------------------------
def test_a_stop_string_is_one_stop_sequence_in_the_config_and_on_the_class():
    config = load_config(None, ['generator.environment={name: guess, stop: "</answer>"}'])
    assert config.generator.environment.stop == ["</answer>"]
    assert load_config(None, ["generator.environment={name: guess, stop: [a, b]}"]).generator.environment.stop == \
        ["a", "b"]

    class AnswerEnv:
        stop = "</answer>"   # a string on the class too

    assert stop_strings(EnvironmentConfig(name="x:y"), AnswerEnv) == ["</answer>"]


@pytest.mark.parametrize("stop", ['""', '[""]', '["</calc>", ""]', "[1]", "{a: 1}"])
def test_a_stop_that_is_no_string_or_an_empty_one_is_refused_at_load(stop):
    """An empty stop string ends every turn before its first token: refused by check-config (it was refused only
    when the generator started), as a number or a mapping is."""
    with pytest.raises(ConfigError, match=r"generator\.environment\.stop"):
        load_config(None, [f"generator.environment={{name: guess, stop: {stop}}}"])


# -- derived addresses --------------------------------------------------------------------------------------------
def test_a_port_override_reaches_every_address_derived_from_it(tmp_path, capsys):
    status, out, _ = check_config(tmp_path, {}, "ref_server.port=9123", capsys=capsys)
    resolved = yaml.safe_load(out)
    assert status == 0
    assert resolved["generator"]["hub_url"] == resolved["learner"]["hub_url"] == "http://127.0.0.1:9123"
    config = load_config(ROOT / "deploy" / "configs" / "tiny-cpu.yaml", ["ref_server.port=9124"])
    assert config.generator.hub_url == config.learner.hub_url == "http://127.0.0.1:9124"
    # an address the config sets stays; a wildcard bind address is reached on the loopback
    config = load_config(None, ["ref_server.port=9125", "generator.hub_url=http://gpu-node:8470",
                                "ref_server.host=0.0.0.0"])
    assert config.generator.hub_url == "http://gpu-node:8470" and config.learner.hub_url == "http://127.0.0.1:9125"
    from deploy.launcher import resolve_config

    launched = resolve_config(load_config(None, ["ref_server.port=9126", "run.run_dir=" + str(tmp_path / "r")]))
    assert launched.generator.hub_url == launched.learner.hub_url == "http://127.0.0.1:9126"


# -- every error at once ------------------------------------------------------------------------------------------
def test_every_config_error_at_once_with_did_you_mean(tmp_path, capsys):
    data = {"generatr": {}, "algorithm": {"loss": {"bta": 0.1}}, "learner": {"lr": "fast"},
            "generator": {"samplng": {"max_tokens": 3}, "group_size": 0, "rewards": [{"name": "format", "wieght": 2}]}}
    status, out, err = check_config(tmp_path, data, capsys=capsys)
    assert status == 2 and out == "" and "Traceback" not in err
    for line in ["generatr: unknown key (did you mean 'generator'?)",
                 "algorithm.loss.bta: unknown key (did you mean 'beta'?)",
                 "generator.samplng: unknown key (did you mean 'sampling'?)",
                 "generator.rewards.0.wieght: unknown key (did you mean 'weight'?)",
                 "generator.group_size: Input should be greater than or equal to 1",
                 "learner.lr: Input should be a valid number"]:
        assert line in err, err
    with pytest.raises(ConfigError, match=r"generator\.zzz: unknown key \(known: model, engine, id, hub_url"):
        load_config(None, ["generator.zzz=1"])


def test_an_unknown_key_does_not_hide_the_checks_of_its_section(tmp_path, capsys):
    """A section with an unknown key was not checked as a whole: its model validators (here: rewards beside an
    environment's own reward) waited for the next round, after the typo was fixed."""
    data = {"generator": {"modle": "x", "rewards": [{"name": "format", "wieght": 1}],
                          "environment": {"name": "calculator", "reward": "environment", "max_turn": 2}}}
    status, _, err = check_config(tmp_path, data, capsys=capsys)
    assert status == 2
    *unknown, hidden = err.splitlines()[1:]
    assert sorted(unknown) == ["  generator.environment.max_turn: unknown key (did you mean 'max_turns' or "
                               "'max_turn_tokens'?)",
                               "  generator.modle: unknown key (did you mean 'model'?)",
                               "  generator.rewards.0.wieght: unknown key (did you mean 'weight'?)"], err
    assert hidden == ("  generator.rewards lists ['format'], but generator.environment.reward is 'environment', which "
                      "scores trajectories by the environment's step rewards alone: remove generator.rewards, or set "
                      "generator.environment.reward: rewards to score with them"), err


# -- no torch to check a reward -----------------------------------------------------------------------------------
@pytest.mark.slow   # a subprocess: this process imported torch long ago
def test_the_reward_and_environment_checks_import_no_torch():
    """check-config's reward and environment checks build every built-in reward and load the environment class
    as the generator does, without importing torch (seconds of CPU for a config check)."""
    code = """
import json, sys
from types import SimpleNamespace
from deploy.preflight import environment_problems, reward_problems
from generator.rewards import REWARDS
from shared.config.schema.generator import EnvironmentConfig, RewardSpec
args = {"http": {"url": "http://127.0.0.1:9"}, "prm": {"url": "http://127.0.0.1:9"}, "python": {"function": "json:dumps"},
        "soft_overlong": {"max_tokens": 8, "buffer": 4}}
rewards = [RewardSpec(name=n, args=args.get(n, {})) for n in REWARDS.names()]
config = SimpleNamespace(generator=SimpleNamespace(rewards=rewards, environment=EnvironmentConfig(name="guess"),
                                                   dataset=SimpleNamespace(template=None)))
print(json.dumps({"problems": reward_problems(config) + environment_problems(config),
                  "rewards": len(rewards), "torch": "torch" in sys.modules}))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert answer["rewards"] >= 10 and answer["torch"] is False, answer
    assert all("json:dumps" in p for p in answer["problems"]), answer   # only the python reward's wrong signature
