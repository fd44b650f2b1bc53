"""`ConfigSection`: a strategy's ``*_configs`` section seen as a live, validated dict.

Paddle returns a fresh dict from ``strategy.amp_configs``, so ``strategy.amp_configs["x"] = 1``
edits a copy and is silently lost. Here the view writes through the owning strategy's validated,
all-or-nothing ``update``; list values come back as tuples so that in-place edits fail loudly.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any, Protocol

from fleetlike.config.fields import (
    UnknownAttributeError,
    UnknownOptionError,
    plain,
    unknown_key,
)

__all__ = ["ConfigSection"]


class _Owner(Protocol):
    _values: dict[str, Any]

    def update(self, options: Mapping[str, Any]) -> None: ...


class ConfigSection(MutableMapping[str, Any]):
    """Live, validated dict view of one ``*_configs`` section of a strategy.

    Reads reflect the strategy; writes (``view[key] = v``, ``view.key = v``, ``view.update``)
    validate and write through, all-or-nothing. Keys are fixed: deleting raises TypeError (use
    ``strategy.reset("section.key")``). Compares equal to a plain dict with the same values.
    """

    __slots__ = ("_owner", "_name")

    def __init__(self, owner: _Owner, name: str) -> None:
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_name", name)

    def _store(self) -> dict[str, Any]:
        return self._owner._values[self._name]

    def __getitem__(self, key: str) -> Any:
        store = self._store()
        if key not in store:
            raise unknown_key(key, list(store), self._name)
        return store[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._owner.update({self._name: {key: value}})

    def __delitem__(self, key: str) -> None:
        raise TypeError(f"{self._name} has a fixed set of keys; {key!r} cannot be deleted. Fix: "
                        f"use strategy.reset('{self._name}.{key}') to restore its default")

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._store()))

    def __len__(self) -> int:
        return len(self._store())

    def update(self, other: Any = (), /, **kwargs: Any) -> None:  # type: ignore[override]
        """Atomic, unlike `MutableMapping.update`: all keys are validated before any is set."""
        self._owner.update({self._name: {**dict(other), **kwargs}})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self[name]
        except UnknownOptionError as exc:
            raise UnknownAttributeError(exc.field, name, exc.constraint, exc.fix,
                                        str(exc)) from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._store():
            exc = unknown_key(name, list(self._store()), self._name)
            raise UnknownAttributeError(exc.field, name, exc.constraint, exc.fix, str(exc))
        self[name] = value

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy of the section."""
        return {k: plain(v) for k, v in self._store().items()}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return self.to_dict() == plain(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self.to_dict())
