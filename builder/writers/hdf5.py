"""Sharded HDF5 writer: ``OUT/<level>/<split>-NNNNN-of-MMMMM.h5`` (docs/FORMATS.md).

* Images (``image``, ``label``, ``lesion``) are uint8, chunked ONE SAMPLE PER CHUNK
  (a 224x224 image, or a whole (S, S, S) Level 4 volume) and compressed with
  blosc-zstd (hdf5plugin) by default: fast random reads.
  ``compression="gzip"|"lzf"|"none"`` writes shards that plain h5py reads, without
  hdf5plugin (a bare GPU machine); the bytes differ, the arrays do not.
* Everything else is small and stored contiguous, uncompressed.
* Strings are fixed-length UTF-8.
* Bytes are reproducible: no object timestamps (``track_times=False``), fixed
  ``libver``, datasets and attributes created in sorted order.
* Level 3 and 4: a row (slice, volume) and all its questions land in the same shard; the
  questions' row field (``q_slice``, ``q_volume``: ``LevelSpec.row_field``) indexes the
  shard's own rows.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from spar_bench.errors import SparError
from spar_bench.outputs import write_bytes

from ..schema import IMAGE_FIELDS, LEVEL_SPECS

LIBVER = ("earliest", "v110")
#: Image compressions: blosc needs hdf5plugin to write and read; the others are built into h5py.
COMPRESSIONS = ("blosc", "gzip", "lzf", "none")


def _image_filter(compression: str) -> dict[str, Any]:
    """h5py ``create_dataset`` keywords of one image compression."""
    if compression == "blosc":
        import hdf5plugin

        return dict(hdf5plugin.Blosc(cname="zstd", clevel=5, shuffle=hdf5plugin.Blosc.NOSHUFFLE))
    if compression == "gzip":
        return {"compression": "gzip", "compression_opts": 4}
    if compression == "lzf":
        return {"compression": "lzf"}
    if compression == "none":
        return {}
    raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")


#: A Level 4 shard holds at most this many voxels per volume field (128 MiB of uint8 each:
#: 64 volumes of 128^3, 512 of 64^3): its rows stay in memory until it is written.
VOLUME_SHARD_VOXELS = 2**27


def volume_shard_rows(shard_size: int, side: int) -> int:
    """Volumes per shard: ``shard_size``, at most :data:`VOLUME_SHARD_VOXELS` voxels of
    (side, side, side) cubes, at least one."""
    return max(1, min(shard_size, VOLUME_SHARD_VOXELS // side**3))


def row_field(level: str) -> str:
    """The questions' pointer into ``level``'s rows (``LevelSpec.row_field``: ``q_slice``,
    ``q_volume``); ``q_slice`` for a level the schema does not know."""
    spec = LEVEL_SPECS.get(level)
    return spec.row_field if spec is not None else "q_slice"


def shard_name(split: str, index: int, n_shards: int) -> str:
    """``train-00003-of-00012.h5``."""
    return f"{split}-{index:05d}-of-{n_shards:05d}.h5"


def n_shards_for(n_rows: int, shard_size: int) -> int:
    """Number of shards for ``n_rows`` rows (at least one, so an empty split still has a file)."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    return max(1, math.ceil(n_rows / shard_size))


def _encode(name: str, arr: np.ndarray) -> np.ndarray:
    import h5py

    arr = np.asarray(arr)
    if arr.dtype.kind in ("U", "O"):
        enc = np.array([str(v).encode("utf-8") for v in arr.reshape(-1)], dtype=object)
        width = max([len(b) for b in enc] + [1])
        return np.array(enc.tolist(), dtype=f"S{width}").reshape(arr.shape).astype(
            h5py.string_dtype("utf-8", width)
        )
    return arr


def write_shard(
    path: str | Path, fields: Mapping[str, np.ndarray], attrs: Mapping[str, Any],
    compression: str = "blosc",
) -> str:
    """Write one shard reproducibly; return its sha256.

    HDF5 builds the file in memory (:func:`spar_bench.h5files.h5_image`) and Python writes
    it: a full disk is one ``OSError`` naming the shard, never a failed write inside HDF5.
    """
    from spar_bench.h5files import h5_image

    def fill(f) -> None:
        for name in sorted(fields):
            arr = _encode(name, fields[name])
            kw: dict[str, Any] = {"track_times": False}
            if name in IMAGE_FIELDS and arr.ndim in (3, 4):  # (N, H, W) images, (N, S, S, S) volumes
                kw.update(chunks=(1, *arr.shape[1:]), maxshape=(None, *arr.shape[1:]),
                          **_image_filter(compression))
            f.create_dataset(name, data=arr, **kw)
        for key in sorted(attrs):
            f.attrs[key] = attrs[key]

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image = h5_image(fill, libver=LIBVER, track_order=False)
    write_bytes(path, image)
    return hashlib.sha256(image).hexdigest()


