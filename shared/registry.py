"""Named registries: a variant of the algorithm is one decorated function and a config string.

Modelled on verl's ``core_algos`` registries. A config names an entry (``"k3"``, ``"token-mean"``); an unknown
name is an error that lists the known ones, never a silent fallback.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A name -> function table for one kind of variant (advantage estimators, KL estimators, ...)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str, *aliases: str) -> Callable[[F], F]:
        """Decorator: ``@REGISTRY.register("name")`` adds the function under ``name`` (and aliases)."""

        def decorator(fn: F) -> F:
            for key in (name, *aliases):
                if key in self._entries:
                    raise ValueError(f"{self.kind} {key!r} is already registered")
                self._entries[key] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(
                f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self._entries))}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
