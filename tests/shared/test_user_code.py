"""shared/user_code.py: user code named as module:attr or path/to/file.py:attr, with errors that name the key."""

from __future__ import annotations

import pytest

from shared.errors import UsageError
from shared.user_code import check_callable, load_object, split_spec


def test_file_spec_loads_function_relative_to_base_dir(tmp_path):
    (tmp_path / "my_reward.py").write_text("def score(prompt, completion, example):\n    return len(completion)\n")
    fn = load_object("my_reward.py:score", "generator.rewards[0].function", base_dir=tmp_path)
    assert fn(prompt="p", completion="abc", example={}) == 3
    # the same file twice is one module
    assert load_object(f"{tmp_path}/my_reward.py:score", "k") is fn


def test_module_spec_and_dotted_attr():
    assert load_object("shared.user_code:load_object", "k") is load_object
    assert load_object("shared.errors:UsageError.exit_code", "k") == 2


@pytest.mark.parametrize("spec, fragment", [
    ("no_colon", "expected 'module:name'"),
    (":attr", "expected 'module:name'"),
    ("mod:", "expected 'module:name'"),
    ("mod:bad-name", "expected 'module:name'"),
    ("surely_missing_module_xyz:f", "cannot import module 'surely_missing_module_xyz'"),
    ("shared.user_code:missing_attr", "has no 'missing_attr'"),
    ("nowhere/file.py:f", "no such file"),
])
def test_bad_specs_name_the_key(spec, fragment):
    with pytest.raises(UsageError) as info:
        load_object(spec, "generator.rewards[1].function")
    assert "generator.rewards[1].function" in str(info.value)
    assert fragment in str(info.value)


def test_file_that_raises_on_import_is_a_usage_error(tmp_path):
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom at import')\n")
    with pytest.raises(UsageError, match="importing .*broken.py failed: RuntimeError: boom at import"):
        load_object(str(tmp_path / "broken.py") + ":f", "k")
    with pytest.raises(UsageError):  # not cached as half-imported
        load_object(str(tmp_path / "broken.py") + ":f", "k")


def test_split_spec_keeps_windows_like_paths_on_the_last_colon():
    assert split_spec("C:/x/y.py:fn", "k") == ("C:/x/y.py", "fn")
    with pytest.raises(UsageError, match="k:"):
        split_spec(3, "k")  # type: ignore[arg-type]


def test_check_callable_accepts_matching_and_kwargs_signatures():
    contract = "fn(prompt=, completion=, example=, **kwargs)"
    check_callable(lambda prompt, completion, example: 0.0, "k", keywords=("prompt", "completion", "example"),
                   contract=contract)
    check_callable(lambda prompt, completion, **rest: 0.0, "k", keywords=("prompt", "completion", "example"),
                   contract=contract)
    check_callable(lambda prompt, completion, example, scale=1: 0.0, "k",
                   keywords=("prompt", "completion", "example"), extra=("scale",), contract=contract)


@pytest.mark.parametrize("fn", [
    lambda text: 0.0,                                  # wrong names
    lambda prompt, completion: 0.0,                    # example missing
    lambda prompt, completion, example, needed: 0.0,   # a required argument nobody passes
    42,                                                # not callable
])
def test_check_callable_refuses_wrong_signatures_showing_the_contract(fn):
    with pytest.raises(UsageError) as info:
        check_callable(fn, "generator.rewards[0].function", keywords=("prompt", "completion", "example"),
                       contract="fn(prompt=, completion=, example=, **kwargs)")
    assert "generator.rewards[0].function" in str(info.value)
    assert "fn(prompt=, completion=, example=, **kwargs)" in str(info.value)
