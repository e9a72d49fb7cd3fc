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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from spar_bench.errors import ConfigError

_KEY = "spar_bench.limit"


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
            choices: Sequence[Any] | None = None, flag: str | None = None) -> Any:
    """A dataclass field with its :class:`Limit` (``field(default=..., metadata=...)``)."""
    limit = Limit(lo, hi, tuple(choices) if choices is not None else None, flag)
    return dataclasses.field(default=default, metadata={_KEY: limit})


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
