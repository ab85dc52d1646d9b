"""One generic name -> object registry (core layer: imports nothing from tx).

Registering a name twice is an error unless `replace=True` (registering the very same object again is a
no-op, so re-running a module's decorators is harmless); looking up an unknown name says what is
registered. Model families use it (tx.models.registry); other registries may move onto it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownName(KeyError, ValueError):
    """A name no registry entry has; its message (not KeyError's quoted repr) says what is registered."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """Objects by name; `kind` names what they are in errors ("architecture", "loss", ...). `strict`: the same
    object registered again under its name also raises (registries of plain functions, where that is a slip)."""

    def __init__(self, kind: str, *, strict: bool = False):
        self.kind = kind
        self.strict = strict
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T, *, replace: bool = False) -> T:
        self._check_free(name, item, replace)
        self._items[name] = item
        return item

    def _check_free(self, name: str, item: T, replace: bool) -> None:
        old = self._items.get(name)
        if old is not None and (old is not item or self.strict) and not replace:
            raise ValueError(f"{self.kind} {name!r} is already registered (to {_describe(old)}); "
                             f"pass replace=True to replace it with {_describe(item)}")

    def decorator(self, *names: str, replace: bool = False) -> Callable[[T], T]:
        """`@registry.decorator("a", "b")`: register the decorated object under each name."""

        def deco(item: T) -> T:
            for name in names:  # all or nothing: no name is taken when one of them is not free
                self._check_free(name, item, replace)
            for name in names:
                self._items[name] = item
            return item

        return deco

    def get(self, name: str) -> T:
        if name not in self._items:
            raise UnknownName(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names()) or '(none)'}")
        return self._items[name]

    def unregister(self, name: str) -> None:
        self.get(name)
        del self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def items(self) -> list[tuple[str, T]]:
        return [(name, self._items[name]) for name in self.names()]

    def snapshot(self) -> dict[str, T]:
        """What is registered now, for `restore` (tests register freely between the two)."""
        return dict(self._items)

    def restore(self, snapshot: dict[str, T]) -> None:
        self._items = dict(snapshot)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)


def _describe(item: object) -> str:
    module, name = getattr(item, "__module__", None), getattr(item, "__qualname__", None)
    return f"{module}.{name}" if module and name else repr(item)
