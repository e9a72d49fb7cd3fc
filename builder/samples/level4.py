"""Level 4: whole volumes (:mod:`.volume`) and the questions asked about them.

Every measurement is made on the STORED cube (isotropic grid, mm = voxel index x
``mm_per_voxel``), so a mask oracle reading the stored label volume can score 100%:

* organ voxel count n, ``volume_mm3 = n x mm_per_voxel^3``, ``present`` = n >= 1;
  centroid = mean voxel index ``(z, row, col)``; in the row, normalised ``(x, y, z) =
  ((col + 0.5) / S, (row + 0.5) / S, (z + 0.5) / S)`` (NaN when absent);
* an organ TAKES PART in questions when it has >= ``l4_min_voxels`` voxels.

Questions (probes in ``LEVEL4_PROBES`` order; at most ``l4_questions_per_probe`` per probe
and volume, drawn without replacement with the volume's rng from candidates listed in a
fixed order: organs by index, pairs ``(a, b)`` with ``a < b``, triplets ``(a, b, c)`` with
``b < c``, axes 0, 1, 2; for pair probes A/B are then swapped with probability 1/2, for
distance B/C). The rng draws in this order: relative_position, distance, volume,
adjacency, containment. ``q_measure_a`` / ``q_measure_b`` hold what the answer was
computed from (NaN when unused):

* relative_position: (pair, axis) whose centroid separation on the axis is ``>=
  rel_margin_mm``. Axis 0: 1 iff A is to the patient's LEFT (larger col); axis 1: 1 iff
  A is ANTERIOR (smaller row); axis 2: 1 iff A is SUPERIOR (larger z). Measure a: the
  signed separation (mm) towards the asked side (``colA - colB``, ``rowB - rowA``,
  ``zA - zB``): > 0 iff the answer is 1.
* distance: triplets; 0 iff ``|AB| < |AC|``, 1 iff ``|AC| < |AB|`` (centroids, mm);
  skipped when ``||AB| - |AC|| < rel_margin_mm``. Measures ``|AB|``, ``|AC|``.
* volume: pairs; 1 iff ``vol(A) > vol(B)``; skipped when ``|vA - vB| / mean <=
  symmetry_band``. Measures vA, vB (mm^3).
* symmetry: each ``BILATERAL_PAIRS`` pair taking part: A = the member with the larger
  centroid col (the left-named one on a tie); ``d = (vA - vB) / mean``; 0 if ``d > band``,
  1 if ``|d| <= band``, 2 if ``d < -band``. Measures vA, vB.
* adjacency: pairs; ``gap = max(0, min distance between voxel centres of A and B -
  mm_per_voxel)``; 1 iff ``gap <= adjacency_mm``, 0 iff ``gap > 3 x adjacency_mm``,
  skipped in between. Measure a = gap (mm).
* containment (lesion channel): the largest counted lesion component (26-connectivity,
  >= ``lesion_min_voxels``; ties: the first in ``scipy.ndimage.label`` order); its
  container = the organ holding > 50% of its voxels, which must take part. Questions
  (container, 1) then (another organ taking part drawn with the rng, 0). Measures: the
  fraction of the component's voxels inside organ A, the component's volume (mm^3).
* counting (lesion channel): components (26-connectivity) with >= ``lesion_min_voxels``
  voxels; answer ``min(n, 3)``; measure a = n; one per volume.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations

import numpy as np

from spar_bench.errors import CaseError
from spar_bench.seeding import derive_seed

from ..case import Case
from ..schema import BILATERAL_PAIRS, LEVEL4_PROBES, N_ORGANS, organ_index
from .config import SampleConfig
from .frame224 import check_labels
from .level3 import pick_candidates, pick_pairs
from .volume import Volume, reflect, volume_for_case

PROBE_ID = {name: i for i, name in enumerate(LEVEL4_PROBES)}
#: ``reach`` of the adjacency search, in units of ``adjacency_mm`` (the "no" threshold).
FAR_FACTOR = 3.0
STRUCTURE_26 = np.ones((3, 3, 3), dtype=bool)


@dataclass(frozen=True)
class VolumeOrgans:
    """The organs of one stored cube as the questions see them.

    Attributes:
        counts: (16,) voxel counts.
        centroid_vox: (16, 3) mean voxel index (z, row, col); NaN when absent.
        mm_per_voxel: the cube's voxel size.
        organs: organ indices taking part (>= ``l4_min_voxels`` voxels), ascending.
        box_lo, box_hi: (16, 3) inclusive voxel bounding box (z, row, col) of each organ
            (lo = S, hi = -1 when absent).
    """

    counts: np.ndarray
    centroid_vox: np.ndarray
    mm_per_voxel: float
    organs: list[int]
    box_lo: np.ndarray
    box_hi: np.ndarray

    @property
    def volume_mm3(self) -> np.ndarray:
        return self.counts * self.mm_per_voxel**3

    @property
    def centroid_mm(self) -> np.ndarray:
        """(16, 3) centroid (z, row, col) in mm of the cube frame."""
        return self.centroid_vox * self.mm_per_voxel

    def dist_mm(self, a: int, b: int) -> float:
        """Euclidean distance (mm) between the centroids of organs ``a`` and ``b``."""
        d = self.centroid_mm[a] - self.centroid_mm[b]
        return math.sqrt(float(d @ d))


def organ_measures(label: np.ndarray, mm_per_voxel: float, min_voxels: int) -> VolumeOrgans:
    """Voxel counts, centroids and boxes of the 16 organs in the cube ``label`` (S, S, S) (integer
    sums: exact, order-free)."""
    n_labels = N_ORGANS + 1
    size = label.shape[0]
    sums = np.zeros((n_labels, 3), dtype=np.float64)
    counts = np.zeros(n_labels, dtype=np.int64)
    idx = np.arange(size, dtype=np.int64)
    box_lo = np.full((n_labels, 3), size, dtype=np.int64)
    box_hi = np.full((n_labels, 3), -1, dtype=np.int64)
    for ax in range(3):
        lab = np.moveaxis(label, ax, 0).reshape(size, -1).astype(np.int64)
        hist = np.bincount((idx[:, None] * n_labels + lab).ravel(), minlength=size * n_labels)
        hist = hist.reshape(size, n_labels)  # (index on axis ax, label) voxel counts
        sums[:, ax] = idx @ hist
        counts = hist.sum(axis=0)
        hit = hist > 0
        box_lo[:, ax] = np.where(hit.any(axis=0), hit.argmax(axis=0), size)
        box_hi[:, ax] = np.where(hit.any(axis=0), size - 1 - hit[::-1].argmax(axis=0), -1)
    with np.errstate(invalid="ignore", divide="ignore"):
        centroid = sums[1:] / counts[1:, None]
    centroid[counts[1:] == 0] = np.nan
    organs = [int(o) for o in np.flatnonzero(counts[1:] >= min_voxels)]
    return VolumeOrgans(
        counts[1:].astype(np.int64), centroid, float(mm_per_voxel), organs, box_lo[1:], box_hi[1:]
    )


def lesion_components(lesion: np.ndarray, min_voxels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(labels, counted, sizes)``: 26-connected components, the ids (``scipy.ndimage.label``
    order) of those with >= ``min_voxels`` voxels, and their voxel counts."""
    from scipy import ndimage

    labels, n = ndimage.label(lesion > 0, structure=STRUCTURE_26)
    sizes = np.bincount(labels.ravel(), minlength=n + 1)
    sizes[0] = 0  # background
    counted = np.flatnonzero(sizes >= min_voxels)
    return labels, counted, sizes[counted]


