"""Base of every config section."""

from __future__ import annotations

import importlib

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def check_registered(registry_module: str, registry_name: str, value: str, *, user_code: str | None = None) -> str:
    """``value`` when the registry ``registry_module.registry_name`` (a :class:`shared.registry.Registry`) holds it,
    else a ``ValueError`` listing the known names: the validator of every config field that names an entry.
    ``user_code``: the field may name user code instead (:meth:`shared.registry.Registry.check`)."""
    # Looked up by module name at validation time: the registries' modules import the schema themselves.
    return getattr(importlib.import_module(registry_module), registry_name).check(value, user_code=user_code)
