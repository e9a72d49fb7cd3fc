"""Data files shipped with SPAR-Bench: ``labels/<source>.json``, each source's label map.

Read them with ``importlib.resources.files("spar_bench.manifests") / "labels" / NAME``
(see :mod:`spar_bench.builder.ontology`), never by a path relative to the checkout.
"""
