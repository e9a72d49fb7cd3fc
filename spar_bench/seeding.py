"""Seeds that depend on what a sample is, never on when or where it was made.

Every random choice of the builder draws from ``np.random.default_rng(seed)`` where
``seed = derive_seed(global_seed, source, case_id, level, index)``. The seed is
stored with the sample, so any sample can be regenerated alone, and the output is
identical whatever the number of workers or the processing order.
"""

from __future__ import annotations

import hashlib

import numpy as np


def derive_seed(global_seed: int, *parts: object) -> int:
    """A 63-bit seed from the global seed and the parts naming one sample.

    ``derive_seed(0, "word", "word_0014", "level1", 3)`` is stable across Python
    versions, platforms and processes (it hashes with SHA-256, not ``hash()``).
    """
    text = "\x1f".join([str(int(global_seed)), *(str(p) for p in parts)])
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def rng_for(global_seed: int, *parts: object) -> tuple[int, np.random.Generator]:
    """``(seed, Generator)`` for the sample named by ``parts``."""
    seed = derive_seed(global_seed, *parts)
    return seed, np.random.default_rng(seed)
