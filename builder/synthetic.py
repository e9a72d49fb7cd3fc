"""A build of N synthetic images for benchmarks on bare machines (numpy and h5py only).

:func:`write_synthetic_build` writes a real SPAR-Bench build folder (shards in the formats of
docs/FORMATS.md, keys, provenance fields, a manifest with sha256s and a fingerprint) whose
images are drawn in numpy: Level 1/2 mosaics of 16 blanked organ-like tiles and Level 3
windowed axial slices with a body outline and organ ellipses at CT-like grey levels. It needs
neither nibabel, SimpleITK, datasets nor hdf5plugin (``compression`` defaults to gzip), so a
GPU machine that has only torch and h5py can make a build of any size itself instead of
receiving one (``bench/cache.py --synthetic N``).

The images are not anatomy: no label is meaningful, and the manifest says so
(``"synthetic": true``). Use it to measure speed, never to score a model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .schema import LEVEL_SPECS, N_ORGANS, SCHEMA_VERSION
from .writers.hdf5 import n_shards_for, shard_name, write_shard
from .writers.manifest import write_manifest

IMAGE = 224
TILE = 56
#: Share of the images per level (mosaics of Level 1 and 2, slices of Level 3).
LEVEL_SHARE = {"level1": 0.25, "level2": 0.25, "level3": 0.5}


def _ellipse(h: int, w: int, cy: float, cx: float, ry: float, rx: float) -> np.ndarray:
    yy, xx = np.ogrid[:h, :w]
    return ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 <= 1.0


def _slice(rng: np.random.Generator) -> np.ndarray:
    """One windowed 224x224 'axial slice': air, body, organs, noise (uint8)."""
    img = np.zeros((IMAGE, IMAGE), np.float32)
    body = _ellipse(IMAGE, IMAGE, 112 + rng.normal(0, 4), 112, rng.uniform(70, 90), rng.uniform(95, 108))
    img[body] = 110
    for _ in range(rng.integers(4, 9)):
        organ = _ellipse(IMAGE, IMAGE, rng.uniform(60, 170), rng.uniform(40, 184),
                         rng.uniform(8, 30), rng.uniform(8, 35)) & body
        img[organ] = rng.uniform(120, 190)
    img += rng.normal(0, 6, img.shape) * body
    return np.clip(img, 0, 255).astype(np.uint8)


def _mosaic(rng: np.random.Generator) -> np.ndarray:
    """One 4x4 mosaic of 56x56 tiles, each an organ-like blob with the rest blanked."""
    img = np.zeros((IMAGE, IMAGE), np.uint8)
    for i in range(N_ORGANS):
        r, c = divmod(i, 4)
        blob = _ellipse(TILE, TILE, 28, 28, rng.uniform(10, 27), rng.uniform(10, 27))
        tile = (rng.uniform(110, 190) + rng.normal(0, 6, (TILE, TILE))) * blob
        img[r * TILE:(r + 1) * TILE, c * TILE:(c + 1) * TILE] = np.clip(tile, 0, 255)
    return img


def _fields(level: str, split: str, lo: int, n: int, rng: np.random.Generator) -> dict:
    draw = _mosaic if LEVEL_SPECS[level].mosaic else _slice
    idx = np.arange(lo, lo + n)
    case = np.array([f"synthetic_{i // 16:05d}" for i in idx])
    return {
        "key": np.array([f"synthetic/{c}/{level}/{i:05d}" for c, i in zip(case, idx, strict=True)]),
        "source": np.full(n, "synthetic"), "case_id": case, "patient_id": case,
        "split": np.full(n, split), "seed": idx.astype(np.int64),
        "image": np.stack([draw(rng) for _ in range(n)]) if n else np.zeros((0, IMAGE, IMAGE), np.uint8),
        "is_mirror": np.zeros(n, bool), "origin_key": np.full(n, ""),
        "mm_per_pixel": np.full(n, 1.6, np.float32),
    }


def write_synthetic_build(
    out: str | Path, n_images: int, *, seed: int = 0, shard_size: int = 2000,
    compression: str = "gzip", split: str = "train",
) -> Path:
    """Write a build of ``n_images`` synthetic images to ``out``; return ``out``.

    Deterministic: the same ``n_images``, ``seed``, ``shard_size`` and ``compression`` give
    the same bytes. All images go to ``split``.
    """
    out = Path(out)
    rng = np.random.default_rng(seed)
    shards: dict[str, dict[str, list]] = {}
    counts: dict[str, dict] = {}
    for level, share in LEVEL_SHARE.items():
        n_level = int(round(n_images * share))
        entries, written = [], 0
        n_files = n_shards_for(n_level, shard_size)
        for i in range(n_files):
            n = min(shard_size, n_level - written)
            name = shard_name(split, i, n_files)
            fields = _fields(level, split, written, n, rng)
            attrs = {"level": level, "split": split, "shard": i, "n_shards": n_files,
                     "n_rows": n, "n_questions": 0, "schema_version": SCHEMA_VERSION}
            sha = write_shard(out / level / name, fields, attrs, compression)
            entries.append({"path": f"{level}/{name}", "sha256": sha, "rows": n, "questions": 0})
            written += n
        shards[level] = {split: entries}
        counts[level] = {split: {LEVEL_SPECS[level].unit: n_level}}
    write_manifest(out, {
        "schema_version": SCHEMA_VERSION, "synthetic": True, "seed": seed,
        "config": {"n_images": n_images, "shard_size": shard_size, "compression": compression},
        "levels": list(LEVEL_SHARE), "shards": shards, "hf": None, "counts": counts,
    })
    return out
