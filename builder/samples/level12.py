"""Level 1 (localisation) and Level 2 (arrangement) mosaic samples.

Level 1 sample ``i`` of a case
------------------------------
* A case gives Level 1/2 samples only when at least ``l12_min_organs`` organs (default 8)
  have an eligible slice (are present); otherwise it gives none (a LiTS case, liver only;
  a scan whose field of view holds a few organs): a mosaic of k present tiles has
  exact-permutation chance ``1/k!``, so a one-tile mosaic would be a free Level 2 item.
* rng = ``np.random.default_rng(derive_seed(global_seed, source, case_id, "level1", i))``.
* For each organ in class order that is present in the case: the eligible slices are
  those whose organ area (native pixels) is ``>= tile_min_area_frac *`` the organ's
  largest slice area; one is drawn with ``rng.choice``. Absent organs draw nothing.
* Tile = the organ's bounding box on that slice in the 224 frame (from the nearest-
  resampled labels), cut from the windowed image, every pixel outside the organ's
  mask set to 0, resized (bilinear, antialiased: the arithmetic of torch's
  ``interpolate(antialias=True)``, in numpy, :mod:`.resample`) so that its longer side is 56 pixels,
  keeping the aspect ratio, centred on a black 56x56 tile. Should a tiny organ vanish
  under resampling, the tile is the single pixel at its centroid.
* Mosaic = 4x4 tiles, row-major, tile ``i`` shows organ ``i``.
* ``centroid[i]`` = the organ's centroid on that slice at native resolution mapped into
  the 224 frame, ``(x, y) = (col, row) / 224``. Absent organ: black tile,
  ``present`` False, centroid NaN, ``slice_index`` -1.

Level 2 sample ``i``
--------------------
* The same tiles, centroids and slices as Level 1 sample ``i`` (drawn with the
  Level 1 seed); ``seed`` = ``derive_seed(..., "level2", i)`` draws the permutation
  ``perm`` (``perm[p]`` = organ at mosaic position ``p``).
* ``target_slot[p]`` = slot of organ ``perm[p]`` in the centroid-based arrangement of the
  PRESENT organs (``-1`` for absent ones):

  - ``rows-by-y``: sort by y, cut into rows of 4 in that order (the last row may be
    shorter), sort each row by x; slot = rank in that reading order;
  - ``rank-x``: rank by x; ``rank-y``: rank by y.

  Ties are broken by organ index. ``present_pos = present[perm]``.
"""

from __future__ import annotations

import numpy as np

from spar_bench.seeding import derive_seed

from ..case import Case
from ..schema import IMAGE_SIZE, LEVEL_SPECS, LEVELS, N_ORGANS, TILE_GRID, TILE_SIZE
from .config import SampleConfig
from .frame224 import Frame224, ResampledSlices, SliceStats
from .resample import resize_aa


def eligible_tile_slices(stats: SliceStats, frac: float) -> list[np.ndarray]:
    """Per organ (class order), the slice indices eligible for a tile (empty if absent)."""
    out = []
    for o in range(N_ORGANS):
        area = stats.area_px[:, o + 1]
        peak = area.max()
        out.append(
            np.flatnonzero((area > 0) & (area >= frac * peak))
            if peak > 0
            else np.empty(0, np.int64)
        )
    return out


