"""Source adapters behind one registry: ``SOURCES.get("word")(root, images=...)``."""

from __future__ import annotations

import click

from spar_bench.registry import Registry

from .base import IMAGE_MODES, Source

SOURCES: Registry[type[Source]] = Registry("source")
SOURCES.register_lazy("word", "spar_bench.builder.sources.word:WordSource")
SOURCES.register_lazy("lits", "spar_bench.builder.sources.lits:LitsSource")
SOURCES.register_lazy("totalsegmentator", "spar_bench.builder.sources.totalsegmentator:TotalSegmentatorSource")
SOURCES.register_lazy("totalsegmentator-predicted",
                      "spar_bench.builder.sources.ts_predicted:TotalSegmentatorPredictedSource")
SOURCES.register_lazy("nnunet", "spar_bench.builder.sources.nnunet:NnUNetSource")
SOURCES.register_lazy("phantom", "spar_bench.builder.sources.phantom:PhantomSource")

__all__ = ["SOURCES", "Source", "IMAGE_MODES", "sources_command"]


@click.command("sources")
def sources_command() -> None:
    """List every registered source and what it needs on disk."""
    for name in SOURCES.names():
        try:
            needs = SOURCES.get(name).needs
        except Exception as e:  # a broken plugin must not hide the others
            needs = f"(cannot import: {type(e).__name__}: {e})"
        click.echo(f"{name:<18} {needs}")
