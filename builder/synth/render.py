"""Pseudo-CT rendering: HU-like intensities for a canonical label volume.

One renderer serves two callers: the procedural phantom (:mod:`spar_bench.builder.phantom.generate`)
and real masks-only cases (``--images synthesize``, :mod:`spar_bench.builder.sources.volume`) (the WORD label maps ship without CT images), so a
pseudo-CT of a real case and a phantom look alike and differ only in anatomy.

Everything is in the canonical frame (:mod:`spar_bench.builder.schema`): arrays ``[z, row, col]``,
row 0 anterior, column 0 the patient's right, ``spacing`` ``(z, row, col)`` in mm.

Tissues and intensities
-----------------------
Each voxel gets one tissue, then a mean HU from :data:`ORGAN_HU` / :data:`TISSUE_HU`
(every organ mean is jittered per case by N(0, 5 HU), from the seed):

* organs: liver 60, spleen 50, kidneys 150 (contrast-enhanced, cortex-like),
  stomach 30, gallbladder 10, esophagus 40, pancreas 45, duodenum 35, colon 25,
  intestine 35, adrenal 30, rectum 30, bladder 10, femoral heads 500 (bone);
  or, given ``organ_hu`` (the phantom's ``distinct`` intensities), those means as given:
  :data:`DISTINCT_HU_LEVELS`, -35..220 HU in steps of 17, one per organ in
  :data:`DISTINCT_ORDER`, jittered per case by N(0, 3 HU) when the phantom is sampled;
* bowel gas: inside the stomach, duodenum, colon, intestine and rectum, a smooth random
  field (correlation length ~12 mm) marks air pockets (-900 HU) in roughly 10% (small
  bowel) to 25% (colon) of the organ's voxels;
* liver lesions (``lesion`` channel): 20 HU, hypodense to the liver;
* body wall: outside the organs, the body is subcutaneous fat (-100 HU, 8-22 mm thick),
  then a muscle ring (45 HU, 8-14 mm), then visceral fat (-80 HU);
* bone: a vertebral body (450 HU) posterior on the body midline, unless ``bone`` is given;
* outside the body: air (-1000 HU).

Then zero-mean noise is added (SD 25 HU; a sum of two uniforms, near-Gaussian after
the blur) and the image is blurred in-plane with a Gaussian of 0.7 voxel, which leaves
correlated noise of ~10 HU SD (measured in the phantom liver), like a smooth-kernel CT
reconstruction. The result is clipped to [-1024, 3071] and rounded to int16.

Body outline of a masks-only case
---------------------------------
When no ``body`` mask is given, one is derived from the organs (:func:`derive_body`):
per axial slice, the convex hull of every organ voxel within +-25 mm in z, pushed out
by a margin (30 mm laterally, 25 mm anteriorly, 60 mm posteriorly, where the spine
and back muscles lie). Slices above or below all organs copy the nearest hull. The
hull is computed on an in-plane grid of ~3 mm and evaluated exactly at full
resolution, row by row (~0.3 s of CPU for a 512 x 512 x 250 volume).
The fat and muscle rings of a derived body are the same hull offset inwards (exact
erosion of a convex polygon); for a given ``body`` mask they come from an in-plane
distance transform.

Cost: the whole render of a real 512 x 512 x 247 WORD label map takes 2.5-3.2 s of CPU
(one core; measured on a shared 2-core machine). Work is done in slabs of 16 slices:
memory is the int16 output plus a few uint8 / float32 slabs and the derived hull;
nothing full-volume is float32 or float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from spar_bench.errors import SparError

from ..schema import N_ORGANS, ORGANS

#: Mean HU of each canonical organ (pseudo-CT, portal-venous-like contrast).
ORGAN_HU: dict[str, float] = {
    "liver": 60.0,
    "spleen": 50.0,
    "kidney_left": 150.0,
    "kidney_right": 150.0,
    "stomach": 30.0,
    "gallbladder": 10.0,
    "esophagus": 40.0,
    "pancreas": 45.0,
    "duodenum": 35.0,
    "colon": 25.0,
    "intestine": 35.0,
    "adrenal": 30.0,
    "rectum": 30.0,
    "bladder": 10.0,
    "head_of_femur_left": 500.0,
    "head_of_femur_right": 500.0,
}
#: Mean HU of the non-organ tissues.
TISSUE_HU: dict[str, float] = {
    "air": -1000.0,
    "lesion": 20.0,
    "fat": -100.0,
    "muscle": 45.0,
    "bone": 450.0,
    "visceral": -80.0,
    "gas": -900.0,
}
#: Fraction of each hollow organ's voxels that become gas pockets.
GAS_FRACTION: dict[str, float] = {
    "stomach": 0.15,
    "duodenum": 0.10,
    "colon": 0.25,
    "intestine": 0.10,
    "rectum": 0.15,
}

# Tissue codes: 0 air, 1..16 organs, then these.
_LESION, _FAT, _MUSCLE, _BONE, _VISCERAL, _GAS = range(N_ORGANS + 1, N_ORGANS + 7)
_TISSUE_CODE = {
    "lesion": _LESION,
    "fat": _FAT,
    "muscle": _MUSCLE,
    "bone": _BONE,
    "visceral": _VISCERAL,
    "gas": _GAS,
}

#: ``distinct`` intensities (``spar-build phantom --intensities distinct``): 16 mean HU
#: levels 17 HU apart inside the default window (-160..240), clear of fat (-100) and
#: visceral fat (-80); each organ gets one level, in this fixed order, so that no two
#: organs - not even a left/right pair - look alike. The spacing is ~1.7 noise SDs of a
#: blurred voxel (~10 HU) and far more than the SD of an organ's mean over a few voxels.
DISTINCT_HU_LEVELS: tuple[float, ...] = tuple(-35.0 + 17.0 * k for k in range(16))
#: organ -> level index of :data:`DISTINCT_HU_LEVELS` (spatial neighbours of the canonical
#: anatomy and left/right pairs far apart).
DISTINCT_ORDER: tuple[str, ...] = (
    "kidney_left",
    "gallbladder",
    "head_of_femur_right",
    "pancreas",
    "spleen",
    "rectum",
    "esophagus",
    "colon",
    "adrenal",
    "stomach",
    "head_of_femur_left",
    "duodenum",
    "bladder",
    "liver",
    "intestine",
    "kidney_right",
)
#: SD (HU) of the per-case jitter of each ``distinct`` organ mean (``ct``: 5 HU).
DISTINCT_JITTER_HU = 3.0

NOISE_SD_HU = 25.0
BLUR_SIGMA_VOXELS = 0.7
_SLAB = 16


class RenderError(SparError, ValueError):
    """The arrays given to the renderer do not describe a canonical label volume."""


@dataclass(frozen=True)
class BodyHull:
    """A derived body outline: per slice, the half-planes ``a . (row_mm, col_mm) <= b``.

    ``normals[z]`` is ``(K, 2)`` unit normals (row, col) and ``offsets[z]`` is ``(K,)``;
    the body of slice ``z`` is where every inequality holds. Offsetting all ``b`` by
    ``-t`` erodes the (convex) body by exactly ``t`` mm.
    """

    normals: list[np.ndarray]
    offsets: list[np.ndarray]


def _check(mask: np.ndarray, spacing, lesion, body, bone) -> tuple[float, float, float]:
    if not isinstance(mask, np.ndarray) or mask.ndim != 3:
        raise RenderError(
            f"mask must be a 3-D [z,row,col] array, got {getattr(mask, 'shape', type(mask))}"
        )
    if mask.dtype.kind not in "ui":
        raise RenderError(f"mask must hold integer label ids, got dtype {mask.dtype}")
    if mask.size == 0:
        raise RenderError(f"mask is empty (shape {mask.shape})")
    top = int(mask.max())
    if top > N_ORGANS or int(mask.min()) < 0:
        raise RenderError(
            f"mask holds label {top if top > N_ORGANS else int(mask.min())}; canonical ids are 0..{N_ORGANS} "
            "(map source labels through a manifest first)"
        )
    try:
        sp = tuple(float(s) for s in spacing)
    except TypeError:
        raise RenderError(
            f"spacing must be three numbers (z, row, col) in mm, got {spacing!r}"
        ) from None
    if len(sp) != 3 or not all(np.isfinite(s) and s > 0 for s in sp):
        raise RenderError(
            f"spacing must be three positive numbers (z, row, col) in mm, got {spacing!r}"
        )
    for name, arr in (("lesion", lesion), ("body", body), ("bone", bone)):
        if arr is not None and np.shape(arr) != mask.shape:
            raise RenderError(f"{name} shape {np.shape(arr)} != mask shape {mask.shape}")
    return sp  # type: ignore[return-value]


def _row_intervals(
    normals: np.ndarray, offsets: np.ndarray, rows_mm: np.ndarray, dc: float, n_cols: int
):
    """Column index interval [lo, hi) of a convex polygon on each row (empty: lo >= hi)."""
    a_r, a_c = normals[:, 0], normals[:, 1]
    # a_r * r + a_c * c <= b  ->  bound on c for each row.
    rhs = offsets[None, :] - rows_mm[:, None] * a_r[None, :]  # (R, K)
    with np.errstate(divide="ignore", invalid="ignore"):
        bound = rhs / a_c[None, :]
    upper = np.where(a_c[None, :] > 1e-9, bound, np.inf).min(axis=1)
    lower = np.where(a_c[None, :] < -1e-9, bound, -np.inf).max(axis=1)
    flat = np.abs(a_c) <= 1e-9
    if flat.any():
        ok = (rhs[:, flat] >= 0).all(axis=1)
        upper = np.where(ok, upper, -np.inf)
    lo = np.clip(np.ceil(lower / dc), 0, n_cols).astype(np.int64)
    hi = np.clip(np.floor(upper / dc) + 1, 0, n_cols).astype(np.int64)
    return lo, hi


def _fill_hull(hull: BodyHull, shape, spacing, shrink_mm: float = 0.0) -> np.ndarray:
    nz, nr, nc = shape
    _, dr, dc = spacing
    rows_mm = np.arange(nr, dtype=np.float64) * dr
    cols = np.arange(nc)
    out = np.zeros(shape, dtype=bool)
    for z in range(nz):
        lo, hi = _row_intervals(hull.normals[z], hull.offsets[z] - shrink_mm, rows_mm, dc, nc)
        out[z] = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
    return out


def _slice_extreme_points(
    mask: np.ndarray, spacing: tuple[float, float, float]
) -> list[np.ndarray | None]:
    """Per slice, the convex-hull points (mm) of the organ voxels on a ~3 mm grid; None if empty.

    Each row's leftmost and rightmost occupied coarse cell contributes its four corners.
    Raises :class:`RenderError` when the mask has no organ voxel at all.
    """
    from scipy.spatial import ConvexHull, QhullError

    _, dr, dc = spacing
    nz, nr, nc = mask.shape
    f = max(1, int(round(3.0 / min(dr, dc))))
    hr, hc = -(-nr // f), -(-nc // f)
    organ = mask > 0
    pad = np.zeros((nz, hr * f, hc * f), dtype=bool)
    pad[:, :nr, :nc] = organ
    coarse = pad.reshape(nz, hr, f, hc, f).any(axis=(2, 4))
    has = coarse.any(axis=2)  # (nz, hr)
    if not has.any():
        raise RenderError("mask has no organ voxel: cannot derive a body outline (pass body=...)")
    cmin = np.argmax(coarse, axis=2)
    cmax = hc - 1 - np.argmax(coarse[:, :, ::-1], axis=2)
    # Extreme points of each slice, as corners of coarse cells, in mm.
    corners = np.array([[0, 0], [0, 1], [1, 0], [1, 1]], dtype=np.float64)
    per_slice: list[np.ndarray | None] = []
    for z in range(nz):
        r = np.nonzero(has[z])[0]
        if r.size == 0:
            per_slice.append(None)
            continue
        pts = np.concatenate([np.stack([r, cmin[z, r]], 1), np.stack([r, cmax[z, r]], 1)]).astype(
            np.float64
        )
        pts = (pts[:, None, :] + corners[None]).reshape(-1, 2) * f * np.array([dr, dc])
        try:
            pts = pts[ConvexHull(pts).vertices]
        except QhullError:  # degenerate (collinear) point sets keep all points
            pass
        per_slice.append(pts)
    return per_slice


def _margined_halfplanes(
    pts: np.ndarray, lateral_mm: float, anterior_mm: float, posterior_mm: float
) -> tuple[np.ndarray, np.ndarray]:
    """Unit normals and offsets of the convex hull of ``pts``, pushed out by the margins."""
    from scipy.spatial import ConvexHull

    hull = ConvexHull(pts, qhull_options="QJ")
    eq = hull.equations  # n . p + d <= 0 inside, n unit
    n = eq[:, :2]
    b = -eq[:, 2]
    margin = lateral_mm * np.abs(n[:, 1]) + np.where(
        n[:, 0] > 0, posterior_mm, anterior_mm
    ) * np.abs(n[:, 0])
    return n, b + margin


def derive_body_hull(
    mask: np.ndarray,
    spacing,
    *,
    window_mm: float = 25.0,
    margin_lateral_mm: float = 30.0,
    margin_anterior_mm: float = 25.0,
    margin_posterior_mm: float = 60.0,
) -> BodyHull:
    """The body outline of a masks-only case as per-slice convex polygons (see module doc).

    Raises :class:`RenderError` when the mask has no organ voxel at all.
    """
    sp = _check(mask, spacing, None, None, None)
    nz = mask.shape[0]
    per_slice = _slice_extreme_points(mask, sp)
    occupied = np.array([p is not None for p in per_slice])
    idx = np.nonzero(occupied)[0]
    w = max(0, int(round(window_mm / sp[0])))
    normals: list[np.ndarray] = []
    offsets: list[np.ndarray] = []
    cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for z in range(nz):
        # slices outside the organs' z-range copy the nearest occupied slice
        zc = int(idx[np.argmin(np.abs(idx - z))]) if not occupied[z] else z
        if zc not in cache:
            group = [
                per_slice[k]
                for k in range(max(0, zc - w), min(nz, zc + w + 1))
                if per_slice[k] is not None
            ]
            cache[zc] = _margined_halfplanes(
                np.concatenate(group), margin_lateral_mm, margin_anterior_mm, margin_posterior_mm
            )
        n, b = cache[zc]
        normals.append(n)
        offsets.append(b)
    return BodyHull(normals, offsets)


def derive_body(mask: np.ndarray, spacing, **margins: float) -> np.ndarray:
    """Boolean body mask of a masks-only case (see :func:`derive_body_hull`)."""
    sp = _check(mask, spacing, None, None, None)
    return _fill_hull(derive_body_hull(mask, sp, **margins), mask.shape, sp)


class _CoarseDepth:
    """In-plane depth below the body outline (mm), kept coarse, upsampled per slab.

    One in-plane distance transform on a ~2 mm grid (a huge z sampling makes it 2-D per
    slice); the renderer reads it slab by slab, :func:`inplane_depth` all at once.
    """

    def __init__(self, body: np.ndarray, spacing):
        from scipy import ndimage as ndi

        _, dr, dc = spacing
        self.shape = body.shape
        self.f = max(1, int(round(2.0 / min(dr, dc))))
        coarse = body[:, :: self.f, :: self.f]
        self.dist = ndi.distance_transform_edt(
            coarse, sampling=(1e6, dr * self.f, dc * self.f)
        ).astype(np.float32)

    def slab(self, z0: int, z1: int) -> np.ndarray:
        """Depth (mm, float32) of slices ``z0:z1`` at full in-plane resolution."""
        d = self.dist[z0:z1]
        if self.f > 1:
            d = np.repeat(np.repeat(d, self.f, axis=1), self.f, axis=2)
        return d[:, : self.shape[1], : self.shape[2]]


def inplane_depth(body: np.ndarray, spacing) -> np.ndarray:
    """In-plane distance (mm, float32) from each body voxel to the body's outline."""
    return _CoarseDepth(body, spacing).slab(0, body.shape[0])