def draw_tile_slices(eligible: list[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    """One slice per present organ (class order); -1 for absent organs."""
    out = np.full(N_ORGANS, -1, dtype=np.int64)
    for o, zs in enumerate(eligible):
        if len(zs):
            out[o] = zs[rng.integers(len(zs))]
    return out


def plan_level12(
    case: Case, stats: SliceStats, config: SampleConfig, global_seed: int
) -> np.ndarray:
    """The tile slices of every Level 1/2 sample: ``(samples_per_case, 16)`` int64, -1 absent.

    ``(0, 16)`` (no sample) when fewer than ``config.l12_min_organs`` organs are present.
    """
    eligible = eligible_tile_slices(stats, config.tile_min_area_frac)
    if sum(len(zs) > 0 for zs in eligible) < config.l12_min_organs:
        return np.empty((0, N_ORGANS), dtype=np.int64)
    draws = np.empty((config.samples_per_case, N_ORGANS), dtype=np.int64)
    for i in range(config.samples_per_case):
        rng = np.random.default_rng(
            derive_seed(global_seed, case.source, case.case_id, "level1", i)
        )
        draws[i] = draw_tile_slices(eligible, rng)
    return draws


def make_tile(
    image: np.ndarray, label: np.ndarray, organ_id: int, fallback_xy: tuple[float, float]
) -> np.ndarray:
    """A 56x56 uint8 tile of organ ``organ_id`` from one windowed 224 slice (see module doc)."""

    inside = label == organ_id
    rows = np.flatnonzero(inside.any(axis=1))
    cols = np.flatnonzero(inside.any(axis=0))
    if len(rows) == 0:  # vanished under resampling: one pixel at the centroid
        x, y = (int(np.clip(round(v), 0, image.shape[0] - 1)) for v in fallback_xy)
        crop = image[y : y + 1, x : x + 1]
    else:
        r0, r1, c0, c1 = rows[0], rows[-1] + 1, cols[0], cols[-1] + 1
        crop = np.where(inside[r0:r1, c0:c1], image[r0:r1, c0:c1], np.uint8(0))
    h, w = crop.shape
    scale = TILE_SIZE / max(h, w)
    nh, nw = max(1, min(TILE_SIZE, round(h * scale))), max(1, min(TILE_SIZE, round(w * scale)))
    resized = np.clip(np.rint(resize_aa(crop, nh, nw)), 0, 255).astype(np.uint8)
    tile = np.zeros((TILE_SIZE, TILE_SIZE), dtype=np.uint8)
    top, left = (TILE_SIZE - nh) // 2, (TILE_SIZE - nw) // 2
    tile[top : top + nh, left : left + nw] = resized
    return tile


def compose_mosaic(tiles: np.ndarray) -> np.ndarray:
    """``(16, 56, 56)`` tiles -> ``(224, 224)`` mosaic, tile ``k`` at row ``k // 4``, col ``k % 4``."""
    grid = tiles.reshape(TILE_GRID, TILE_GRID, TILE_SIZE, TILE_SIZE)
    return grid.transpose(0, 2, 1, 3).reshape(IMAGE_SIZE, IMAGE_SIZE)


def arrangement_slots(centroid: np.ndarray, present: np.ndarray, arrangement: str) -> np.ndarray:
    """Slot of each organ (class order) in the centroid-based arrangement; -1 if absent.

    ``centroid`` is ``(16, 2)`` (x, y); ties are broken by organ index.
    """
    idx = np.flatnonzero(present)
    x, y = centroid[idx, 0], centroid[idx, 1]
    if arrangement == "rank-x":
        order = idx[np.lexsort((idx, x))]
    elif arrangement == "rank-y":
        order = idx[np.lexsort((idx, y))]
    elif arrangement == "rows-by-y":
        by_y = np.lexsort((idx, y))
        parts = []
        for start in range(0, len(idx), TILE_GRID):
            row = by_y[start : start + TILE_GRID]
            parts.append(row[np.lexsort((idx[row], x[row]))])
        order = idx[np.concatenate(parts)] if parts else idx
    else:
        raise ValueError(f"unknown arrangement {arrangement!r}")
    slots = np.full(N_ORGANS, -1, dtype=np.int16)
    slots[order] = np.arange(len(order), dtype=np.int16)
    return slots


def _provenance(case: Case, n: int, is_mirror: bool) -> dict[str, np.ndarray]:
    return {
        "source": np.full(n, case.source, dtype=object),
        "case_id": np.full(n, case.case_id, dtype=object),
        "patient_id": np.full(n, case.patient, dtype=object),
        "split": np.full(n, case.split, dtype=object),
        "is_mirror": np.full(n, is_mirror, dtype=bool),
    }


def _key(case: Case, level: str, index: int) -> str:
    return f"{case.source}/{case.case_id}/{level}/{index:05d}"


def build_level12(
    case: Case,
    draws: np.ndarray,
    frame: Frame224,
    stats: SliceStats,
    slices: ResampledSlices,
    config: SampleConfig,
    global_seed: int,
    *,
    is_mirror: bool = False,
) -> dict[str, dict[str, np.ndarray]]:
    """Level 1 and/or Level 2 arrays (``config.levels``) for the planned ``draws``."""
    n = len(draws)
    present = np.zeros((n, N_ORGANS), dtype=bool)
    centroid = np.full((n, N_ORGANS, 2), np.nan, dtype=np.float32)
    mosaics = np.zeros((n, IMAGE_SIZE, IMAGE_SIZE), dtype=np.uint8)
    tiles_all = np.zeros((n, N_ORGANS, TILE_SIZE, TILE_SIZE), dtype=np.uint8)
    cache: dict[tuple[int, int], np.ndarray] = {}
    for i in range(n):
        for o in range(N_ORGANS):
            z = int(draws[i, o])
            if z < 0:
                continue
            row, col = stats.centroid_rc[z, o + 1]
            x, y = frame.to_frame(row, col)
            present[i, o] = True
            centroid[i, o] = (x / IMAGE_SIZE, y / IMAGE_SIZE)
            if (z, o) not in cache:
                r = int(slices.rows(z))
                cache[(z, o)] = make_tile(
                    slices.image[r], slices.label[r], o + 1, (float(x), float(y))
                )
            tiles_all[i, o] = cache[(z, o)]
        mosaics[i] = compose_mosaic(tiles_all[i])
    mpp = np.full(n, frame.mm_per_pixel, dtype=np.float32)
    suffix = "/mirror" if is_mirror else ""
    out: dict[str, dict[str, np.ndarray]] = {}
    for level in (lv for lv in LEVELS if lv in config.levels and LEVEL_SPECS[lv].mosaic):
        keys = [_key(case, level, i) for i in range(n)]
        seeds = np.array(
            [derive_seed(global_seed, case.source, case.case_id, level, i) for i in range(n)],
            dtype=np.int64,
        )
        rec = {
            "key": np.array([k + suffix for k in keys], dtype=object),
            **_provenance(case, n, is_mirror),
            "sample_index": np.arange(n, dtype=np.int32),
            "seed": seeds,
            "present": present.copy(),
            "centroid": centroid.copy(),
            "slice_index": draws.astype(np.int32),
            "mm_per_pixel": mpp.copy(),
            "origin_key": np.array(keys if is_mirror else [""] * n, dtype=object),
        }
        if LEVEL_SPECS[level].shuffled:
            rec.update(_shuffled(seeds, centroid, present, tiles_all, config.arrangement, mosaics))
        else:
            rec["image"] = mosaics
        out[level] = rec
    return out


def _shuffled(
    seeds: np.ndarray,
    centroid: np.ndarray,
    present: np.ndarray,
    tiles: np.ndarray,
    arrangement: str,
    empty: np.ndarray,
) -> dict[str, np.ndarray]:
    """The fields of a shuffled mosaic level (Level 2): tiles permuted by each sample's seed.

    ``perm[i]`` lists the organ in each slot; ``target_slot`` is the ``arrangement`` slot of
    the organ in each slot; ``present_pos`` is ``present`` in slot order; ``image`` the
    permuted mosaics (``empty`` when there are no samples).
    """
    n = len(seeds)
    perms = (
        np.stack([np.random.default_rng(int(s)).permutation(N_ORGANS) for s in seeds])
        if n
        else np.zeros((0, N_ORGANS), np.int64)
    )
    target = (
        np.stack([arrangement_slots(centroid[i], present[i], arrangement)[perms[i]] for i in range(n)])
        if n
        else np.zeros((0, N_ORGANS), np.int16)
    )
    return {
        "perm": perms.astype(np.int16),
        "target_slot": target.astype(np.int16),
        "present_pos": np.take_along_axis(present, perms, axis=1),
        "image": np.stack([compose_mosaic(tiles[i][perms[i]]) for i in range(n)]) if n else empty,
    }
