"""A registry of named factories, shared by every pluggable part of SPAR-Bench.

Modelled on timm's ``register_model`` and lm-evaluation-harness's lazy registry:

* entries are registered eagerly (``@REG.register("name")``) or lazily as a
  ``"module:attr"`` string that is imported only when the entry is first used, so
  listing a registry never imports torch;
* registering a name twice is an error unless ``override=True``;
* an unknown name raises :class:`UnknownNameError` with "did you mean" suggestions.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError):
    """Raised for a name that no entry of the registry has."""

    def __init__(self, kind: str, name: str, known: list[str]):
        self.kind, self.name, self.known = kind, name, known
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        listing = ", ".join(known) if known else "(none registered)"
        super().__init__(f"unknown {kind} {name!r}.{hint} Known: {listing}")

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class DuplicateNameError(ValueError):
    """Raised when a name is registered twice without ``override=True``."""


def import_target(target: str) -> Any:
    """Import ``"package.module:attr"`` and return the attribute."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"lazy target must look like 'package.module:attr', got {target!r}")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError as e:
        raise ImportError(f"{module_name!r} has no attribute {attr!r} (lazy target {target!r})") from e


class Registry(Generic[T]):
    """Named entries of one kind (sources, encoders, heads, ...)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T | str] = {}
        self._meta: dict[str, dict[str, Any]] = {}

    def _check_new(self, name: str, override: bool) -> None:
        if not name or not isinstance(name, str):
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._entries and not override:
            raise DuplicateNameError(
                f"{self.kind} {name!r} is already registered; pass override=True to replace it"
            )

    def register(
        self, name: str, obj: T | None = None, *, override: bool = False, **meta: Any
    ) -> Callable[[T], T] | T:
        """Register ``obj`` under ``name``; without ``obj``, return a decorator."""

        def add(o: T) -> T:
            self._check_new(name, override)
            self._entries[name] = o
            self._meta[name] = dict(meta)
            return o

        return add(obj) if obj is not None else add

    def register_lazy(self, name: str, target: str, *, override: bool = False, **meta: Any) -> None:
        """Register ``"module:attr"``, imported on first :meth:`get`."""
        if ":" not in target:
            raise ValueError(f"lazy target must look like 'package.module:attr', got {target!r}")
        self._check_new(name, override)
        self._entries[name] = target
        self._meta[name] = dict(meta)

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise UnknownNameError(self.kind, name, self.names())
        entry = self._entries[name]
        if isinstance(entry, str):
            entry = import_target(entry)
            self._entries[name] = entry
        return entry  # type: ignore[return-value]

    def meta(self, name: str) -> dict[str, Any]:
        if name not in self._entries:
            raise UnknownNameError(self.kind, name, self.names())
        return dict(self._meta[name])

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)
