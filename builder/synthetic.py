"""A build of N synthetic images for benchmarks on bare machines (numpy and h5py only).

:func:`write_synthetic_build` writes a real SPAR-Bench build folder (shards in the formats of
docs/FORMATS.md, keys, provenance fields, a manifest with sha256s and a fingerprint) whose
images are drawn in numpy: Level 1/2 mosaics of 16 blanked organ-like tiles and Level 3
windowed axial slices with a body outline and organ ellipses at CT-like grey levels. It needs
neither nibabel, SimpleITK, datasets nor hdf5plugin (``compression`` defaults to gzip), so a
GPU machine that has only torch and h5py can make a build of any size itself instead of
receiving one (``bench/cache.py --synthetic N``).

With ``levels`` including ``"level4"`` it also writes ``n_volumes`` Level 4 rows (the
fields of docs/FORMATS.md "Level 4": (S, S, S) uint8 ``image``/``label``/``lesion`` of
side ``volume_size``, with ``present``, ``centroid`` and ``volume_mm3`` measured on the
drawn label, and ``level4_questions`` whose fields are random but valid), so code that
reads volumes can be tested before any real Level 4 build exists. The Level 1-3 bytes do
not change when Level 4 is added.

The images are not anatomy: no label is meaningful, and the manifest says so
(``"synthetic": true``). Use it to measure speed, never to score a model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .schema import LEVEL4_N_CLASSES, LEVEL4_PROBES, LEVEL_SPECS, N_ORGANS, SCHEMA_VERSION
from .writers.hdf5 import ShardSink, n_shards_for, shard_name, volume_shard_rows, write_shard
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


def _volume(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One (image, label, lesion) cube of side ``size``: a body ellipsoid holding 4-16 organ
    ellipsoids (random canonical ids) and at most two lesion blobs (uint8 each)."""
    zz, yy, xx = (a / np.float32(size) for a in np.ogrid[:size, :size, :size])

    def ellipsoid(c, r) -> np.ndarray:
        return ((zz - c[0]) / r[0]) ** 2 + ((yy - c[1]) / r[1]) ** 2 + ((xx - c[2]) / r[2]) ** 2 <= 1.0

    body = ellipsoid((0.5, 0.5, 0.5), (0.55, 0.4, 0.45))
    label = np.zeros((size,) * 3, np.uint8)
    for organ in rng.choice(N_ORGANS, size=int(rng.integers(4, N_ORGANS + 1)), replace=False):
        label[ellipsoid(rng.uniform(0.25, 0.75, 3), rng.uniform(0.06, 0.2, 3)) & body] = organ + 1
    lesion = np.zeros_like(label)
    for _ in range(int(rng.integers(0, 3))):
        lesion[ellipsoid(rng.uniform(0.3, 0.7, 3), rng.uniform(0.03, 0.08, 3)) & body] = 1
    image = body * np.float32(110) + (label > 0) * rng.uniform(10, 80) + lesion * np.float32(30)
    image = image + rng.normal(0, 6, image.shape) * body
    return np.clip(image, 0, 255).astype(np.uint8), label, lesion


