"""Named registries: every extension point is one ``Registry``, a variant is one decorated entry and a config string.

Modelled on verl's ``core_algos`` registries. A config names an entry (``"k3"``, ``"token-mean"``); an unknown
name is an error that lists the known ones, never a silent fallback.

The convention, the same for every extension point (advantage estimators, supervisions, policy losses,
aggregations, KL estimators, rewards, environments, dataset kinds, ...):

* **One home.** The registry is a module-level constant, ``NAMES: Registry = Registry("what one entry is")``, in the
  module that owns the concept; it is the only list of the names (no if-chain on them, no second table).
* **Registered once, at the definition**: ``@NAMES.register("name", *aliases)`` on the function or class.
* **Complete when read.** Entries defined in the registry's own module are there once it is imported. Entries in
  other modules (which import the registry, so it cannot import them first) are named in ``modules=(...)``: they
  are imported on the first read (``get``, ``in``, ``names``, iteration, ``describe``), so a reader never sees a
  partial table and the home needs no import list of its own.
* **Checked at config load**: the config field is a ``str`` whose pydantic validator calls
  :func:`shared.config.schema.base.check_registered` (module and registry by name: the schema does not import the
  registries' modules, they import it), so a typo fails at load with the known names in the message.
* **Checked without importing** (:func:`declared_names`): a config loads without importing the registries'
  modules (several import torch: ~3 s for ``grpo check-config``); the names are read from their source, the
  ``@NAMES.register(...)`` decorators of the home and of its ``modules``.
* **Dispatched by name**: ``NAMES.get(cfg.field)(...)``; :meth:`Registry.describe` gives the names with the first
  line of each entry's docstring, for docs and error messages.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A name -> function (or class) table for one kind of variant (advantage estimators, KL estimators, ...).

    ``modules``: the modules whose import registers the built-in entries defined outside the registry's home,
    imported on the first read (see the module docstring)."""

    def __init__(self, kind: str, *, modules: Sequence[str] = ()) -> None:
        self.kind = kind
        self.modules = tuple(modules)
        self._entries: dict[str, F] = {}
        self._loaded = not self.modules

    def register(self, name: str, *aliases: str) -> Callable[[F], F]:
        """Decorator: ``@REGISTRY.register("name")`` adds the function under ``name`` (and aliases)."""

        def decorator(fn: F) -> F:
            for key in (name, *aliases):
                if key in self._entries:
                    raise ValueError(f"{self.kind} {key!r} is already registered")
                self._entries[key] = fn
            return fn

        return decorator

    def _entries_read(self) -> dict[str, F]:
        """The table, after importing ``modules`` once (their imports register the built-in entries)."""
        if not self._loaded:
            self._loaded = True  # first: a module imported here may read the registry while it registers
            try:
                for module in self.modules:
                    importlib.import_module(module)
            except BaseException:
                self._loaded = False  # the next read tries again (and raises again) rather than see a partial table
                raise
        return self._entries

    def get(self, name: str) -> F:
        try:
            return self._entries_read()[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}") from None

    def check(self, name: str, *, user_code: str | None = None) -> str:
        """``name`` when it is registered, else a ``ValueError`` listing the known names (for config validators).

        ``user_code``: where a config may also name user code instead (``'package.module:attr'``, loaded by the
        service at start-up), how to write it; a name with a ``:`` then passes."""
        if name in self or (user_code is not None and ":" in name):
            return name
        also = f", or {user_code}" if user_code is not None else ""
        raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}{also}")

    def names(self) -> list[str]:
        return sorted(self._entries_read())

    def describe(self) -> dict[str, str]:
        """Each name with the first line of its entry's docstring ('' without one), sorted by name."""
        return {name: ((self._entries_read()[name].__doc__ or "").strip().splitlines() or [""])[0]
                for name in self.names()}

    def __contains__(self, name: object) -> bool:
        return name in self._entries_read()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


@functools.cache
def declared_names(module: str, registry: str) -> frozenset[str]:
    """The names registered in ``module``'s registry ``registry`` as its source declares them, without importing it
    (nor torch): the string arguments of every ``@registry.register(...)`` in ``module`` and in the modules named by
    its ``Registry(..., modules=(...))``. Only a shortcut for a name that is there: an entry registered otherwise
    (at run time, under another name for the registry) is not seen, so a name missing here is looked up in the
    imported registry before it is called unknown (:func:`shared.config.schema.base.check_registered`)."""
    tree = _parsed(module)
    modules = [module]
    for node in tree.body:  # a package that re-exports the registry (from generator.rewards.base import REWARDS)
        if (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                and any(alias.name == registry and alias.asname is None for alias in node.names)):
            return declared_names(node.module, registry)
    for node in ast.walk(tree):  # NAMES: Registry = Registry("kind", modules=("a.b", ...))
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id == registry and isinstance(node.value, ast.Call):
            for keyword in node.value.keywords:
                if keyword.arg == "modules" and isinstance(keyword.value, (ast.Tuple, ast.List)):
                    modules += [e.value for e in keyword.value.elts if isinstance(e, ast.Constant)]
    names = set()
    for name in modules:
        for node in ast.walk(tree if name == module else _parsed(name)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "register"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == registry):
                names.update(a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str))
    return frozenset(names)


def _parsed(module: str) -> ast.Module:
    """``module``'s source, parsed (finding it imports its parent packages only)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return ast.Module(body=[], type_ignores=[])
    with open(spec.origin, encoding="utf-8") as source:
        return ast.parse(source.read(), spec.origin)
