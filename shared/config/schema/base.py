"""Base of every config section."""

from __future__ import annotations

import importlib

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def check_registered(registry_module: str, registry_name: str, value: str) -> str:
    # Looked up by module name at validation time: the registries' modules import the schema themselves.
    registry = getattr(importlib.import_module(registry_module), registry_name)
    if value not in registry:
        raise ValueError(f"unknown {registry.kind} {value!r}; known: {', '.join(registry.names())}")
    return value
