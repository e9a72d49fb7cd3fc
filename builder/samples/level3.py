"""Level 3: whole windowed slices and the questions asked about them.

Slices
------
Eligibility is per probe; every slice considered has ``z % l3_stride == 0``.

* Organ probes (relative_position, orientation, symmetry, size, distance): at least
  ``l3_min_organs`` organs cover ``>= l3_min_area_mm2`` on the slice (native area = pixel
  count x row spacing x column spacing). Only those organs ("eligible") take part.
* counting (cases with a lesion channel only): the slice shows at least one organ of
  ``>= l3_min_area_mm2`` or at least one counted lesion component, whatever its organ
  count. A slice eligible only for counting carries only the counting question.

A Level 3 slice is a slice eligible for at least one probe.
Image (windowed uint8), label (canonical ids, nearest) and lesion (0/1, nearest) are
stored in the case's 224 frame. Key index = ``z``; the slice's seed is
``derive_seed(global_seed, source, case_id, "level3", z)`` and its rng draws every
question of the slice (stored as ``q_seed``).

Measurements are at NATIVE resolution: areas in mm^2, centroids in mm (voxel index x
spacing) for distances and directions; centroids are also mapped into the 224 frame
(``q_centroid_*``, pixels, ``(x, y) = (col, row)``).

Questions (probes in ``LEVEL3_PROBES`` order; each at most ``l3_questions_per_probe``
per slice, drawn without replacement with the slice's rng from the candidates listed
in a fixed order: organs by index, pairs ``(a, b)`` with ``a < b``, axis 0 before 1;
for pair probes the A/B order is then swapped with probability 1/2):

* relative_position: candidates (pair, axis) whose centroid separation on that axis is
  ``>= rel_margin_mm``. Axis 0: answer 1 iff A is to the patient's LEFT of B (A's column
  is larger). Axis 1: answer 1 iff A is ANTERIOR of B (A's row is smaller).
* orientation: pairs whose centroids are ``>= rel_margin_mm`` apart. ``d_left = colB -
  colA``, ``d_ant = rowA - rowB`` (mm); ``angle = atan2(d_ant, d_left)``; sector =
  ``round(angle / 45 deg) mod 8`` (half to even): 0 left, 1 left-anterior, 2 anterior,
  3 right-anterior, 4 right, 5 right-posterior, 6 posterior, 7 left-posterior.
* symmetry: each ``BILATERAL_PAIRS`` pair with both members eligible. A = the member
  whose centroid has the larger column (the patient's left side; the left-named member
  on a tie), B = the other; ``d = (area_A - area_B) / ((area_A + area_B) / 2)``; answer
  0 if ``d > symmetry_band`` (left larger), 1 if ``|d| <= band``, 2 if ``d < -band``.
* size: an eligible organ A; ``q_area_a_mm2`` is measured, ``q_answer`` = -1 until
  :func:`spar_bench.builder.samples.apply_thresholds` (tertiles fixed on the training split).
* distance: a pair; ``q_distance_mm`` = centroid distance, ``q_answer`` = -1 until
  :func:`spar_bench.builder.samples.apply_thresholds`.
* counting (only when the case has a lesion mask): connected components (8-connectivity)
  of the slice's STORED 224 x 224 lesion mask with ``>= lesion_min_pixels`` pixels (protocol
  1.4: the image's terms; before, the native slice's components of ``>= lesion_min_voxels``
  voxels); ``q_count`` = n, answer ``min(n, 3)``; organs -1; one question per slice.

Every question is then answered again from the slice's stored 224 masks (:mod:`.pixels`,
``q_pixel_answer``) when the build finishes the answers, and dropped where that answer is
not its label (:mod:`.levels`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations

import numpy as np

from spar_bench.seeding import derive_seed

from ..case import Case
from ..schema import BILATERAL_PAIRS, LEVEL3_PROBES, organ_index
from .config import SampleConfig
from .frame224 import Frame224, ResampledSlices, SliceStats
from .pixels import count_components

PROBE_ID = {name: i for i, name in enumerate(LEVEL3_PROBES)}
QUESTION_FIELDS = (
    "q_key",
    "q_slice",
    "q_probe",
    "q_axis",
    "q_organ_a",
    "q_organ_b",
    "q_answer",
    "q_centroid_a",
    "q_centroid_b",
    "q_area_a_mm2",
    "q_area_b_mm2",
    "q_distance_mm",
    "q_count",
    "q_seed",
)


def area_mm2(stats: SliceStats, spacing: tuple[float, float, float]) -> np.ndarray:
    """``(Z, 16)`` organ areas in mm^2 per slice (class order)."""
    return stats.area_px[:, 1:] * (float(spacing[1]) * float(spacing[2]))


def organ_probe_slices(stats: SliceStats, spacing: tuple[float, float, float], config: SampleConfig) -> np.ndarray:
    """Per slice: eligible for the organ probes (``l3_min_organs`` organs of ``l3_min_area_mm2``)."""
    eligible = area_mm2(stats, spacing) >= config.l3_min_area_mm2
    return eligible.sum(axis=1) >= config.l3_min_organs


def counting_slices(
    stats: SliceStats, spacing: tuple[float, float, float], lesion: np.ndarray | None, config: SampleConfig
) -> np.ndarray:
    """Per slice: eligible for counting (lesion channel, and an organ or a counted lesion on it)."""
    n_z = stats.area_px.shape[0]
    if lesion is None:
        return np.zeros(n_z, dtype=bool)
    any_organ = (area_mm2(stats, spacing) >= config.l3_min_area_mm2).any(axis=1)
    has_lesion = lesion.reshape(n_z, -1).any(axis=1)
    for z in np.flatnonzero(has_lesion & ~any_organ):
        has_lesion[z] = count_lesions(lesion[z], config.lesion_min_voxels) > 0
    return any_organ | has_lesion


def plan_level3(
    stats: SliceStats,
    spacing: tuple[float, float, float],
    config: SampleConfig,
    lesion: np.ndarray | None = None,
) -> np.ndarray:
    """Slice indices of the Level 3 slices of a case (sorted): eligible for at least one probe."""
    ok = organ_probe_slices(stats, spacing, config) | counting_slices(stats, spacing, lesion, config)
    zs = np.flatnonzero(ok)
    return zs[zs % config.l3_stride == 0]


def orientation_sector(d_left: float, d_ant: float) -> int:
    """Sector 0..7 of the direction ``(d_left, d_ant)`` (patient frame; see module doc)."""
    return int(round(math.atan2(d_ant, d_left) / (math.pi / 4))) % 8


def count_lesions(lesion_slice: np.ndarray, min_voxels: int) -> int:
    """8-connected lesion components with ``>= min_voxels`` voxels (or pixels) on one slice."""
    return count_components(lesion_slice, min_voxels)


def pick_candidates(rng: np.random.Generator, n_candidates: int, k: int) -> np.ndarray:
    if n_candidates == 0:
        return np.empty(0, dtype=np.int64)
    return np.sort(rng.choice(n_candidates, size=min(k, n_candidates), replace=False))


def pick_pairs(rng: np.random.Generator, cands: list[tuple], k: int) -> list[tuple]:
    """Up to ``k`` candidates ``(a, b, *rest)``, each with A/B swapped with probability 1/2.

    The random order makes both answers of an asymmetric question equally likely.
    """
    picks = pick_candidates(rng, len(cands), k)
    swaps = rng.random(len(picks)) < 0.5
    out = []
    for p, swap in zip(picks, swaps, strict=True):
        a, b, *rest = cands[p]
        out.append((b, a, *rest) if swap else (a, b, *rest))
    return out


@dataclass(frozen=True)
class _SliceOrgans:
    """One slice's organs as the question probes see them."""

    organs: list[int]  # organ indices that may be asked about (large enough, enough of them)
    area: np.ndarray  # (16,) area in mm^2
    row_mm: np.ndarray  # (16,) centroid row in mm (native grid)
    col_mm: np.ndarray  # (16,) centroid column in mm (native grid)
    fx: np.ndarray  # (16,) centroid x in the 224 frame
    fy: np.ndarray  # (16,) centroid y in the 224 frame

    def q(self, probe: str, a: int, b: int = -1, answer: int = -1, axis: int = -1, **extra) -> dict:
        """One question record; ``extra`` overrides the NaN / -1 defaults."""
        fx, fy = self.fx, self.fy
        rec = {
            "q_probe": PROBE_ID[probe],
            "q_axis": axis,
            "q_organ_a": a,
            "q_organ_b": b,
            "q_answer": answer,
            "q_centroid_a": (fx[a], fy[a]) if a >= 0 else (np.nan, np.nan),
            "q_centroid_b": (fx[b], fy[b]) if b >= 0 else (np.nan, np.nan),
            "q_area_a_mm2": np.nan,
            "q_area_b_mm2": np.nan,
            "q_distance_mm": np.nan,
            "q_count": -1,
        }
        rec.update(extra)
        return rec

    def gap_mm(self, a: int, b: int) -> float:
        """In-plane distance (mm) between the centroids of organs ``a`` and ``b``."""
        return math.hypot(self.col_mm[a] - self.col_mm[b], self.row_mm[a] - self.row_mm[b])


