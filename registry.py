"""One generic name -> factory registry for every plug-in point.

Kernel backends, KV transports, idle-time predictors and routing policies
each keep one ``Registry``. Factories import their module lazily, so a
registry's names are known (the YAML reader checks against them) without
importing what the entries need (Triton, UCX, Ray).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A name -> factory map with a readable error for unknown names."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str, factory: Callable[..., T]) -> None:
        if name in self._factories:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._factories[name] = factory

    def names(self) -> list[str]:
        return sorted(self._factories)

    def __iter__(self) -> Iterator[str]:
        """The names in the order they were registered (the order a choice is listed in, defaults first)."""
        return iter(self._factories)

    def __contains__(self, name: object) -> bool:
        return name in self._factories

    def factory(self, name: str) -> Callable[..., T]:
        try:
            return self._factories[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}") from None

    def create(self, name: str, *args: object, **kwargs: object) -> T:
        return self.factory(name)(*args, **kwargs)
