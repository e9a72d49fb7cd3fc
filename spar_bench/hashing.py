"""SHA-256 of inputs and outputs: one definition for the manifest, sources and weights, and
for records (configs, plans) as canonical JSON."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def sha256_json(value: Any, default: Callable[[Any], Any] | None = None) -> str:
    """Hex SHA-256 of ``value`` as JSON with sorted keys (ASCII, default separators): the same
    record gives the same digest whatever its dicts' order. ``default``: ``json.dumps``'s, for
    values JSON cannot hold (None: they are a TypeError)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=default).encode("utf-8")).hexdigest()


def sha256_file(path: str | Path, *, chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of a file, or of a folder (a DICOM series, a weights folder).

    A folder hashes its files' names and bytes, sorted by name, so renaming, adding or
    changing any file changes the digest.
    """
    path = Path(path)
    h = hashlib.sha256()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    for f in files:
        if path.is_dir():
            h.update(f.name.encode("utf-8") + b"\0")
        with open(f, "rb") as fh:
            while block := fh.read(chunk):
                h.update(block)
    return h.hexdigest()