def _slice_organs(
    z: int,
    stats: SliceStats,
    spacing: tuple[float, float, float],
    frame: Frame224,
    config: SampleConfig,
) -> _SliceOrgans:
    """Areas and centroids of slice ``z``; no organ at all on a counting-only slice."""
    area = area_mm2(stats, spacing)[z]
    organs = [int(o) for o in np.flatnonzero(area >= config.l3_min_area_mm2)]
    if len(organs) < config.l3_min_organs:  # a counting-only slice: no organ probe here
        organs = []
    rc = stats.centroid_rc[z, 1:]  # (16, 2) native (row, col)
    row_mm, col_mm = rc[:, 0] * float(spacing[1]), rc[:, 1] * float(spacing[2])
    fx, fy = frame.to_frame(rc[:, 0], rc[:, 1])
    return _SliceOrgans(organs, area, row_mm, col_mm, fx, fy)


def _relative_position_qs(
    g: _SliceOrgans, pairs: list[tuple[int, int]], config: SampleConfig, rng: np.random.Generator
) -> list[dict]:
    """Is a left of b (axis 0) / anterior to b (axis 1)? Pairs at least ``rel_margin_mm`` apart."""
    col_mm, row_mm = g.col_mm, g.row_mm
    cands = [
        (a, b, axis)
        for a, b in pairs
        for axis in (0, 1)
        if abs((col_mm if axis == 0 else row_mm)[a] - (col_mm if axis == 0 else row_mm)[b])
        >= config.rel_margin_mm
    ]
    out = []
    for a, b, axis in pick_pairs(rng, cands, config.l3_questions_per_probe):
        ans = int(col_mm[a] > col_mm[b]) if axis == 0 else int(row_mm[a] < row_mm[b])
        out.append(g.q("relative_position", a, b, ans, axis))
    return out


