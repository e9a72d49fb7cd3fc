"""Probe, head and seed lists as every entry point takes them (``spar-probe``'s options, an
experiment's steps): ``all`` or names, repeated or comma-separated, each checked."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import click

from spar_bench.errors import ConfigError

from .tasks import get_probe, probe_names


def split_list(text: Sequence[str] | str) -> list[str]:
    """The names of a repeatable option whose values may be comma lists (``("a,b", "c")``)."""
    items = [text] if isinstance(text, str) else list(text)
    return [p.strip() for item in items for p in item.split(",") if p.strip()]


def names_all(text: Sequence[str] | str) -> bool:
    """Whether a ``--probe`` value asks for every probe (``all``, or nothing)."""
    names = split_list(text)
    return not names or "all" in names


def parse_probes(text: Sequence[str] | str, levels: list[str] | None = None) -> list[str]:
    """``all``, or probe names (comma-separated or repeated); validated against the probe specs.

    ``levels``: the levels the input holds (a cache's, a build's); ``all`` then means their
    probes only (a 2-D cache is not offered the opt-in Level 4 probes, nor a 3-D one Levels 1-3).
    """
    if names_all(text):
        if levels is None:
            return probe_names()
        skipped = [p for p in probe_names() if get_probe(p).level not in levels]
        if skipped:  # said in one line (README: "skipped with one line"), never silently
            lost = sorted({get_probe(p).level for p in skipped})
            click.echo(f"--probe all: {len(skipped)} probe(s) of {', '.join(lost)} skipped; this input holds "
                       f"{', '.join(levels) or 'no level'}", err=True)  # fmt: skip
        return [p for p in probe_names() if get_probe(p).level in levels]
    names = list(dict.fromkeys(split_list(text)))
    for n in names:
        get_probe(n)
    return names


def parse_heads(text: Sequence[str] | str) -> list[str]:
    """Head names (comma-separated or repeated), each checked (an unknown one names the close ones)."""
    from .heads import HEADS, head_input

    heads = list(dict.fromkeys(split_list(text)))
    if not heads:
        raise ConfigError(f"--head is empty; give one or more of {', '.join(HEADS.names())}")
    for h in heads:
        head_input(h)  # unknown head -> ConfigError with suggestions
    return heads


def parse_seeds(text: str | Sequence[int]) -> list[int]:
    """``"0,1,2"`` (or a list of ints) as seeds; a bad one is one line."""
    if not isinstance(text, str):
        text = ",".join(str(s) for s in text)
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--seeds must be comma-separated integers, got {text!r}") from None
    if not seeds:
        raise ConfigError("--seeds is empty")
    return seeds


def cache_levels(features: str | Path) -> list[str] | None:
    """The levels of the feature cache ``features``; None when it cannot be read (the run then
    names the problem in one line)."""
    from .features import FeatureCache

    try:
        with FeatureCache(features) as cache:
            return cache.levels()
    except Exception:  # noqa: BLE001 - the run's own checks say what is wrong with the file
        return None


def cache_probes(text: Sequence[str] | str, features: str | Path) -> list[str]:
    """:func:`parse_probes` for the cache ``features``: ``all`` is the probes of its levels, or
    of a question cache (``mllm:DIR@llm:N+q``) the one probe it was made for."""
    from .features import FeatureCache

    if names_all(text):
        try:
            with FeatureCache(features) as cache:
                if cache.question_probe:
                    return [cache.question_probe]
        except Exception:  # noqa: BLE001 - the run's own checks say what is wrong with the file
            pass
    return parse_probes(text, cache_levels(features))
