"""Synthetic images: the pseudo-CT renderer (:mod:`.render`).

It serves the procedural phantom (:mod:`spar_bench.builder.phantom`) and the sources' masks-only
cases (``--images synthesize``): both import it from here, so neither depends on the other.
"""