def _orientation_qs(
    g: _SliceOrgans, pairs: list[tuple[int, int]], config: SampleConfig, rng: np.random.Generator
) -> list[dict]:
    """The compass sector of b seen from a, for pairs at least ``rel_margin_mm`` apart."""
    cands = [(a, b) for a, b in pairs if g.gap_mm(a, b) >= config.rel_margin_mm]
    out = []
    for a, b in pick_pairs(rng, cands, config.l3_questions_per_probe):
        sector = orientation_sector(g.col_mm[b] - g.col_mm[a], g.row_mm[a] - g.row_mm[b])
        out.append(g.q("orientation", a, b, sector))
    return out


def _symmetry_qs(g: _SliceOrgans, config: SampleConfig) -> list[dict]:
    """Left/right pairs both present: which side is larger, or similar (within the band)."""
    out: list[dict] = []
    area, col_mm = g.area, g.col_mm
    for left_name, right_name in BILATERAL_PAIRS:
        lo, ro = organ_index(left_name), organ_index(right_name)
        if len(out) >= config.l3_questions_per_probe or lo not in g.organs or ro not in g.organs:
            continue
        a, b = (ro, lo) if col_mm[ro] > col_mm[lo] else (lo, ro)
        d = (area[a] - area[b]) / ((area[a] + area[b]) / 2.0)
        ans = 0 if d > config.symmetry_band else (2 if d < -config.symmetry_band else 1)
        out.append(g.q("symmetry", a, b, ans, q_area_a_mm2=area[a], q_area_b_mm2=area[b]))
    return out


