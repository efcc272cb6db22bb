"""One registry helper for everything users extend by name: policy-loss modes, advantage
estimators, reward tasks.

    MODES = Registry("mode")
    @MODES.register("my_mode")          # or MODES.add("my_mode", obj)
    def my_mode(...): ...
    MODES.get("my_mode"); MODES.names(); "my_mode" in MODES

A config field that names an entry is validated by asking its registry (``check``), so a mode a
user registers (in a module listed under ``trainer.imports``) works from YAML like a built-in one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Named entries of one kind; ``kind`` is how errors name the argument (e.g. "mode")."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T, *, override: bool = False) -> T:
        if not isinstance(name, str) or not name:
            raise TypeError(f"{self.kind}: a name must be a non-empty str, got {name!r}")
        if name in self._entries and not override:
            raise ValueError(f"{self.kind} {name!r} is already registered (pass override=True to replace it)")
        self._entries[name] = entry
        return entry

    def register(self, name: str, *, override: bool = False) -> Callable[[T], T]:
        """Decorator form of ``add``: registers the decorated object itself and returns it."""

        def decorator(entry: T) -> T:
            return self.add(name, entry, override=override)

        return decorator

    def get(self, name: str) -> T:
        """The entry ``name``; a ValueError that names the kind and lists the registered names."""
        if name not in self._entries:
            raise ValueError(f"{self.kind} must be one of {self.names()}, got {name!r}")
        return self._entries[name]

    def check(self, name: str, key: str | None = None) -> None:
        """ValueError naming ``key`` (e.g. "algo.mode") unless ``name`` is registered."""
        if name not in self._entries:
            raise ValueError(f"{key or self.kind}: unknown {self.kind} {name!r}; registered: {', '.join(self.names())}")

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)
