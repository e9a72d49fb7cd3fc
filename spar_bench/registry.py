"""A registry of named factories, shared by every pluggable part of SPAR-Bench.

Modelled on timm's ``register_model`` and lm-evaluation-harness's lazy registry:

* entries are registered eagerly (``@REG.register("name")``) or lazily as a
  ``"module:attr"`` string that is imported only when the entry is first used, so
  listing a registry never imports torch;
* registering a name twice is an error unless ``override=True``;
* an unknown name raises :class:`UnknownNameError`, a
  :class:`~spar_bench.errors.ConfigError`, with "did you mean" suggestions, so the CLI
  prints it as one line and exits 2;
* tests add and remove entries through the public :meth:`Registry.register`,
  :meth:`Registry.unregister` and the :meth:`Registry.registered` context manager.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

from spar_bench.errors import ConfigError

T = TypeVar("T")


def unknown_name_message(kind: str, name: str, known: list[str]) -> str:
    """``unknown source 'wrod'. Did you mean 'word'? Known: lits, ..., word``."""
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    listing = ", ".join(known) if known else "(none registered)"
    return f"unknown {kind} {name!r}.{hint} Known: {listing}"


class UnknownNameError(ConfigError, KeyError):
    """Raised for a name that no entry of the registry has.

    A :class:`~spar_bench.errors.ConfigError` (the CLI prints one line, exit 2) and, for
    code that looks names up like a mapping, a ``KeyError``.
    """

    def __init__(self, kind: str, name: str, known: list[str]):
        self.kind, self.name, self.known = kind, name, list(known)
        super().__init__(unknown_name_message(kind, name, self.known))

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

    def unregister(self, name: str) -> None:
        """Remove ``name`` (raises :class:`UnknownNameError` if it is not registered)."""
        if name not in self._entries:
            raise UnknownNameError(self.kind, name, self.names())
        del self._entries[name]
        del self._meta[name]

    @contextmanager
    def registered(self, name: str, obj: T | str, **meta: Any) -> Iterator[T | str]:
        """Register ``obj`` (or a lazy ``"module:attr"``) for the ``with`` block only.

        An entry it replaces (the name may already exist) is restored afterwards::

            with SOURCES.registered("fake", FakeSource):
                build(config)
        """
        old = (self._entries[name], self._meta[name]) if name in self._entries else None
        if isinstance(obj, str):
            self.register_lazy(name, obj, override=True, **meta)
        else:
            self.register(name, obj, override=True, **meta)
        try:
            yield obj
        finally:
            if old is None:
                self._entries.pop(name, None)
                self._meta.pop(name, None)
            else:
                self._entries[name], self._meta[name] = old

    def check(self, name: str) -> str:
        """``name`` if it is registered, else :class:`UnknownNameError` (imports nothing)."""
        if name not in self._entries:
            raise UnknownNameError(self.kind, name, self.names())
        return name

    def get(self, name: str) -> T:
        """The entry ``name`` (a lazy one is imported now)."""
        self.check(name)
        entry = self._entries[name]
        if isinstance(entry, str):
            entry = import_target(entry)
            self._entries[name] = entry
        return entry  # type: ignore[return-value]

    def meta(self, name: str) -> dict[str, Any]:
        """The keyword metadata ``name`` was registered with."""
        self.check(name)
        return dict(self._meta[name])

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)
