"""Writers of a SPAR-Bench build: sharded HDF5, the Hugging Face folder, the manifest.

Importing this package is cheap; h5py / pyarrow are imported inside the writers.
"""

from __future__ import annotations

__all__ = ["hdf5", "hf", "manifest"]
