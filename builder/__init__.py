"""SPAR-Bench dataset builder.

Reads CT volumes and organ masks from many sources, brings every case into one
canonical patient frame (see :mod:`builder.schema`), and writes the samples of the
eight SPAR-Bench probes as sharded HDF5 and as a Hugging Face dataset.

Importing this package is cheap: heavy libraries (torch, SimpleITK, datasets) are
imported inside the functions that need them.
"""

__version__ = "0.1.0"
