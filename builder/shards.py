"""Read a finished SPAR-Bench build: the one reader every probe uses.

>>> b = Build("shards/")
>>> b.levels(), b.splits("level3"), b.count("level3", "test")
>>> q = b.read("level3", "test", ["q_slice", "q_probe", "q_answer"])   # q_slice -> split rows
>>> for offset, batch in b.iter_images("level1", "train", batch_size=256): ...
>>> b.images("level2", "val", np.array([17, 3, 900]))                 # random access

Rows of a split are the concatenation of its shards in file-name order (the canonical
order, see docs/FORMATS.md). Random access loops over sorted indices one sample at a
time: with one sample per chunk this is 50-100x faster than h5py fancy indexing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from spar_bench.errors import ConfigError, IntegrityError

from .schema import LEVELS, ordered_splits
from .writers.hdf5 import row_field
from .writers.manifest import fingerprint, read_manifest, shard_entries

#: Datasets that are rows of a level's question table (Level 3, 4), not of its row table.
QUESTION_PREFIX = "q_"


BLOSC_FILTER_ID = 32001


def _uses_blosc(f) -> bool:
    dset = f.get("image")
    if dset is None or not hasattr(dset, "id"):
        return False
    plist = dset.id.get_create_plist()
    return any(plist.get_filter(i)[0] == BLOSC_FILTER_ID for i in range(plist.get_nfilters()))


def open_shard(path: str | Path):
    """Open one HDF5 shard for reading: the one place that knows about compression filters.

    hdf5plugin is loaded when installed (blosc shards need it); gzip, lzf and uncompressed
    shards (``spar-build --compression``) read with plain h5py.
    """
    import h5py

    try:
        import hdf5plugin  # noqa: F401  (registers the blosc filter for reading)

        have_plugin = True
    except ImportError:
        have_plugin = False
    path = Path(path)
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise IntegrityError(f"{path}: cannot open shard ({e}); run `spar-build verify`") from None
    if not have_plugin and _uses_blosc(f):
        f.close()
        raise ConfigError(
            f"{path}: shard images are blosc-compressed and hdf5plugin is not installed; "
            "`pip install hdf5plugin`, or rebuild with --compression gzip|lzf|none"
        )
    return f


def _decode(arr: np.ndarray) -> np.ndarray:
    """h5py returns variable-length strings as bytes objects; give numpy unicode."""
    if arr.dtype.kind == "S":
        return np.char.decode(arr, "utf-8")
    if arr.dtype.kind == "O":
        return np.array([v.decode("utf-8") if isinstance(v, bytes) else v for v in arr], dtype=str)
    return arr


class Build:
    """A finished build folder (``OUT/`` with ``manifest.json``).

    Attributes:
        root: the build folder.
        manifest: the parsed ``manifest.json``.
        fingerprint: the build's fingerprint (sha256 over every shard's sha256);
            feature caches record it and heads compare it.

    Raises:
        ConfigError: ``manifest.json`` is missing, unreadable or incomplete.
        IntegrityError: the manifest's fingerprint does not match its own shard list.
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.manifest: dict[str, Any] = read_manifest(self.root)
        self.fingerprint: str = self.manifest["fingerprint"]
        if fingerprint(shard_entries(self.manifest)) != self.fingerprint:
            raise IntegrityError(
                f"{self.root / 'manifest.json'}: fingerprint does not match the shard list; "
                "the manifest was edited - rebuild or run `spar-build verify`"
            )
        self._files: dict[Path, Any] = {}
        self._row_cache: dict[tuple[str, str], np.ndarray] = {}

    # -- structure ---------------------------------------------------------------------
    def __repr__(self) -> str:
        return f"Build({str(self.root)!r}, fingerprint={self.fingerprint[:12]})"

    def levels(self) -> list[str]:
        """Levels present in this build, in ``LEVELS`` order."""
        have = self.manifest["shards"]
        return [lv for lv in LEVELS if lv in have] + sorted(set(have) - set(LEVELS))

    def splits(self, level: str) -> list[str]:
        """Splits of ``level`` (``train``, ``val``, ``test`` first, then any others)."""
        have = self._level(level)
        return ordered_splits(have)

    def _level(self, level: str) -> dict[str, list[dict]]:
        shards = self.manifest["shards"]
        if level not in shards:
            raise ConfigError(
                f"{self.root}: build has no {level!r}; levels: {', '.join(self.levels()) or 'none'}"
            )
        return shards[level]

    def _entries(self, level: str, split: str) -> list[dict]:
        splits = self._level(level)
        if split not in splits:
            raise ConfigError(
                f"{self.root}: {level} has no split {split!r}; splits: {', '.join(self.splits(level))}"
            )
        return sorted(splits[split], key=lambda e: e["path"])

    def shard_paths(self, level: str, split: str) -> list[Path]:
        """Shard files of one split in canonical (file-name) order."""
        paths = [self.root / e["path"] for e in self._entries(level, split)]
        for p in paths:
            if not p.is_file():
                raise IntegrityError(f"{p}: shard listed in manifest.json is missing; rebuild")
        return paths

    def _rows(self, level: str, split: str) -> np.ndarray:
        """Cumulative row offsets of the split's shards: ``[0, n0, n0+n1, ...]``."""
        key = (level, split)
        if key not in self._row_cache:
            counts = [int(e["rows"]) for e in self._entries(level, split)]
            self._row_cache[key] = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        return self._row_cache[key]

    def count(self, level: str, split: str) -> int:
        """Rows of a split: samples (Level 1/2), slices (Level 3) or volumes (Level 4)."""
        return int(self._rows(level, split)[-1])

    def count_questions(self, level: str, split: str) -> int:
        """Questions of a split (Level 3, 4; 0 for Level 1/2)."""
        return sum(int(e.get("questions", 0)) for e in self._entries(level, split))

    def fields(self, level: str, split: str) -> list[str]:
        """Dataset names stored in the split's shards."""
        paths = self.shard_paths(level, split)
        return sorted(self._file(paths[0]).keys()) if paths else []

    # -- reading -----------------------------------------------------------------------
    def _file(self, path: Path):
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = open_shard(path)
        return f

    def close(self) -> None:
        """Close every open shard (also done on ``with Build(...)`` exit)."""
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> Build:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self) -> dict:  # picklable for DataLoader workers: reopen lazily
        state = dict(self.__dict__)
        state["_files"] = {}
        return state

    def _dataset(self, path: Path, name: str):
        f = self._file(path)
        if name not in f:
            raise ConfigError(f"{path}: no field {name!r}; fields: {', '.join(sorted(f.keys()))}")
        return f[name]

    def read(self, level: str, split: str, fields: list[str] | None = None) -> dict[str, np.ndarray]:
        """Whole fields of a split, concatenated over shards in canonical order.

        Strings come back as numpy unicode arrays. For question fields (``q_*``) the
        level's row field (``q_slice`` for Level 3, ``q_volume`` for Level 4:
        ``LevelSpec.row_field``) is re-based from shard rows to split rows, so
        ``read(...)["image"][q["q_slice"]]`` is each question's slice.
        ``fields=None`` reads everything (images included: mind the memory).
        """
        paths = self.shard_paths(level, split)
        names = list(fields) if fields is not None else self.fields(level, split)
        offsets = self._rows(level, split)
        pointer = row_field(level)
        out: dict[str, np.ndarray] = {}
        for name in names:
            parts = []
            for i, path in enumerate(paths):
                arr = _decode(self._dataset(path, name)[()])
                if name == pointer:
                    arr = arr.astype(np.int64) + offsets[i]
                parts.append(arr)
            if parts:
                out[name] = np.concatenate(parts, axis=0)
            else:
                out[name] = np.zeros((0,), dtype=np.int64)
        return out

    def _locate(self, level: str, split: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        offsets = self._rows(level, split)
        n = int(offsets[-1])
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= n):
            bad = rows[(rows < 0) | (rows >= n)][0]
            raise IndexError(f"{self.root}: {level}/{split} row {bad} out of range [0, {n})")
        shard = np.searchsorted(offsets, rows, side="right") - 1
        return shard, rows - offsets[shard]

    def iter_images(
        self, level: str, split: str, batch_size: int, start: int = 0, field: str = "image"
    ) -> Iterator[tuple[int, np.ndarray]]:
        """``(row offset, uint8 (B, 224, 224))`` batches (Level 4: ``(B, S, S, S)`` volumes) in
        canonical order from ``start``.

        Batches span shard boundaries; every batch has ``batch_size`` rows but the last.
        Pass the offset of the first unwritten row as ``start`` to resume.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        paths = self.shard_paths(level, split)
        offsets = self._rows(level, split)
        n = int(offsets[-1])
        if not 0 <= start <= n:
            raise IndexError(f"{self.root}: {level}/{split} start {start} out of range [0, {n}]")
        for lo in range(start, n, batch_size):
            hi = min(lo + batch_size, n)
            parts = []
            for s in range(len(paths)):
                a, b = max(lo, offsets[s]), min(hi, offsets[s + 1])
                if a < b:
                    ds = self._dataset(paths[s], field)
                    parts.append(ds[a - offsets[s] : b - offsets[s]])
            yield lo, np.concatenate(parts, axis=0)

    def images(self, level: str, split: str, rows: np.ndarray, field: str = "image") -> np.ndarray:
        """Images at split rows ``rows`` (any order, repeats allowed), in that order.

        Reads each distinct row once, in sorted order, one sample per read.
        """
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        paths = self.shard_paths(level, split)
        uniq, inverse = np.unique(rows, return_inverse=True)
        shard, local = self._locate(level, split, uniq)
        if uniq.size == 0:
            ds = self._dataset(paths[0], field) if paths else None
            shape = ds.shape[1:] if ds is not None else (224, 224)
            return np.zeros((0, *shape), dtype=ds.dtype if ds is not None else np.uint8)
        got = [self._dataset(paths[s], field)[int(i)] for s, i in zip(shard, local, strict=True)]
        return np.stack(got)[inverse.reshape(-1)]
