"""Base of every config section."""

from __future__ import annotations

import importlib
import sys

from pydantic import BaseModel, ConfigDict

from shared.registry import declared_names


class StrictModel(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def check_registered(registry_module: str, registry_name: str, value: str, *, user_code: str | None = None) -> str:
    """``value`` when the registry ``registry_module.registry_name`` (a :class:`shared.registry.Registry`) holds it,
    else a ``ValueError`` listing the known names: the validator of every config field that names an entry.
    ``user_code``: the field may name user code instead (:meth:`shared.registry.Registry.check`)."""
    # Looked up by module name at validation time: the registries' modules import the schema themselves. A module
    # not imported yet is not imported for a name its source declares (several import torch: a config loads in
    # ~0.5 s instead of ~3.5); an imported one is asked (entries registered at run time), as is any other name.
    if registry_module not in sys.modules and (value in declared_names(registry_module, registry_name)
                                               or (user_code is not None and ":" in value)):
        return value
    return getattr(importlib.import_module(registry_module), registry_name).check(value, user_code=user_code)
