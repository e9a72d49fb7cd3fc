"""SPAR-Bench dataset builder.

Reads CT volumes and organ masks from many sources, brings every case into one
canonical patient frame (see :mod:`spar_bench.builder.schema`), and writes the samples of the
eight SPAR-Bench probes as sharded HDF5 and as a Hugging Face dataset.

Importing this package is cheap: heavy libraries (torch, SimpleITK, datasets) are
imported inside the functions that need them.
"""

from spar_bench import __version__  # one version for the distribution

__all__ = ["__version__"]
