"""Limits of a settings field, declared once on the library's dataclass and read by everyone.

A settings class (a build's, a head's, a finetune's, an MLLM run's) declares each field's range or
choices with :func:`limited`; its ``__post_init__`` calls :func:`check_fields`, so a bad value is
one line however it arrives: from a command line, an experiment file or Python. The command
lines make their click types from the same declaration (:func:`spar_bench.clitools.declared_type`),
and ``spar-bench run`` checks an experiment file's values through the classes at plan time, without
reading any command-line declaration.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from spar_bench.errors import ConfigError

_KEY, _HELP = "spar_bench.limit", "spar_bench.help"


@dataclass(frozen=True)
class Limit:
    """``lo <= value <= hi`` (either may be None), or ``value in choices``; ``flag``: how the
    command line spells the field (``--in-plane``), for the one-line error."""

    lo: float | None = None
    hi: float | None = None
    choices: tuple[Any, ...] | None = None
    flag: str | None = None

    def problem(self, value: Any) -> str | None:
        """What is wrong with ``value`` (None: nothing, or None given for an optional field)."""
        if value is None:
            return None
        if self.choices is not None:
            if value not in self.choices:
                return f"must be one of {', '.join(map(str, self.choices))}, got {value!r}"
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a number, got {value!r}"
        if self.lo is not None and value < self.lo:
            return f"must be >= {self.lo}" + (f" and <= {self.hi}" if self.hi is not None else "") + f", got {value}"
        if self.hi is not None and value > self.hi:
            return f"must be <= {self.hi}" + (f" and >= {self.lo}" if self.lo is not None else "") + f", got {value}"
        return None


def limited(default: Any = dataclasses.MISSING, *, lo: float | None = None, hi: float | None = None,
            choices: Sequence[Any] | None = None, flag: str | None = None, help: str | None = None) -> Any:
    """A dataclass field with its :class:`Limit` (``field(default=..., metadata=...)``) and its
    help (the command line's, :func:`spar_bench.clitools.field_options`); given only ``help``,
    the field has no limit."""
    meta: dict[str, Any] = {_HELP: help} if help is not None else {}
    if help is None or any(x is not None for x in (lo, hi, choices, flag)):
        meta[_KEY] = Limit(lo, hi, tuple(choices) if choices is not None else None, flag)
    return dataclasses.field(default=default, metadata=meta)


def help_of(cls: type, name: str) -> str | None:
    """The help field ``name`` of dataclass ``cls`` declares (:func:`limited`), or None."""
    return next((f.metadata.get(_HELP) for f in dataclasses.fields(cls) if f.name == name), None)


def scalar(tp: Any) -> Any:
    """What a value of annotation ``tp`` is read as: its first type (``int | None``: ``int``)
    when that is bool, int, float or str, a converter (a callable that is no type) as it is,
    else None (taken as given)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = typing.get_args(tp)[0]
    if tp in (bool, int, float, str) or (callable(tp) and not isinstance(tp, type) and typing.get_origin(tp) is None):
        return tp
    return None


def field_types(*classes: type) -> dict[str, Any]:
    """Each field of the dataclasses ``classes`` and its type (the resolved annotation)."""
    out: dict[str, Any] = {}
    for cls in classes:
        hints = typing.get_type_hints(cls)
        out.update({f.name: hints[f.name] for f in dataclasses.fields(cls)})
    return out


def field_default(cls: type, name: str) -> Any:
    """The default of field ``name`` of dataclass ``cls`` (its factory's value): what a command
    line shows and fills for an option not given (:func:`spar_bench.clitools.field_option`)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def limit_of(cls: type, name: str) -> Limit | None:
    """The declared :class:`Limit` of field ``name`` of dataclass ``cls`` (None: no limit, or no field)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.metadata.get(_KEY)
    return None


def check_fields(obj: Any) -> None:
    """Every limited field of dataclass instance ``obj`` within its limit, else one ConfigError
    naming the field as the command line spells it."""
    for f in dataclasses.fields(obj):
        limit = f.metadata.get(_KEY)
        problem = limit.problem(getattr(obj, f.name)) if limit is not None else None
        if problem:
            raise ConfigError(f"{limit.flag or '--' + f.name.replace('_', '-')} {problem}")


def options_of(classes: type | tuple[type, ...], options: Mapping[str, Any] | None, what: str,
               skip: Sequence[str] = ()) -> dict[str, Any]:
    """``options`` (a run kind's ``predictors.NAME.options``, ``spar-probe predict --option``)
    checked against the fields of the dataclasses ``classes`` less ``skip``: an unknown key is one
    line with "did you mean", a value of another type than its field's default one line naming
    both (an int is taken for a float). Returns the checked options, to build the classes from."""
    classes = classes if isinstance(classes, tuple) else (classes,)
    owner = {f.name: c for c in reversed(classes) for f in dataclasses.fields(c) if f.name not in skip}
    known = [f.name for c in classes for f in dataclasses.fields(c) if f.name not in skip]
    out = dict(options or {})
    for k, v in out.items():
        if k not in owner:
            close = difflib.get_close_matches(k, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; options: {', '.join(known)}"
            raise ConfigError(f"{what}: unknown option {k!r}{hint}")
        want = type(field_default(owner[k], k))
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            out[k] = v = float(v)
        if not isinstance(v, want) or (want is int and isinstance(v, bool)):
            raise ConfigError(f"{what}: option {k} must be of type {want.__name__}, got {v!r}")
    return out
