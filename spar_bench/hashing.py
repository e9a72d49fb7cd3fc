"""SHA-256 of inputs and outputs: one definition for the manifest, sources and weights."""

from __future__ import annotations

import hashlib
from pathlib import Path


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