def _concat(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if len(parts) == 1:
        return dict(parts[0])
    return {k: np.concatenate([p[k] for p in parts], axis=0) for k in parts[0]}


def _rows(d: Mapping[str, np.ndarray]) -> int:
    return len(next(iter(d.values()))) if d else 0


class ShardSink:
    """Streams cases of one (level, split) into shards of ``shard_size`` rows.

    ``add(rows, questions)`` appends one case's rows (samples, slices or volumes) and, for
    a level with questions, its questions (the row field ``q_slice`` / ``q_volume``,
    :attr:`~spar_bench.builder.schema.LevelSpec.row_field`, relative to that case's rows).
    Full shards are written as soon as they fill, so memory stays at about one shard.
    ``n_rows`` (the split's total, known from the per-case index) fixes the shard count up front.
    """

    def __init__(
        self,
        out_dir: str | Path,
        level: str,
        split: str,
        n_rows: int,
        shard_size: int,
        attrs: Mapping[str, Any],
        compression: str = "blosc",
    ):
        self.out_dir, self.level, self.split = Path(out_dir), level, split
        self.compression = compression
        self.n_rows, self.shard_size = n_rows, shard_size
        self.n_shards = n_shards_for(n_rows, shard_size)
        self.attrs = dict(attrs)
        self.row_field = row_field(level)
        self.entries: list[dict[str, Any]] = []
        self._rows: list[dict[str, np.ndarray]] = []
        self._qs: list[dict[str, np.ndarray]] = []
        self._buffered = 0
        self._written = 0
        self._template: dict[str, np.ndarray] | None = None
        self._qtemplate: dict[str, np.ndarray] | None = None

    def add(self, rows: Mapping[str, np.ndarray], questions: Mapping[str, np.ndarray] | None = None) -> None:
        n = _rows(rows)
        if self._template is None and rows:
            self._template = {k: np.asarray(v)[:0] for k, v in rows.items()}
        if questions is not None and self._qtemplate is None and questions:
            self._qtemplate = {k: np.asarray(v)[:0] for k, v in questions.items()}
        if n == 0:
            return
        rows = {k: np.asarray(v) for k, v in rows.items()}
        self._rows.append(rows)
        if questions is not None and questions:
            q = {k: np.asarray(v) for k, v in questions.items()}
            q[self.row_field] = q[self.row_field].astype(np.int64) + self._buffered
            self._qs.append(q)
        self._buffered += n
        while self._buffered >= self.shard_size and len(self.entries) < self.n_shards - 1:
            self._flush(self.shard_size)

    def _flush(self, n: int) -> None:
        rows = _concat(self._rows) if self._rows else dict(self._template or {})
        head = {k: v[:n] for k, v in rows.items()}
        tail = {k: v[n:] for k, v in rows.items()}
        qhead = None
        if self._qtemplate is not None:
            qs = _concat(self._qs) if self._qs else dict(self._qtemplate)
            row = self.row_field
            keep = qs[row] < n
            qhead = {k: v[keep] for k, v in qs.items()}
            qhead[row] = qhead[row].astype(np.int32)
            qtail = {k: v[~keep] for k, v in qs.items()}
            qtail[row] = qtail[row] - n
            self._qs = [qtail] if _rows(qtail) else []
        self._rows = [tail] if _rows(tail) else []
        self._buffered -= min(n, self._buffered)
        index = len(self.entries)
        fields = dict(head)
        if qhead is not None:
            fields.update(qhead)
        n_q = _rows(qhead) if qhead is not None else 0
        attrs = dict(self.attrs, level=self.level, split=self.split, shard=index,
                     n_shards=self.n_shards, n_rows=_rows(head), n_questions=n_q)
        name = shard_name(self.split, index, self.n_shards)
        sha = write_shard(self.out_dir / self.level / name, fields, attrs, self.compression)
        self._written += _rows(head)
        self.entries.append({"path": f"{self.level}/{name}", "sha256": sha,
                             "rows": _rows(head), "questions": n_q})

    def close(self) -> list[dict[str, Any]]:
        """Write the remaining shard(s); return the manifest entries of every shard."""
        if self._template is None:
            raise SparError(f"{self.level}/{self.split}: no case produced any field; nothing to write")
        while len(self.entries) < self.n_shards:
            self._flush(self.shard_size)
        if self._written != self.n_rows or self._buffered:
            raise SparError(
                f"{self.level}/{self.split}: wrote {self._written} rows but the case index "
                f"announced {self.n_rows}; the work dir is inconsistent - rebuild with --overwrite"
            )
        return self.entries
