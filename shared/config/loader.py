"""The one YAML config schema (pydantic, in shared/config/loader/schema/), its loader and the command-line overrides.

Every field carries a description (a test enforces it) and ``grpo config-reference`` prints them all. An unknown
key is an error that names the key and the file; names of algorithm variants are checked against their
registries when the config is loaded, not when a training step first uses them.
"""

from __future__ import annotations

import copy
import difflib
import json
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import to_jsonable_python

from shared.config.schema import GRPOConfig, StrictModel
from shared.errors import UsageError


class ConfigError(UsageError, ValueError):
    """A config file or override that cannot be used; the message names the file and the key."""


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for depth, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {'.'.join(keys[: depth + 1])} is not a section")
        node = child
    node[keys[-1]] = value


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides (value parsed as YAML: ``1e-4``, ``null``, ``[1, 2]``) in order."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({exc})") from None
        _set_path(tree, key.strip(), value)
    return tree


def format_validation_error(exc: ValidationError | list, source: str, schema: type[BaseModel] = GRPOConfig) -> str:
    """Every problem at once (a ValidationError, or its errors), one line each, naming the dotted key:
    ``algorithm.loss.bta: unknown key (did you mean 'beta'?)``."""
    lines = []
    for error in exc.errors() if isinstance(exc, ValidationError) else exc:
        key = ".".join(str(part) for part in error["loc"]) or "<top level>"
        if error["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key{did_you_mean(schema, error['loc'])}")
            continue
        message = error["msg"].removeprefix("Value error, ")   # a validator's own message names its keys
        lines.append(message if message.startswith(f"{key}") and error["loc"] else f"{key}: {message}")
    return f"invalid config {source}:\n  " + "\n  ".join(lines)


def did_you_mean(schema: type[BaseModel], loc: tuple) -> str:
    """`` (did you mean 'x'?)`` for an unknown key at ``loc`` whose section has a key spelled like it; else
    `` (known: ...)`` listing the section's keys."""
    model: type[BaseModel] | None = schema
    for part in loc[:-1]:
        if isinstance(part, int):    # an entry of a list section (generator.rewards[0])
            continue
        field = model.model_fields.get(str(part)) if model is not None else None
        model = _nested_model(field.annotation)[0] if field is not None else None
    if model is None:
        return ""
    known = list(model.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), known, n=2, cutoff=0.6)
    if close:
        return " (did you mean " + " or ".join(repr(name) for name in close) + "?)"
    return f" (known: {', '.join(known)})"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                schema: type[StrictModel] = GRPOConfig) -> StrictModel:
    """Read a YAML file (or start from defaults when ``path`` is None), apply overrides, validate."""
    tree = read_config_tree(path) if path is not None else {}
    apply_overrides(tree, overrides or [])
    return validate_tree(tree, "<defaults>" if path is None else str(path), schema)


def read_config_tree(path: str | Path) -> dict[str, Any]:
    """The sections a YAML config file holds, as written (not validated, no defaults filled in)."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {source}: {exc.strerror}") from None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {source} is not valid YAML: {exc}") from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {source} must hold a mapping of sections, got {type(loaded).__name__}")
    return loaded


def validate_tree(tree: dict[str, Any], source: str, schema: type[StrictModel] = GRPOConfig) -> StrictModel:
    """``tree`` as the config ``schema``; a ConfigError naming ``source`` and every bad key otherwise."""
    try:
        return schema.model_validate(tree)
    except ValidationError as exc:
        errors = exc.errors()
    raise ConfigError(format_validation_error(errors + _hidden_by_unknown_keys(tree, errors, schema), source,
                                              schema)) from None


def _hidden_by_unknown_keys(tree: dict[str, Any], errors: list, schema: type[StrictModel]) -> list:
    """The errors an unknown key hid: a section with one is not checked as a whole (its model validators, such as
    generator.rewards beside an environment's own reward, do not run), so the tree is checked again without them."""
    unknown = [error["loc"] for error in errors if error["type"] == "extra_forbidden"]
    if not unknown:
        return []
    stripped = copy.deepcopy(tree)
    for *path, key in unknown:
        section = stripped
        for part in path:
            section = section[part] if isinstance(section, (dict, list)) else None
        if isinstance(section, dict):
            section.pop(key, None)
    try:
        schema.model_validate(stripped)
    except ValidationError as again:
        return [error for error in again.errors() if error not in errors]
    return []


def _nested_model(annotation: Any) -> tuple[type[BaseModel] | None, str]:
    """The config model inside a field's annotation: a section (``X``) or a list of entries (``list[X]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    if get_origin(annotation) is list:
        (item,) = get_args(annotation)
        if isinstance(item, type) and issubclass(item, BaseModel):
            return item, "[]"
    # an optional section (``X | None``, e.g. learner.lora): its default row, then its fields
    models = [arg for arg in get_args(annotation) if isinstance(arg, type) and issubclass(arg, BaseModel)]
    if len(models) == 1 and type(None) in get_args(annotation):
        return models[0], "?"
    return None, ""


def config_reference(schema: type[BaseModel] = GRPOConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """``(dotted key, default as JSON, description)`` for every field, recursively (``rewards[].name`` for
    the fields of list entries)."""
    rows: list[tuple[str, str, str]] = []
    for name, field in schema.model_fields.items():
        key = f"{prefix}{name}"
        nested, suffix = _nested_model(field.annotation)
        if field.is_required():
            default = "(required)"
        else:
            default = json.dumps(to_jsonable_python(field.get_default(call_default_factory=True)))
        if nested is not None and not suffix:
            rows.append((key, "(section)", field.description or ""))
        else:
            rows.append((key, default, field.description or ""))
        if nested is not None:
            rows.extend(config_reference(nested, prefix=f"{key}{suffix.replace('?', '')}."))
    return rows
