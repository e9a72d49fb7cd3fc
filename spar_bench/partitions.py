"""Splitting work into N partitions by a hash of each item's id: ``--partition I/N``.

Used for cases of a build (``spar-build --partition``) and runs of a sweep
(``spar-probe sweep --partition``). An item belongs to partition
``int(sha256(id)) mod N``: no coordination between machines, the same answer whatever
order the items are listed in, and every item in exactly one partition.
"""

from __future__ import annotations

import hashlib

from .errors import ConfigError


def parse_partition(text: str | None, option: str = "--partition") -> tuple[int, int] | None:
    """``"2/8"`` -> ``(2, 8)`` with ``0 <= I < N``; None or ``""`` -> None."""
    if text is None or text == "":
        return None
    i, sep, n = str(text).partition("/")
    try:
        part = (int(i), int(n))
    except ValueError:
        part = None
    if not sep or part is None or part[1] < 1 or not 0 <= part[0] < part[1]:
        raise ConfigError(f"{option} {text!r}: give I/N with 0 <= I < N, e.g. 0/4")
    return part


def bucket(item_id: str, n: int) -> int:
    """The partition (0..n-1) of the item called ``item_id``."""
    return int(hashlib.sha256(item_id.encode("utf-8")).hexdigest(), 16) % n