def _measures(label: np.ndarray, mm: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``present`` (16,), normalised (x, y, z) ``centroid`` (16, 3) (NaN when absent) and
    ``volume_mm3`` (16,) of one label cube, as docs/FORMATS.md defines them."""
    size = label.shape[0]
    flat = label.reshape(-1).astype(np.int64)
    counts = np.bincount(flat, minlength=N_ORGANS + 1)[1:N_ORGANS + 1]
    z, r, c = np.indices(label.shape).reshape(3, -1)
    sums = [np.bincount(flat, weights=(a + 0.5) / size, minlength=N_ORGANS + 1)[1:N_ORGANS + 1]
            for a in (c, r, z)]
    with np.errstate(invalid="ignore", divide="ignore"):
        centroid = np.stack(sums, axis=1) / counts[:, None]
    return counts > 0, centroid.astype(np.float32), (counts * mm ** 3).astype(np.float32)


def _level4_questions(rng: np.random.Generator, key: str, seed: int, present: np.ndarray) -> dict:
    """One volume's ``level4_questions``: one question per probe, random but valid
    (answers in each probe's classes, organs among the present ones); ``q_volume`` 0."""
    organs = np.flatnonzero(present)
    n = len(LEVEL4_PROBES)
    draw = rng.choice(organs, size=(n, 3)) if organs.size else np.full((n, 3), -1)
    uses = np.array([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 0, 0], [0, 0, 0]], bool)
    organ = np.where(uses, draw, -1).astype(np.int8)
    return {
        "q_key": np.array([f"{key}/q{j:03d}" for j in range(n)]),
        "q_volume": np.zeros(n, np.int32),
        "q_probe": np.arange(n, dtype=np.int8),
        "q_axis": np.array([rng.integers(0, 3)] + [-1] * (n - 1), np.int8),
        "q_organ_a": organ[:, 0], "q_organ_b": organ[:, 1], "q_organ_c": organ[:, 2],
        "q_answer": np.array([rng.integers(0, LEVEL4_N_CLASSES[p]) for p in LEVEL4_PROBES], np.int8),
        "q_seed": np.full(n, seed, np.int64),
        "q_measure_a": rng.uniform(1, 200, n).astype(np.float32),
        "q_measure_b": np.where(uses[:, 2], rng.uniform(1, 200, n), np.nan).astype(np.float32),
    }


def _level4_case(rng: np.random.Generator, index: int, split: str, size: int) -> tuple[dict, dict]:
    """(rows, questions) of one synthetic Level 4 volume (one row)."""
    case = f"synthetic_{index:05d}"
    key = f"synthetic/{case}/level4/0"
    image, label, lesion = _volume(rng, size)
    mm = 300.0 / size
    present, centroid, volume = _measures(label, mm)
    rows = {
        "key": np.array([key]), "source": np.array(["synthetic"]), "case_id": np.array([case]),
        "patient_id": np.array([case]), "split": np.array([split]), "seed": np.array([index], np.int64),
        "image": image[None], "label": label[None], "lesion": lesion[None],
        "has_lesion": np.array([bool(lesion.any())]),
        "mm_per_voxel": np.array([mm], np.float32), "origin_mm": np.zeros((1, 3), np.float32),
        "present": present[None], "centroid": centroid[None], "volume_mm3": volume[None],
        "is_mirror": np.zeros(1, bool), "is_flipped": np.zeros(1, bool), "origin_key": np.array([key]),
    }
    return rows, _level4_questions(rng, key, index, present)


def _write_level4(out: Path, n_volumes: int, *, seed: int, size: int, shard_size: int,
                  compression: str, split: str) -> tuple[list, dict]:
    """Level 4's shards (through the build's :class:`ShardSink`): (entries, counts)."""
    rng = np.random.default_rng([seed, 4])  # its own stream: Levels 1-3 draw as without it
    attrs = {"schema_version": SCHEMA_VERSION}
    sink = ShardSink(out, "level4", split, n_volumes, volume_shard_rows(shard_size, size), attrs,
                     compression=compression)
    n_q = 0
    for i in range(n_volumes):
        rows, questions = _level4_case(rng, i, split, size)
        sink.add(rows, questions)
        n_q += len(questions["q_key"])
    return sink.close(), {LEVEL_SPECS["level4"].unit: n_volumes, "questions": n_q}


def write_synthetic_build(
    out: str | Path, n_images: int, *, seed: int = 0, shard_size: int = 2000,
    compression: str = "gzip", split: str = "train", levels: tuple[str, ...] = tuple(LEVEL_SHARE),
    n_volumes: int = 4, volume_size: int = 32,
) -> Path:
    """Write a build of ``n_images`` synthetic images to ``out``; return ``out``.

    Deterministic: the same arguments give the same bytes. All images go to ``split``.
    ``levels`` (default Levels 1-3) may add ``"level4"``: ``n_volumes`` cubes of side
    ``volume_size`` (>= 8) with their questions; Levels 1-3 keep their bytes.
    """
    bad = sorted(set(levels) - set(LEVEL_SPECS))
    if bad or not levels:
        raise ValueError(f"levels must be a non-empty subset of {tuple(LEVEL_SPECS)}, got {levels}")
    if "level4" in levels and (volume_size < 8 or n_volumes < 1):
        raise ValueError(f"level4 needs volume_size >= 8 and n_volumes >= 1, got {volume_size}, {n_volumes}")
    out = Path(out)
    rng = np.random.default_rng(seed)
    shards: dict[str, dict[str, list]] = {}
    counts: dict[str, dict] = {}
    for level, share in LEVEL_SHARE.items():
        if level not in levels:
            continue
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
    config = {"n_images": n_images, "shard_size": shard_size, "compression": compression}
    if "level4" in levels:
        entries, counts["level4"] = _write_level4(out, n_volumes, seed=seed, size=volume_size,
                                                  shard_size=shard_size, compression=compression, split=split)
        shards["level4"], counts["level4"] = {split: entries}, {split: counts["level4"]}
        config.update(n_volumes=n_volumes, volume_size=volume_size)
    write_manifest(out, {
        "schema_version": SCHEMA_VERSION, "synthetic": True, "seed": seed, "config": config,
        "levels": [lv for lv in LEVEL_SPECS if lv in levels], "shards": shards, "hf": None, "counts": counts,
    })
    return out
