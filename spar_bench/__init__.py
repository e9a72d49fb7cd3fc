"""SPAR-Bench: probes of spatial anatomical reasoning in abdominal CT encoders.

The distribution installs one import package, ``spar_bench``:

* ``spar_bench`` itself (the ``spar_bench/`` folder) is the small shared core: errors,
  registries, hashing, seeding, what outputs may be replaced, provenance, CLI plumbing;
* ``spar_bench.builder`` (the ``builder/`` folder) builds the benchmark (``spar-build``);
* ``spar_bench.probes`` (the ``probes/`` folder) caches features and trains heads
  (``spar-probe``);
* ``spar_bench.manifests`` (the ``manifests/`` folder) holds the label maps, read through
  :mod:`importlib.resources` so an installed wheel works from any directory.

Importing it is cheap: heavy libraries are imported inside the functions that need them.
"""

__version__ = "0.2.0.dev0"
