"""Read a feature cache written by ``spar-probe cache`` (layout: docs/FORMATS.md).

>>> fc = FeatureCache("cache/resnet50.h5")
>>> fc.check_matches(Build("shards/"))           # ConfigError if the cache is of other shards
>>> X = fc.pooled("level1", "train")             # (N, D) float32
>>> T = fc.tokens("level1", "train", rows=idx)   # (len(idx), T, D), in the order of idx

Random rows are read one sample (one chunk) at a time in sorted order, which is 50-100x
faster than h5py fancy indexing on chunked datasets (measured during development;
``bench/cache.py`` times random minibatch reads of a finished cache).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from spar_bench.errors import ConfigError, IntegrityError

from .token_storage import TokenStorage, dequantise_int8

#: the cache file's top-level groups that are not levels (docs/FORMATS.md)
NOT_LEVELS = ("token_projection",)

if TYPE_CHECKING:  # pragma: no cover
    from spar_bench.builder.shards import Build

_JSON_ATTRS = ("encoder_config", "weights", "versions", "layers", "cache_args", "token_storage", "tile_layout",
               "token_grid")
#: the cache's ``dtype`` attribute -> numpy float dtype (int8 tokens are returned in it)
STORAGE_FLOAT = {"fp16": "float16", "fp32": "float32"}


def _read_rows(path: Path, level: str, split: str, ds, rows: np.ndarray | None) -> np.ndarray:
    """``ds[rows]`` in the order of ``rows``, read one chunk (row) at a time in sorted order."""
    if rows is None:
        return ds[()]
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    n = ds.shape[0]
    if rows.size and (rows.min() < -n or rows.max() >= n):
        raise IndexError(f"{path}: {level}/{split} rows out of range [0, {n})")
    rows = rows % n if rows.size else rows
    uniq, inverse = np.unique(rows, return_inverse=True)
    if uniq.size == 0:
        return np.zeros((0, *ds.shape[1:]), dtype=ds.dtype)
    out = np.empty((uniq.size, *ds.shape[1:]), dtype=ds.dtype)
    for i, r in enumerate(uniq):
        ds.read_direct(out, np.s_[int(r)], np.s_[i])
    return out[inverse.reshape(-1)]


class FeatureCache:
    """A finished feature cache (``complete=True``), opened read-only.

    Attributes:
        path: the cache file.
        meta: every root attribute, JSON strings decoded.
        fingerprint: the fingerprint of the build it was made from.
        random_init: True if the encoder was randomly initialised (never report it as a model).
    """

    def __init__(self, path: str | Path, *, require_complete: bool = True):
        import h5py

        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"{self.path}: no such feature cache; make it with `spar-probe cache`")
        try:
            self._f = h5py.File(self.path, "r")
        except OSError as e:
            raise IntegrityError(f"{self.path}: unreadable feature cache ({e}); delete it and rerun `spar-probe cache`") from None
        meta: dict[str, Any] = {}
        for k, v in self._f.attrs.items():
            if isinstance(v, bytes):
                v = v.decode()
            if isinstance(v, np.generic):
                v = v.item()
            if k in _JSON_ATTRS and isinstance(v, str):
                v = json.loads(v)
            meta[k] = v
        self.meta = meta
        for k in ("dataset_fingerprint", "encoder", "layers", "complete"):
            if k not in meta:
                raise IntegrityError(f"{self.path}: not a SPAR-Bench feature cache (no {k!r} attribute)")
        if require_complete and not meta["complete"]:
            self._f.close()
            raise IntegrityError(
                f"{self.path}: incomplete feature cache (interrupted); rerun the same "
                "`spar-probe cache` command to finish it"
            )
        self.fingerprint: str = meta["dataset_fingerprint"]
        self.random_init: bool = bool(meta.get("random_init", False))
        self.encoder: str = meta["encoder"]
        #: ``mosaic`` (Levels 1-2 encoded whole; also every cache older than the option) or
        #: ``per-tile`` (each tile alone, token sets stacked: ``meta["tile_layout"]``)
        self.tile_encoding: str = str(meta.get("tile_encoding") or "mosaic")

    def __repr__(self) -> str:
        ri = ", random-init" if self.random_init else ""
        return f"FeatureCache({str(self.path)!r}, encoder={self.encoder!r}{ri})"

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> FeatureCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self) -> dict:
        raise TypeError("FeatureCache holds an open HDF5 file; pass its path to worker processes instead")

    # -- structure -----------------------------------------------------------------------
    def levels(self) -> list[str]:
        """The cached levels (not the file's other groups: ``token_projection``)."""
        return sorted(k for k in self._f.keys() if k not in NOT_LEVELS)

    def splits(self, level: str) -> list[str]:
        return sorted(self._group(level).keys())

    def layers(self) -> list[int]:
        return [int(v) for v in self.meta["layers"]]

    def _group(self, level: str, split: str | None = None, layer: int | None = None):
        if level not in self._f:
            raise ConfigError(f"{self.path}: no level {level!r}; levels: {', '.join(self.levels())}")
        g = self._f[level]
        if split is None:
            return g
        if split not in g:
            raise ConfigError(f"{self.path}: {level} has no split {split!r}; splits: {', '.join(self.splits(level))}")
        g = g[split]
        if layer is None:
            return g
        name = f"layer{int(layer)}"
        if name not in g:
            raise ConfigError(f"{self.path}: no layer {layer} cached; layers: {self.layers()}")
        return g[name]

    def count(self, level: str, split: str) -> int:
        return int(self._group(level, split)["key"].shape[0])

    def dim(self, layer: int = -1) -> int:
        lv = self.levels()[0]
        return int(self._group(lv, self.splits(lv)[0], layer)["pooled"].shape[1])

    # -- data ----------------------------------------------------------------------------
    def keys(self, level: str, split: str) -> np.ndarray:
        raw = self._group(level, split)["key"][()]
        return np.asarray([k.decode() if isinstance(k, bytes) else str(k) for k in raw])

    def pooled(self, level: str, split: str, layer: int = -1) -> np.ndarray:
        """``(N, D)`` float32 pooled vectors, rows in the split's canonical order."""
        return self._group(level, split, layer)["pooled"][()].astype(np.float32, copy=False)

    def tokens(self, level: str, split: str, layer: int = -1, rows: np.ndarray | None = None) -> np.ndarray:
        """``(N, T, D)`` tokens (storage dtype: float16 or float32), or only ``rows`` in that order.

        Tokens stored as int8 (``--token-int8``) are dequantised with their per-row channel
        scales and returned in the cache's float storage dtype.
        """
        g = self._group(level, split, layer)
        toks = _read_rows(self.path, level, split, g["tokens"], rows)
        if "token_scale" not in g:
            return toks

        scale = _read_rows(self.path, level, split, g["token_scale"], rows)
        return dequantise_int8(toks, scale, np.dtype(STORAGE_FLOAT.get(self.meta.get("dtype"), "float32")))

    def token_grid(self, level: str, layer: int = -1) -> list[int] | None:
        """``[n_prefix, D', H', W']`` of a 3-D encoder's stored token sets of ``level`` (its
        ``token_grid`` attribute: what token heads build 3-D position embeddings from), or
        None (2-D features: the heads' position embeddings are per token, as always)."""
        rec = self.meta.get("token_grid")
        if not isinstance(rec, dict) or level not in rec.get("levels", ()):
            return None
        grid = (rec.get("layers") or {}).get(str(int(layer)))
        if grid is None:
            raise ConfigError(f"{self.path}: no token grid recorded for layer {layer}; layers: {self.layers()}")
        return [int(rec.get("n_prefix", 0)), *(int(g) for g in grid)]

    @property
    def token_storage(self) -> dict[str, Any]:
        """How the tokens were reduced before storage (``{"grid", "proj", "int8"}``; all off by default)."""

        return TokenStorage.from_dict(self.meta.get("token_storage")).to_dict()

    @property
    def question_probe(self) -> str | None:
        """The probe a question cache was made for (``mllm:DIR@llm:N+q``: a row per question of
        that probe, :mod:`.question_rows`), or None for any other cache."""
        return ((self.meta.get("encoder_config") or {}).get("extra") or {}).get("question_probe")

    def check_probe(self, probe: str) -> None:
        """One line when this is a question cache of another probe than ``probe``."""
        mine = self.question_probe
        if mine is not None and mine != probe:
            raise ConfigError(f"{self.path}: a question cache made for {mine} (its rows are {mine}'s questions, "
                              f"each with its own prompt); it cannot train or score {probe}: make one with "
                              f"`spar-probe cache --probe {probe}`")

    def check_matches(self, build: Build) -> None:
        """Raise :class:`ConfigError` unless this cache was made from ``build``'s shards."""
        if build.fingerprint != self.fingerprint:
            raise ConfigError(
                f"feature cache {self.path} (dataset fingerprint {self.fingerprint[:16]}, made from "
                f"{self.meta.get('dataset_dir', '?')}) does not match the build {build.root} "
                f"(fingerprint {build.fingerprint[:16]}); recache with `spar-probe cache --data {build.root}`"
            )
