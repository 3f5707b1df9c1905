import pytest

from shared.config.loader import ConfigError, apply_overrides, config_reference, load_config
from shared.config.schema import GRPOConfig, LossConfig, StrictModel


def _all_models(model_cls):
    yield model_cls
    for field in model_cls.model_fields.values():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, StrictModel):
            yield from _all_models(annotation)


def test_every_field_is_documented():
    rows = config_reference()
    assert len(rows) >= 15
    undocumented = [key for key, _, description in rows if len(description) < 10]
    assert undocumented == []


def test_every_section_forbids_unknown_keys():
    for model in _all_models(GRPOConfig):
        assert model.model_config.get("extra") == "forbid", model.__name__


def test_defaults_load_without_a_file():
    config = load_config()
    assert config.algorithm.loss.kl_estimator == "k3"
    assert config.algorithm.advantage.scale == "group"


def test_yaml_file_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seed: 3\nalgorithm:\n  loss:\n    beta: 0.0\n    aggregation: seq-mean-token-mean\n")
    config = load_config(path, ["algorithm.loss.eps_high=0.28", "algorithm.loss.dual_clip=3", "seed=7"])
    assert config.seed == 7
    assert config.algorithm.loss.beta == 0.0
    assert config.algorithm.loss.eps_high == 0.28
    assert config.algorithm.loss.dual_clip == 3.0
    assert config.algorithm.loss.aggregation == "seq-mean-token-mean"


def test_unknown_key_is_named_with_the_file(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("algorithm:\n  loss:\n    bta: 0.1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message and "algorithm.loss.bta: unknown key" in message


def test_unknown_variant_names_list_the_known_ones():
    with pytest.raises(ConfigError, match="unknown policy loss 'ppo2'; known: cispo, grpo, gspo, sapo, vanilla"):
        load_config(None, ["algorithm.loss.policy_loss=ppo2"])
    with pytest.raises(ConfigError, match="unknown loss aggregation 'sum'"):
        load_config(None, ["algorithm.loss.aggregation=sum"])
    with pytest.raises(ConfigError, match="unknown advantage estimator 'gae'"):
        load_config(None, ["algorithm.advantage.estimator=gae"])
    with pytest.raises(ConfigError, match="algorithm.advantage.scale"):
        load_config(None, ["algorithm.advantage.scale=global"])


def test_range_checks_and_dependent_fields():
    with pytest.raises(ConfigError, match="algorithm.loss.eps_low"):
        load_config(None, ["algorithm.loss.eps_low=1.5"])
    with pytest.raises(ConfigError, match="algorithm.loss.dual_clip"):
        load_config(None, ["algorithm.loss.dual_clip=0.5"])
    with pytest.raises(ConfigError, match="needs norm_len"):
        load_config(None, ["algorithm.loss.aggregation=seq-mean-token-sum-norm"])
    assert LossConfig(aggregation="seq-mean-token-sum-norm", norm_len=64).norm_len == 64


def test_file_problems_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file .*missing.yaml"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithm: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml is not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(scalar)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty) == GRPOConfig()


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="not of the form"):
        apply_overrides({}, ["algorithm.loss.beta"])
    with pytest.raises(ConfigError, match="seed is not a section"):
        apply_overrides({"seed": 1}, ["seed.x=2"])
    assert apply_overrides({}, ["a.b=[1, 2]", "a.c=null"]) == {"a": {"b": [1, 2], "c": None}}
