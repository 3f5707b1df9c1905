"""algorithm.kl (the KL penalty in the reward), algorithm.advantage.supervision and the one place that decides
whether a reference model is needed (AlgorithmConfig.needs_reference)."""

import pytest

from deploy.launcher import cpu_threads
from ref_server.server import ModelLoadError, build_state
from shared.config.loader import ConfigError, config_reference, load_config
from shared.config.schema import AlgorithmConfig, KLConfig, LossConfig


def both_keys(message: str) -> bool:
    return "algorithm.kl.in_reward" in message and "algorithm.loss.beta" in message


def test_defaults_outcome_supervision_kl_in_the_loss():
    config = load_config()
    assert config.algorithm.advantage.supervision == "outcome"
    assert config.algorithm.kl.in_reward is False and config.algorithm.kl.estimator == "k1"
    assert config.algorithm.kl.beta == 0.04 and config.algorithm.loss.beta == 0.04
    assert config.algorithm.needs_reference and not config.algorithm.token_advantages


def test_kl_in_reward_and_an_explicit_loss_beta_name_both_keys_from_yaml_and_from_set(tmp_path):
    path = tmp_path / "both.yaml"
    path.write_text("algorithm:\n  kl:\n    in_reward: true\n  loss:\n    beta: 0.04\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert both_keys(str(info.value)) and str(path) in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(None, ["algorithm.kl.in_reward=true", "algorithm.loss.beta=0.1"])
    assert both_keys(str(info.value))
    with pytest.raises(ValueError) as info:
        AlgorithmConfig(kl=KLConfig(in_reward=True), loss=LossConfig(beta=0.04))
    assert both_keys(str(info.value))


def test_kl_in_reward_with_the_default_loss_beta_turns_the_loss_beta_off(tmp_path):
    path = tmp_path / "reward.yaml"
    # a loss section without beta, and none at all: the default 0.04 is not the user's choice
    path.write_text("algorithm:\n  kl:\n    in_reward: true\n    beta: 0.02\n  loss:\n    eps_high: 0.28\n")
    for config in (load_config(path), load_config(None, ["algorithm.kl.in_reward=true"])):
        assert config.algorithm.loss.beta == 0.0
        assert config.algorithm.needs_reference and config.algorithm.token_advantages
    assert load_config(path).algorithm.kl.beta == 0.02
    # the YAML file, then --set: in_reward from the command line still finds the file's loss section beta-less
    assert load_config(path, ["algorithm.kl.in_reward=true"]).algorithm.loss.beta == 0.0
    # and an explicit 0 is what the user asked for
    assert load_config(None, ["algorithm.kl.in_reward=true", "algorithm.loss.beta=0"]).algorithm.loss.beta == 0.0
    given = LossConfig()
    AlgorithmConfig(kl=KLConfig(in_reward=True), loss=given)
    assert given.beta == 0.04  # the caller's object is not changed


def test_resolved_config_reloads_the_same(tmp_path):
    """`grpo run` writes the resolved config (every field explicit) for its services: it must load again."""
    config = load_config(None, ["algorithm.kl.in_reward=true"])
    again = type(config).model_validate(config.model_dump(mode="json"))
    assert again.algorithm.loss.beta == 0.0 and again.algorithm.kl.in_reward


def test_needs_reference_is_beta_or_kl_in_reward():
    assert not AlgorithmConfig(loss=LossConfig(beta=0.0)).needs_reference
    assert AlgorithmConfig(loss=LossConfig(beta=0.01)).needs_reference
    assert AlgorithmConfig(kl=KLConfig(in_reward=True)).needs_reference


def test_supervision_and_estimator_values_are_checked():
    with pytest.raises(ConfigError, match="algorithm.advantage.supervision"):
        load_config(None, ["algorithm.advantage.supervision=steps"])
    with pytest.raises(ConfigError, match="algorithm.kl.estimator"):
        load_config(None, ["algorithm.kl.estimator=k2"])
    with pytest.raises(ConfigError, match="algorithm.kl.bta: unknown key"):
        load_config(None, ["algorithm.kl.bta=1"])
    keys = {key for key, _, _ in config_reference()}
    assert {"algorithm.kl.in_reward", "algorithm.kl.beta", "algorithm.kl.estimator",
            "algorithm.advantage.supervision", "learner.advantages_jsonl"} <= keys


def test_the_ref_server_and_the_launcher_ask_needs_reference():
    config = load_config(None, ["algorithm.kl.in_reward=true", "ref_server.model=null"])
    with pytest.raises(ModelLoadError, match="algorithm.kl.in_reward"):
        build_state(config)
    # the ref server computes on the CPU when it scores: it gets its share of the cores
    off = load_config(None, ["algorithm.loss.beta=0", "run.num_generators=1"])
    on = load_config(None, ["algorithm.kl.in_reward=true", "run.num_generators=1"])
    assert cpu_threads(off, 12) == 6 and cpu_threads(on, 12) == 4
    # LoRA scoring its reference in the learner: the ref server only runs the hub, no share of the cores
    in_learner = load_config(None, ["algorithm.kl.in_reward=true", "run.num_generators=1", "learner.lora.r=4",
                                    "learner.lora.reference=learner"])
    assert cpu_threads(in_learner, 12) == 6
