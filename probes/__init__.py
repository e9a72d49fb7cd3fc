"""SPAR-Bench probes: cache an encoder's token features once, train many light heads.

Importing this package is cheap; torch is imported inside the commands that use it.
"""

from spar_bench import __version__  # one version for the distribution

__all__ = ["__version__"]