def _hull_layers(
    hull: BodyHull, z: int, shrinks: tuple[float, ...], rows_mm: np.ndarray, dc: float, n_cols: int
) -> np.ndarray:
    """uint8 count of the nested offset hulls of slice ``z`` containing each voxel."""
    n_rows = rows_mm.size
    diff = np.zeros((n_rows, n_cols + 1), dtype=np.int8)
    r = np.arange(n_rows)
    for t in shrinks:
        lo, hi = _row_intervals(hull.normals[z], hull.offsets[z] - t, rows_mm, dc, n_cols)
        hi = np.maximum(hi, lo)
        np.add.at(diff, (r, lo), 1)
        np.add.at(diff, (r, hi), -1)
    return np.cumsum(diff[:, :n_cols], axis=1, dtype=np.int8).astype(np.uint8)


def _synth_spine(body: np.ndarray, spacing, free: np.ndarray) -> np.ndarray:
    """A vertebral body (ellipse 32 x 40 mm) on the midline, 70 mm in front of the back.

    Where that spot is mostly organ (e.g. the rectum in the pelvis), the ellipse moves
    back in 5 mm steps (up to 30 mm) to the position with the least organ overlap, like
    the sacrum behind the rectum. Only organ-free voxels become bone.
    """
    nz, nr, nc = body.shape
    _, dr, dc = spacing
    semi_r, semi_c = 16.0, 20.0
    hr, hc = int(np.ceil(semi_r / dr)) + 1, int(np.ceil(semi_c / dc)) + 1
    out = np.zeros(body.shape, dtype=bool)
    any_col = body.any(axis=1)  # (nz, nc)
    for z in range(nz):
        c = np.nonzero(any_col[z])[0]
        if c.size == 0:
            continue
        c_mid = int(round((c[0] + c[-1]) / 2))
        r = np.nonzero(body[z, :, c_mid])[0]
        if r.size == 0:
            continue
        best = None
        for shift in range(0, 35, 5):
            r0 = r[-1] * dr - 70.0 + shift
            if r0 <= r[0] * dr or r0 >= r[-1] * dr:
                continue
            ri = int(round(r0 / dr))
            rs = slice(max(0, ri - hr), min(nr, ri + hr + 1))
            cs = slice(max(0, c_mid - hc), min(nc, c_mid + hc + 1))
            rr = np.arange(rs.start, rs.stop, dtype=np.float32)[:, None] * dr - r0
            cc = np.arange(cs.start, cs.stop, dtype=np.float32)[None, :] * dc - c_mid * dc
            ell = (rr / semi_r) ** 2 + (cc / semi_c) ** 2 <= 1.0
            overlap = float((ell & ~free[z, rs, cs]).sum()) / max(int(ell.sum()), 1)
            if best is None or overlap < best[0] - 1e-9:
                best = (overlap, rs, cs, ell)
            if overlap < 0.1:
                break
        if best is not None:
            _, rs, cs, ell = best
            out[z, rs, cs] = ell
    return out & free