def slice_questions(
    z: int,
    stats: SliceStats,
    spacing: tuple[float, float, float],
    frame: Frame224,
    lesion: np.ndarray | None,
    config: SampleConfig,
    rng: np.random.Generator,
) -> list[dict]:
    """The questions of slice ``z`` as dicts (fields of :data:`QUESTION_FIELDS` minus keys/slice/seed).

    ``lesion``: the slice's 224 x 224 lesion mask as stored (None: the case has no lesion
    channel, no counting question); counting is measured on it (protocol 1.4).

    The probes draw from ``rng`` in this order: relative position, orientation, size,
    distance (symmetry and counting draw nothing).
    """
    g = _slice_organs(z, stats, spacing, frame, config)
    k = config.l3_questions_per_probe
    pairs = list(combinations(g.organs, 2))
    out = _relative_position_qs(g, pairs, config, rng)
    out += _orientation_qs(g, pairs, config, rng)
    out += _symmetry_qs(g, config)
    for p in pick_candidates(rng, len(g.organs), k):
        a = g.organs[p]
        out.append(g.q("size", a, q_area_a_mm2=g.area[a]))
    for a, b in pick_pairs(rng, pairs, k):
        out.append(g.q("distance", a, b, q_distance_mm=g.gap_mm(a, b)))
    if lesion is not None:
        n = count_lesions(lesion, config.lesion_min_pixels)
        out.append(g.q("counting", -1, -1, min(n, 3), q_count=n))
    return out


def empty_questions() -> dict[str, np.ndarray]:
    """A question table with no rows (the field dtypes of docs/FORMATS.md)."""
    return _questions_to_arrays([], [], [], [])


def _questions_to_arrays(
    rows: list[dict], keys: list[str], slice_rows: list[int], seeds: list[int]
) -> dict[str, np.ndarray]:
    def col(name: str, dtype) -> np.ndarray:
        return np.array([r[name] for r in rows], dtype=dtype)

    def pair(name: str) -> np.ndarray:
        return np.array([r[name] for r in rows], dtype=np.float32).reshape(len(rows), 2)

    return {
        "q_key": np.array(keys, dtype=object),
        "q_slice": np.array(slice_rows, dtype=np.int32),
        "q_probe": col("q_probe", np.int8),
        "q_axis": col("q_axis", np.int8),
        "q_organ_a": col("q_organ_a", np.int8),
        "q_organ_b": col("q_organ_b", np.int8),
        "q_answer": col("q_answer", np.int8),
        "q_centroid_a": pair("q_centroid_a"),
        "q_centroid_b": pair("q_centroid_b"),
        "q_area_a_mm2": col("q_area_a_mm2", np.float32),
        "q_area_b_mm2": col("q_area_b_mm2", np.float32),
        "q_distance_mm": col("q_distance_mm", np.float32),
        "q_count": col("q_count", np.int16),
        "q_seed": np.array(seeds, dtype=np.int64),
    }


def build_level3(
    case: Case,
    zs: np.ndarray,
    frame: Frame224,
    stats: SliceStats,
    slices: ResampledSlices,
    config: SampleConfig,
    global_seed: int,
    *,
    is_mirror: bool = False,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(slices, questions) arrays of the Level 3 slices ``zs`` of ``case``."""
    suffix = "/mirror" if is_mirror else ""
    n = len(zs)
    base_keys = [f"{case.source}/{case.case_id}/level3/{int(z):05d}" for z in zs]
    seeds = [derive_seed(global_seed, case.source, case.case_id, "level3", int(z)) for z in zs]
    rows, qkeys, qslice, qseed = [], [], [], []
    r = slices.rows(zs) if n else np.empty(0, dtype=np.int64)
    for s, (z, seed) in enumerate(zip(zs, seeds, strict=True)):
        rng = np.random.default_rng(seed)
        lesion = None if case.lesion is None else slices.lesion[r[s]]
        qs = slice_questions(int(z), stats, case.spacing, frame, lesion, config, rng)
        for j, rec in enumerate(qs):
            rows.append(rec)
            qkeys.append(f"{base_keys[s]}{suffix}/q{j:03d}")
            qslice.append(s)
            qseed.append(seed)
    slice_arrays = {
        "key": np.array([k + suffix for k in base_keys], dtype=object),
        "source": np.full(n, case.source, dtype=object),
        "case_id": np.full(n, case.case_id, dtype=object),
        "patient_id": np.full(n, case.patient, dtype=object),
        "split": np.full(n, case.split, dtype=object),
        "slice_index": np.asarray(zs, dtype=np.int32),
        "seed": np.array(seeds, dtype=np.int64),
        "image": slices.image[r],
        "label": slices.label[r],
        "lesion": slices.lesion[r],
        "mm_per_pixel": np.full(n, frame.mm_per_pixel, dtype=np.float32),
        "is_mirror": np.full(n, is_mirror, dtype=bool),
        "origin_key": np.array(base_keys if is_mirror else [""] * n, dtype=object),
    }
    return slice_arrays, _questions_to_arrays(rows, qkeys, qslice, qseed)
