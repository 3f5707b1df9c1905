"""The one plug-in style (shared/registry.py): modules imported on the first read, config checks that list the known
names (and accept user code where a field allows it), descriptions for docs; and the extension points built on it."""

import sys

import pytest

from shared.registry import Registry


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    """A module ``registry_plugin_<n>`` that registers ``late`` into ``holder.REG`` when imported."""
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"registry_plugin_{id(tmp_path)}"
    (tmp_path / f"{name}.py").write_text(
        "import holder\n\n@holder.REG.register('late')\ndef late():\n    '''Registered by the module.\n\n    more'''\n")
    holder = type(sys)("holder")
    monkeypatch.setitem(sys.modules, "holder", holder)
    yield name, holder
    sys.modules.pop(name, None)


def test_the_modules_are_imported_on_the_first_read(plugin_module):
    name, holder = plugin_module
    holder.REG = registry = Registry("widget", modules=(name,))

    @registry.register("early", "e")
    def early():
        """Defined beside the registry."""

    assert name not in sys.modules                                  # registering is no read
    assert registry.names() == ["e", "early", "late"] and name in sys.modules
    assert registry.get("late").__name__ == "late" and "late" in registry and list(registry) == registry.names()
    assert registry.describe() == {"e": "Defined beside the registry.", "early": "Defined beside the registry.",
                                   "late": "Registered by the module."}
    with pytest.raises(ValueError, match="widget 'late' is already registered"):
        registry.register("late")(early)


def test_a_module_that_fails_to_import_fails_every_read():
    registry = Registry("widget", modules=("no_such_module_for_the_registry_test",))
    for _ in range(2):  # never a partial table that looks complete
        with pytest.raises(ModuleNotFoundError):
            registry.names()


def test_check_lists_the_known_names_and_takes_user_code_where_allowed():
    registry = Registry("widget")
    registry.register("b")(len)
    registry.register("a")(len)
    assert registry.check("a") == "a"
    with pytest.raises(ValueError, match=r"^unknown widget 'c'; known: a, b$"):
        registry.check("c")
    with pytest.raises(KeyError, match="unknown widget 'c'; known: a, b"):
        registry.get("c")
    assert registry.check("pkg.mod:Widget", user_code="a class as 'module:Class'") == "pkg.mod:Widget"
    with pytest.raises(ValueError, match="known: a, b, or a class as 'module:Class'"):
        registry.check("c", user_code="a class as 'module:Class'")


def test_dataset_kinds_are_a_registry_the_config_checks():
    from generator.datasets import DATASETS, load_examples
    from shared.config.schema.generator import DatasetConfig

    assert DATASETS.names() == ["arithmetic", "arithmetic_words", "chain", "hf", "jsonl", "reasoning_gym",
                               "verifiers"]
    with pytest.raises(ValueError, match="unknown dataset kind 'csv'; known: arithmetic, arithmetic_words, chain"):
        DatasetConfig(kind="csv")
    examples = load_examples(DatasetConfig(kind="chain", arithmetic_pool=3), seed=1)
    assert len(examples) == 3 and all(e.example_id.startswith("chain:") for e in examples)


def test_environments_and_rewards_are_complete_when_read():
    from generator.environments.base import ENVIRONMENTS
    from generator.environments.calculator import Calculator
    from generator.rewards import REWARDS

    assert ENVIRONMENTS.names() == ["calculator", "guess", "tools"] and ENVIRONMENTS.get("calculator") is Calculator
    assert {"format", "math", "chain", "chain_steps", "prm", "python", "reasoning_gym"} <= set(REWARDS.names())


def _schema_checks() -> set[tuple[str, str]]:
    """Every ``check_registered("module", "NAME", ...)`` of the config schema."""
    import ast
    from pathlib import Path

    schema = Path(__file__).resolve().parents[2] / "shared" / "config" / "schema"
    return {(node.args[0].value, node.args[1].value) for path in schema.glob("*.py")
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "check_registered" and len(node.args) >= 2
            and all(isinstance(a, ast.Constant) for a in node.args[:2])}


def test_the_names_read_from_the_source_are_the_registries_names():
    """What a config load accepts without importing a registry's module is exactly what the imported registry holds,
    for every registry the schema checks (aliases and the entries of its ``modules`` included)."""
    import importlib

    from shared.registry import declared_names

    checks = _schema_checks()
    assert len(checks) >= 9, checks
    for module, name in sorted(checks):
        assert declared_names(module, name) == set(getattr(importlib.import_module(module), name).names()), name
    assert {"k1", "kl", "low_var_kl"} <= declared_names("shared.grpo.kl", "KL_ESTIMATORS")
    assert declared_names("shared.grpo.kl", "NO_SUCH_REGISTRY") == frozenset()


def _registered_fields() -> list[tuple[type, str, str, str]]:
    """``(schema class, field, registry module, registry name)`` for every field a ``field_validator`` checks with
    ``check_registered``."""
    import ast
    import importlib
    from pathlib import Path

    found = []
    for path in sorted((Path(__file__).resolve().parents[2] / "shared" / "config" / "schema").glob("*.py")):
        module = importlib.import_module("shared.config.schema" + ("" if path.stem == "__init__" else f".{path.stem}"))
        for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
            for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
                fields = [a.value for d in fn.decorator_list if isinstance(d, ast.Call)
                          and getattr(d.func, "id", None) == "field_validator" for a in d.args]
                for call in ast.walk(fn):
                    if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "check_registered":
                        found += [(getattr(module, cls.name), f, call.args[0].value, call.args[1].value)
                                  for f in fields]
    return found


def test_the_description_of_a_registered_field_names_every_registered_entry():
    """docs/config.md (the fields' descriptions) names every reward, loss, estimator, dataset kind and environment a
    config may use: its reward list omitted prm, chain and chain_steps, which the registry held."""
    import re

    from shared.registry import declared_names

    fields = _registered_fields()
    assert len(fields) == len(_schema_checks()), fields
    for cls, field, module, registry in fields:
        description = cls.model_fields[field].description
        missing = [name for name in sorted(declared_names(module, registry))
                   if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", description)]
        assert not missing, f"{cls.__name__}.{field} does not name {missing}"


def test_a_name_the_source_does_not_declare_is_asked_of_the_registry(monkeypatch):
    """An entry registered at run time passes (its module is imported); an unknown name lists the known ones."""
    from shared.config.schema.base import check_registered
    from shared.grpo.kl import KL_ESTIMATORS

    with pytest.raises(ValueError, match="unknown KL estimator 'k9'; known: k1, k2, k3, kl, low_var_kl, mse"):
        check_registered("shared.grpo.kl", "KL_ESTIMATORS", "k9")
    monkeypatch.setitem(KL_ESTIMATORS._entries, "k9", lambda *a: None)
    assert check_registered("shared.grpo.kl", "KL_ESTIMATORS", "k9") == "k9"