_GAS_STEP_MM = 6.0  # coarse cell; smoothing by 1 cell -> ~12 mm correlation length


def _gas_coarse(shape, spacing, rng: np.random.Generator) -> np.ndarray:
    """A smooth unit-variance random field on a coarse grid covering the volume."""
    from scipy import ndimage as ndi

    cshape = tuple(
        max(2, int(np.ceil(n * s / _GAS_STEP_MM)) + 2) for n, s in zip(shape, spacing, strict=True)
    )
    coarse = ndi.gaussian_filter(rng.standard_normal(cshape).astype(np.float32), 1.0, mode="wrap")
    coarse /= max(float(coarse.std()), 1e-6)
    return coarse


def _gas_sample(coarse: np.ndarray, spacing, points: tuple[np.ndarray, ...]) -> np.ndarray:
    """The coarse field, linearly interpolated at voxel ``points``."""
    from scipy import ndimage as ndi

    coords = [
        p.astype(np.float32) * np.float32(s / _GAS_STEP_MM)
        for p, s in zip(points, spacing, strict=True)
    ]
    return ndi.map_coordinates(coarse, coords, order=1, mode="nearest")


def _noise(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Zero-mean float32 noise of SD ``NOISE_SD_HU``: the sum of two uniform bytes.

    Triangular before the blur, near-Gaussian after it, and ~3x cheaper to draw than
    ``standard_normal`` (which dominated the render time of a 512 x 512 x 250 volume).
    """
    n = int(np.prod(shape))
    b = np.frombuffer(rng.bytes(2 * n), dtype=np.uint8).reshape(2, *shape)
    x = b[0].astype(np.float32)
    x += b[1]
    x -= np.float32(255.0)
    x *= np.float32(NOISE_SD_HU / np.sqrt(2 * (256**2 - 1) / 12))
    return x


def _organ_lut(rng: np.random.Generator, organ_hu: dict[str, float] | None) -> np.ndarray:
    """float32 HU of every tissue code (256 entries): organ means jittered N(0, 5 HU) or given.

    Draws one normal per organ (in :data:`ORGAN_HU` order) even when ``organ_hu`` is given,
    so the later draws are the same either way.
    """
    if organ_hu is not None and set(organ_hu) != set(ORGAN_HU):
        raise RenderError(f"organ_hu must give all {len(ORGAN_HU)} organs, got {sorted(organ_hu)}")
    lut = np.full(256, TISSUE_HU["air"], dtype=np.float32)
    for name, hu in ORGAN_HU.items():
        jitter = float(rng.normal(0.0, 5.0))  # drawn either way: the other draws stay the same
        lut[ORGANS.index(name) + 1] = float(organ_hu[name]) if organ_hu is not None else hu + jitter
    for name, code in _TISSUE_CODE.items():
        lut[code] = TISSUE_HU[name]
    return lut


def _layer_organ_table() -> np.ndarray:
    """uint8 table: ``table[(layer << 5) | organ]`` = organ if organ else the layer's tissue code.

    Layers: 0 air, 1 subcutaneous fat, 2 muscle, 3 visceral fat.
    """
    layer_code = np.array([0, _FAT, _MUSCLE, _VISCERAL], dtype=np.uint8)
    combo = np.zeros(128, dtype=np.uint8)
    for lay in range(4):
        combo[lay << 5] = layer_code[lay]
        combo[(lay << 5) + 1 : (lay << 5) + N_ORGANS + 1] = np.arange(1, N_ORGANS + 1)
    return combo


def _gas_thresholds() -> tuple[list[int], np.ndarray]:
    """Hollow organ ids, and per organ id the field value above which a voxel is gas."""
    gas_ids = [ORGANS.index(n) + 1 for n in GAS_FRACTION]
    gas_thr = np.full(N_ORGANS + 1, np.inf, dtype=np.float32)
    for n, frac in GAS_FRACTION.items():
        gas_thr[ORGANS.index(n) + 1] = NormalDist().inv_cdf(1.0 - frac)
    return gas_ids, gas_thr


@dataclass(frozen=True)
class _SlabPlan:
    """What every slab of one render shares: body outline, lookup tables and the gas field."""

    spacing: tuple[float, float, float]
    shrinks: tuple[float, float, float]
    hull: BodyHull | None
    depth: _CoarseDepth | None
    lut: np.ndarray
    combo: np.ndarray
    gas_ids: list[int]
    gas_thr: np.ndarray
    gas_coarse: np.ndarray
    rows_mm: np.ndarray


def _body_layers(plan: _SlabPlan, z0: int, z1: int, shape: tuple[int, int, int]) -> np.ndarray:
    """uint8 body layer of slices ``z0:z1``: 0 air, 1 subcutaneous fat, 2 muscle, 3 visceral fat."""
    if plan.hull is not None:
        layer = np.empty(shape, dtype=np.uint8)
        for k in range(z1 - z0):
            layer[k] = _hull_layers(
                plan.hull, z0 + k, plan.shrinks, plan.rows_mm, plan.spacing[2], shape[2]
            )
        return layer
    d = plan.depth.slab(z0, z1)
    layer = (d > plan.shrinks[0]).astype(np.uint8)
    layer += d > plan.shrinks[1]
    layer += d > plan.shrinks[2]
    return layer


def _slab_tissue(
    plan: _SlabPlan,
    m: np.ndarray,
    z0: int,
    lesion: np.ndarray | None,
    bone: np.ndarray | None,
) -> np.ndarray:
    """uint8 tissue code of every voxel of the slab ``m`` (organ ids of slices ``z0:``)."""
    z1 = z0 + m.shape[0]
    organ = m > 0
    layer = _body_layers(plan, z0, z1, m.shape)
    layer <<= 5  # organ ids < 32: one uint8 index holds (layer, organ)
    layer |= m.astype(np.uint8, copy=False)
    tissue = np.take(plan.combo, layer)
    del layer
    free = ~organ
    if bone is None:
        tissue[_synth_spine(tissue != 0, plan.spacing, free)] = _BONE
    else:
        tissue[np.asarray(bone[z0:z1], dtype=bool) & free] = _BONE
    if lesion is not None:
        tissue[(np.asarray(lesion[z0:z1]) != 0) & organ] = _LESION
    hollow = np.isin(m, plan.gas_ids)
    if hollow.any():
        pts = np.nonzero(hollow)
        field = _gas_sample(plan.gas_coarse, plan.spacing, (pts[0] + z0, pts[1], pts[2]))
        gas = field > plan.gas_thr[m[pts]]
        tissue[tuple(p[gas] for p in pts)] = _GAS
    return tissue


def _slab_hu(lut: np.ndarray, tissue: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """HU of a slab's tissue codes, plus noise, blurred in-plane, clipped and rounded (float32)."""
    from scipy import ndimage as ndi

    slab = np.take(lut, tissue)
    slab += _noise(rng, slab.shape)
    slab = ndi.gaussian_filter1d(slab, BLUR_SIGMA_VOXELS, axis=1, truncate=3.0)
    slab = ndi.gaussian_filter1d(slab, BLUR_SIGMA_VOXELS, axis=2, truncate=3.0)
    np.clip(slab, -1024, 3071, out=slab)
    return np.rint(slab)


def _plan_render(
    mask: np.ndarray,
    sp: tuple[float, float, float],
    body: np.ndarray | None,
    organ_hu: dict[str, float] | None,
    rng: np.random.Generator,
) -> _SlabPlan:
    """Draw the wall thicknesses, organ HU and gas field (in this order); outline the body."""
    t_fat = float(rng.uniform(8.0, 22.0))
    t_mus = float(rng.uniform(8.0, 14.0))
    hull = derive_body_hull(mask, sp) if body is None else None
    depth = None if body is None else _CoarseDepth(np.asarray(body, dtype=bool) | (mask > 0), sp)
    lut = _organ_lut(rng, organ_hu)
    gas_ids, gas_thr = _gas_thresholds()
    return _SlabPlan(
        spacing=sp,
        shrinks=(0.0, t_fat, t_fat + t_mus),
        hull=hull,
        depth=depth,
        lut=lut,
        combo=_layer_organ_table(),
        gas_ids=gas_ids,
        gas_thr=gas_thr,
        gas_coarse=_gas_coarse(mask.shape, sp, rng),
        rows_mm=np.arange(mask.shape[1], dtype=np.float64) * sp[1],
    )


def render_pseudo_ct(
    mask: np.ndarray,
    spacing,
    *,
    lesion: np.ndarray | None = None,
    seed: int,
    body: np.ndarray | None = None,
    bone: np.ndarray | None = None,
    organ_hu: dict[str, float] | None = None,
) -> np.ndarray:
    """Render an int16 pseudo-CT (HU) of a canonical label volume.

    Args:
        mask: ``[z, row, col]`` canonical organ ids (0 background, 1..16 ``ORGANS``).
        spacing: ``(z, row, col)`` voxel size in mm.
        lesion: optional 0/1 lesion channel (rendered at 20 HU where it is non-zero).
        seed: seeds every random choice (HU jitter, gas pockets, noise): the same
            inputs and seed give the same image, byte for byte.
        body: optional boolean body mask; ``None`` derives one from the organs
            (:func:`derive_body`).
        bone: optional boolean bone mask (rendered at 450 HU where no organ is);
            ``None`` places a vertebral body on the posterior midline.
        organ_hu: optional organ name -> mean HU of all 16 organs, used as given (no
            jitter) instead of :data:`ORGAN_HU` + N(0, 5 HU); everything else - and every
            random draw - is the same as without it.

    Returns:
        int16 array of ``mask.shape``, in the canonical frame.

    Raises:
        RenderError: the arrays are not a canonical label volume (wrong rank, label
        ids above 16, mismatched shapes, bad spacing, no organ and no body).
    """
    sp = _check(mask, spacing, lesion, body, bone)
    rng = np.random.default_rng(int(seed))
    nz = mask.shape[0]
    mask = np.ascontiguousarray(mask)
    plan = _plan_render(mask, sp, body, organ_hu, rng)
    out = np.empty(mask.shape, dtype=np.int16)
    for z0 in range(0, nz, _SLAB):
        z1 = min(nz, z0 + _SLAB)
        tissue = _slab_tissue(plan, mask[z0:z1], z0, lesion, bone)
        out[z0:z1] = _slab_hu(plan.lut, tissue, rng)
    return out