def _min_distance(label: np.ndarray, a: int, lo: np.ndarray, hi: np.ndarray, mpv: float) -> np.ndarray:
    """(17,) min distance (mm, voxel centres) from organ ``a`` to each label inside box ``lo..hi``.

    One Euclidean distance transform (``sampling = mm_per_voxel``) of the crop; labels not
    in the crop get +inf.
    """
    from scipy import ndimage

    crop = label[lo[0] : hi[0] + 1, lo[1] : hi[1] + 1, lo[2] : hi[2] + 1]
    dist = ndimage.distance_transform_edt(crop != a + 1, sampling=(mpv, mpv, mpv))
    out = np.full(N_ORGANS + 1, np.inf)
    np.minimum.at(out, crop.ravel(), dist.ravel())
    return out


def near_gaps(label: np.ndarray, g: VolumeOrgans, reach_mm: float) -> np.ndarray:
    """(16, 16) surface gaps (mm) of the organs taking part, exact where ``<= reach_mm``, else +inf.

    Per organ A one distance transform on A's box grown by ``reach_mm // mm_per_voxel + 2``
    voxels: a B voxel outside it lies more than ``reach_mm + mm_per_voxel`` from A.
    """
    mpv, size = g.mm_per_voxel, label.shape[0]
    grow = int(reach_mm // mpv) + 2
    gaps = np.full((N_ORGANS, N_ORGANS), np.inf)
    for a in g.organs:
        lo, hi = np.maximum(g.box_lo[a] - grow, 0), np.minimum(g.box_hi[a] + grow, size - 1)
        dmin = _min_distance(label, a, lo, hi, mpv)
        for b in g.organs:
            gap = max(0.0, float(dmin[b + 1]) - mpv)
            if b != a and gap <= reach_mm:
                gaps[a, b] = gaps[b, a] = gap
    return gaps


def exact_gap(label: np.ndarray, a: int, b: int, mpv: float, g: VolumeOrgans | None = None) -> float:
    """Surface gap (mm) of present organs ``a`` and ``b`` (0-based) of the cube ``label``: one
    distance transform on their joint box (the boxes of ``g`` when given, else measured)."""
    if g is None:
        g = organ_measures(label, mpv, 1)
    lo, hi = np.minimum(g.box_lo[a], g.box_lo[b]), np.maximum(g.box_hi[a], g.box_hi[b])
    dmin = _min_distance(label, a, lo, hi, mpv)
    return max(0.0, float(dmin[b + 1]) - mpv)


def _q(probe: str, a: int = -1, b: int = -1, answer: int = -1, **extra) -> dict:
    """One question record; ``extra`` sets ``q_axis``, ``q_organ_c``, the measures."""
    rec = {
        "q_probe": PROBE_ID[probe],
        "q_axis": -1,
        "q_organ_a": a,
        "q_organ_b": b,
        "q_organ_c": -1,
        "q_answer": answer,
        "q_measure_a": np.nan,
        "q_measure_b": np.nan,
    }
    rec.update(extra)
    return rec


def _relative_position_qs(g: VolumeOrgans, config: SampleConfig, rng: np.random.Generator) -> list[dict]:
    """Is A left of (axis 0) / anterior of (1) / superior of (2) B? Pairs >= ``rel_margin_mm`` apart."""
    c = g.centroid_mm  # (z, row, col)
    col_of_axis = (2, 1, 0)  # axis 0 left-right = col, 1 = row, 2 = z
    cands = [
        (a, b, axis)
        for a, b in combinations(g.organs, 2)
        for axis in (0, 1, 2)
        if abs(c[a, col_of_axis[axis]] - c[b, col_of_axis[axis]]) >= config.rel_margin_mm
    ]
    out = []
    for a, b, axis in pick_pairs(rng, cands, config.l4_questions_per_probe):
        ca, cb = c[a, col_of_axis[axis]], c[b, col_of_axis[axis]]
        sep = cb - ca if axis == 1 else ca - cb  # towards the patient's left / anterior / superior
        out.append(_q("relative_position", a, b, int(sep > 0), q_axis=axis, q_measure_a=sep))
    return out


def _distance_qs(g: VolumeOrgans, config: SampleConfig, rng: np.random.Generator) -> list[dict]:
    """Is A's centroid closer to B's (0) or C's (1)? Triplets whose distances differ by >= the margin."""
    cands = [
        (a, b, c)
        for a in g.organs
        for b, c in combinations([o for o in g.organs if o != a], 2)
        if abs(g.dist_mm(a, b) - g.dist_mm(a, c)) >= config.rel_margin_mm
    ]
    picks = pick_candidates(rng, len(cands), config.l4_questions_per_probe)
    swaps = rng.random(len(picks)) < 0.5
    out = []
    for p, swap in zip(picks, swaps, strict=True):
        a, b, c = cands[p]
        b, c = (c, b) if swap else (b, c)
        ab, ac = g.dist_mm(a, b), g.dist_mm(a, c)
        out.append(_q("distance", a, b, int(ac < ab), q_organ_c=c, q_measure_a=ab, q_measure_b=ac))
    return out


def _volume_qs(g: VolumeOrgans, config: SampleConfig, rng: np.random.Generator) -> list[dict]:
    """Is A larger than B? Pairs whose volumes differ by more than ``symmetry_band``."""
    v = g.volume_mm3
    cands = [
        (a, b)
        for a, b in combinations(g.organs, 2)
        if abs(v[a] - v[b]) / ((v[a] + v[b]) / 2.0) > config.symmetry_band
    ]
    return [
        _q("volume", a, b, int(v[a] > v[b]), q_measure_a=v[a], q_measure_b=v[b])
        for a, b in pick_pairs(rng, cands, config.l4_questions_per_probe)
    ]


def _symmetry_qs(g: VolumeOrgans, config: SampleConfig) -> list[dict]:
    """Bilateral pairs taking part: which side is larger by volume, or similar (within the band)."""
    out: list[dict] = []
    v, col = g.volume_mm3, g.centroid_vox[:, 2]
    for left_name, right_name in BILATERAL_PAIRS:
        lo, ro = organ_index(left_name), organ_index(right_name)
        if len(out) >= config.l4_questions_per_probe or lo not in g.organs or ro not in g.organs:
            continue
        a, b = (ro, lo) if col[ro] > col[lo] else (lo, ro)
        d = (v[a] - v[b]) / ((v[a] + v[b]) / 2.0)
        ans = 0 if d > config.symmetry_band else (2 if d < -config.symmetry_band else 1)
        out.append(_q("symmetry", a, b, ans, q_measure_a=v[a], q_measure_b=v[b]))
    return out


def _adjacency_qs(
    label: np.ndarray, g: VolumeOrgans, config: SampleConfig, rng: np.random.Generator
) -> list[dict]:
    """Do A and B touch (gap <= adjacency_mm), or lie far apart (gap > 3 x adjacency_mm)?"""
    adj = config.adjacency_mm
    gaps = near_gaps(label, g, FAR_FACTOR * adj)
    cands = [
        (a, b)
        for a, b in combinations(g.organs, 2)
        if gaps[a, b] <= adj or gaps[a, b] > FAR_FACTOR * adj
    ]
    out = []
    for a, b in pick_pairs(rng, cands, config.l4_questions_per_probe):
        gap = gaps[a, b] if np.isfinite(gaps[a, b]) else exact_gap(label, a, b, g.mm_per_voxel, g)
        out.append(_q("adjacency", a, b, int(gap <= adj), q_measure_a=gap))
    return out


def _containment_qs(
    vol: Volume, g: VolumeOrgans, comps: tuple[np.ndarray, np.ndarray, np.ndarray], rng: np.random.Generator
) -> list[dict]:
    """Is the largest lesion inside organ A? (container, yes) then (another organ, no)."""
    labels, counted, sizes = comps
    if len(counted) == 0:
        return []
    largest = counted[int(np.argmax(sizes))]  # the first of equal sizes in label order
    in_organ = np.bincount(vol.label[labels == largest], minlength=N_ORGANS + 1)[1:]
    n = int(sizes.max())
    container = int(np.argmax(in_organ))
    if 2 * in_organ[container] <= n or container not in g.organs:
        return []
    vox = g.mm_per_voxel**3
    out = [_q("containment", container, -1, 1, q_measure_a=in_organ[container] / n, q_measure_b=n * vox)]
    others = [o for o in g.organs if o != container]
    if others:
        o = others[int(rng.integers(len(others)))]
        out.append(_q("containment", o, -1, 0, q_measure_a=in_organ[o] / n, q_measure_b=n * vox))
    return out


def volume_questions(
    vol: Volume, g: VolumeOrgans, config: SampleConfig, rng: np.random.Generator
) -> list[dict]:
    """Every question of one stored cube, in ``LEVEL4_PROBES`` order (module docstring)."""
    out = _relative_position_qs(g, config, rng)
    out += _distance_qs(g, config, rng)
    out += _volume_qs(g, config, rng)
    out += _symmetry_qs(g, config)
    out += _adjacency_qs(vol.label, g, config, rng)
    if vol.has_lesion:
        comps = lesion_components(vol.lesion, config.lesion_min_voxels)
        out += _containment_qs(vol, g, comps, rng)
        n = len(comps[1])
        out.append(_q("counting", -1, -1, min(n, 3), q_measure_a=float(n)))
    return out


QUESTION_DTYPES = {
    "q_probe": np.int8,
    "q_axis": np.int8,
    "q_organ_a": np.int8,
    "q_organ_b": np.int8,
    "q_organ_c": np.int8,
    "q_answer": np.int8,
    "q_measure_a": np.float32,
    "q_measure_b": np.float32,
}


def questions_to_arrays(
    rows: list[dict], keys: list[str], volume_rows: list[int], seeds: list[int]
) -> dict[str, np.ndarray]:
    """The ``level4_questions`` table (docs/FORMATS.md field dtypes)."""
    out = {"q_key": np.array(keys, dtype=object), "q_volume": np.array(volume_rows, dtype=np.int32)}
    for name, dtype in QUESTION_DTYPES.items():
        out[name] = np.array([r[name] for r in rows], dtype=dtype)
    out["q_seed"] = np.array(seeds, dtype=np.int64)
    return out


def normalised_centroid(g: VolumeOrgans, size: int) -> np.ndarray:
    """(16, 3) float32 ``(x, y, z) = ((col + 0.5) / S, (row + 0.5) / S, (z + 0.5) / S)``; NaN absent."""
    return ((g.centroid_vox[:, ::-1] + 0.5) / size).astype(np.float32)


@dataclass(frozen=True)
class VolumeCopy:
    """One row to write: a stored cube and what it is (original, mirror or flip)."""

    vol: Volume
    is_mirror: bool = False
    is_flipped: bool = False

    @property
    def suffix(self) -> str:
        return "/mirror" if self.is_mirror else ("/flip" if self.is_flipped else "")


def _row(case_meta: dict, copy: VolumeCopy, g: VolumeOrgans, seed: int, base_key: str) -> dict:
    """One Level 4 row (module docstring; docs/FORMATS.md)."""
    vol, size = copy.vol, copy.vol.grid.size
    return {
        "key": base_key + copy.suffix,
        **case_meta,
        "seed": seed,
        "image": vol.image,
        "label": vol.label,
        "lesion": vol.lesion,
        "has_lesion": vol.has_lesion,
        "mm_per_voxel": vol.grid.mm_per_voxel,
        "origin_mm": np.asarray(vol.grid.origin_mm, dtype=np.float32),
        "present": g.counts > 0,
        "centroid": normalised_centroid(g, size),
        "volume_mm3": g.volume_mm3.astype(np.float32),
        "is_mirror": copy.is_mirror,
        "is_flipped": copy.is_flipped,
        "origin_key": base_key,
    }


ROW_DTYPES = {
    "key": object, "source": object, "case_id": object, "patient_id": object, "split": object,
    "seed": np.int64, "image": np.uint8, "label": np.uint8, "lesion": np.uint8, "has_lesion": bool,
    "mm_per_voxel": np.float32, "origin_mm": np.float32, "present": bool, "centroid": np.float32,
    "volume_mm3": np.float32, "is_mirror": bool, "is_flipped": bool, "origin_key": object,
}  # fmt: skip


def rows_to_arrays(rows: list[dict], size: int) -> dict[str, np.ndarray]:
    """The ``level4`` table of ``rows`` (an empty table with the right shapes when none)."""
    shapes = {
        "image": (size,) * 3, "label": (size,) * 3, "lesion": (size,) * 3, "origin_mm": (3,),
        "present": (N_ORGANS,), "centroid": (N_ORGANS, 3), "volume_mm3": (N_ORGANS,),
    }  # fmt: skip
    out = {}
    for name, dtype in ROW_DTYPES.items():
        if rows:
            out[name] = np.array([r[name] for r in rows], dtype=dtype)
        else:
            out[name] = np.empty((0, *shapes.get(name, ())), dtype=dtype)
    return out


def build_level4(
    case_meta: dict, copies: list[VolumeCopy], config: SampleConfig, seed: int, base_key: str
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(rows, questions) of one case's copies (original first), each drawn with ``seed``.

    ``case_meta``: the row's source, case_id, patient_id, split. ``q_volume`` is the copy's
    row index in the returned rows.
    """
    rows, qrows, qkeys, qvol = [], [], [], []
    for i, copy in enumerate(copies):
        g = organ_measures(copy.vol.label, copy.vol.grid.mm_per_voxel, config.l4_min_voxels)
        rows.append(_row(case_meta, copy, g, seed, base_key))
        qs = volume_questions(copy.vol, g, config, np.random.default_rng(seed))
        qrows += qs
        qkeys += [f"{base_key}{copy.suffix}/q{j:03d}" for j in range(len(qs))]
        qvol += [i] * len(qs)
    size = config.volume_size
    return rows_to_arrays(rows, size), questions_to_arrays(qrows, qkeys, qvol, [seed] * len(qrows))


def level4_seed(global_seed: int, source: str, case_id: str) -> int:
    """The seed of a case's Level 4 volume and of all its copies."""
    return derive_seed(global_seed, source, case_id, "level4", 0)


def case_level4(
    case: Case, config: SampleConfig, global_seed: int
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The ``level4`` rows and ``level4_questions`` of ``case``: its cube, then the mirrored
    copy (``counterfactual`` "mirror" or "mirror+flip") and the flipped copy ("mirror+flip").

    A case without any labelled voxel gives no row. Raises CaseError for a case without an
    image, with labels outside 0..16 or with a spacing <= 0.
    """

    if case.image is None:
        raise CaseError(
            case.case_id,
            None,
            "has no image; samples need one (use the source's images='synthesize' for masks-only data)",
        )
    check_labels(case, N_ORGANS + 1)
    if not all(float(sp) > 0 for sp in case.spacing):
        raise CaseError(case.case_id, None, f"voxel spacing must be > 0 mm on every axis, got {case.spacing}")
    vol = volume_for_case(
        case, config.volume_size, config.fov_margin_mm, config.window_level, config.window_width
    )
    copies = [] if vol is None else [VolumeCopy(vol)]
    if vol is not None and config.counterfactual in ("mirror", "mirror+flip"):
        extent = (case.shape[2] - 1) * float(case.spacing[2])
        copies.append(VolumeCopy(reflect(vol, 2, extent), is_mirror=True))
    if vol is not None and config.counterfactual == "mirror+flip":
        extent = (case.shape[0] - 1) * float(case.spacing[0])
        copies.append(VolumeCopy(reflect(vol, 0, extent), is_flipped=True))
    meta = {"source": case.source, "case_id": case.case_id, "patient_id": case.patient, "split": case.split}
    base_key = f"{case.source}/{case.case_id}/level4/0"
    return build_level4(meta, copies, config, level4_seed(global_seed, case.source, case.case_id), base_key)
