"""The 224x224 frame of a case, per-slice organ statistics, and windowing.

Field of view
-------------
Each case gets ONE square field of view in millimetres, used for every slice:

* body = voxels with ``image > -500`` HU, projected over all slices (union); a case
  without an image is refused (render one with the source's ``images="synthesize"``);
* the body's bounding box in mm, grown by ``fov_margin_mm`` on every side; side =
  the larger of the two extents; centred on the centre of the body's bounding box;
* the frame is sampled on a 224x224 grid, ``mm_per_pixel = side / 224``. Output pixel
  ``(i, j)`` has its centre at native mm ``origin + (i + 0.5) * mm_per_pixel``, where
  native mm are ``voxel index * spacing`` (voxel centres);
* images are resampled bilinearly (no antialiasing), labels and lesions with nearest
  neighbour, with the arithmetic of ``torch.nn.functional.grid_sample`` (computed in
  numpy by :mod:`.resample`; the exact affine map of the frame, which crops and pads in
  the same step). Where the field of view exceeds the volume the image is air
  (-1000 HU) and the labels are 0.
* images are windowed to uint8: ``clip((HU - (level - width/2)) / width, 0, 1) * 255``,
  rounded (default level 40, width 400).

Organ statistics are computed at NATIVE resolution in one pass over the volume
(``np.bincount`` per slice): per slice and label the pixel count and centroid
(row, col). :meth:`Frame224.to_frame` maps native centroids into the frame
(continuous pixel coordinates, pixel centres at integers).

The frame of a left-right mirrored case is the mirrored frame: the same grid
positions reflected, so bilinear images are exactly mirrored.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spar_bench.errors import CaseError

from ..case import Case
from ..schema import IMAGE_SIZE, N_ORGANS
from .resample import sample_bilinear, sample_nearest

#: HU threshold of the body, and the value padded outside the volume.
BODY_HU = -500.0
AIR_HU = -1000.0
#: Slices resampled per call: small enough that the float64 temporaries of a batch stay in
#: the CPU cache (4 x 224 x 224 x 8 bytes = 1.6 MB; 32 slices took twice as long).
RESAMPLE_BATCH = 4


@dataclass(frozen=True)
class Frame224:
    """A square field of view of one case, sampled at ``size x size`` pixels.

    Attributes:
        origin_mm: (row, col) native mm of the frame's top-left corner (pixel edge).
        side_mm: side length of the square field of view in mm.
        spacing: native in-plane voxel size (row, col) in mm.
        native_shape: native in-plane shape (rows, cols).
        size: output pixels per side (224).
    """

    origin_mm: tuple[float, float]
    side_mm: float
    spacing: tuple[float, float]
    native_shape: tuple[int, int]
    size: int = IMAGE_SIZE

    @property
    def mm_per_pixel(self) -> float:
        return self.side_mm / self.size

    def to_frame(self, row: np.ndarray, col: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Map native (row, col) voxel coordinates to frame pixel coordinates ``(x, y)``.

        ``x`` is the frame column and ``y`` the frame row; pixel centres are integers.
        """
        mpp = self.mm_per_pixel
        y = (np.asarray(row, dtype=np.float64) * self.spacing[0] - self.origin_mm[0]) / mpp - 0.5
        x = (np.asarray(col, dtype=np.float64) * self.spacing[1] - self.origin_mm[1]) / mpp - 0.5
        return x, y

    def native_grid(self) -> tuple[np.ndarray, np.ndarray]:
        """Native (row, col) voxel coordinates of the frame's pixel centres (1-D each)."""
        centres = (np.arange(self.size, dtype=np.float64) + 0.5) * self.mm_per_pixel
        rows = (self.origin_mm[0] + centres) / self.spacing[0]
        cols = (self.origin_mm[1] + centres) / self.spacing[1]
        return rows, cols


def frame_for_case(case: Case, margin_mm: float) -> Frame224:
    """The square field of view of ``case`` around its body (see the module docstring)."""
    if case.image is None:
        raise CaseError(
            case.case_id,
            None,
            "has no image; samples need one (use the source's images='synthesize' for masks-only data)",
        )
    body = np.zeros(case.image.shape[1:], dtype=bool)
    for z0 in range(0, case.image.shape[0], STATS_BLOCK):  # slabs: no volume-sized temporary
        body |= np.any(case.image[z0 : z0 + STATS_BLOCK] > BODY_HU, axis=0)
    if not body.any():
        raise CaseError(case.case_id, None, f"no voxel above {BODY_HU:g} HU: the image has no body")
    rows = np.flatnonzero(body.any(axis=1))
    cols = np.flatnonzero(body.any(axis=0))
    sr, sc = float(case.spacing[1]), float(case.spacing[2])
    if sr <= 0 or sc <= 0:
        raise CaseError(case.case_id, None, f"in-plane spacing must be > 0 mm, got {case.spacing}")
    # bounding box edges in mm (voxel i covers [i - 0.5, i + 0.5] * spacing)
    r_lo, r_hi = (rows[0] - 0.5) * sr - margin_mm, (rows[-1] + 0.5) * sr + margin_mm
    c_lo, c_hi = (cols[0] - 0.5) * sc - margin_mm, (cols[-1] + 0.5) * sc + margin_mm
    side = max(r_hi - r_lo, c_hi - c_lo)
    r_mid, c_mid = (r_lo + r_hi) / 2, (c_lo + c_hi) / 2
    return Frame224(
        origin_mm=(float(r_mid - side / 2), float(c_mid - side / 2)),
        side_mm=float(side),
        spacing=(sr, sc),
        native_shape=(int(case.mask.shape[1]), int(case.mask.shape[2])),
    )


def window_to_uint8(hu: np.ndarray, level: float, width: float) -> np.ndarray:
    """Window Hounsfield units to uint8 (``level - width/2`` -> 0, ``level + width/2`` -> 255)."""
    lo = level - width / 2.0
    scaled = np.asarray(hu, dtype=np.float32) - lo  # float32 throughout, in place below
    scaled /= width
    np.clip(scaled, 0.0, 1.0, out=scaled)
    scaled *= 255.0
    np.rint(scaled, out=scaled)
    return scaled.astype(np.uint8)


def _grid(frame: Frame224) -> tuple[np.ndarray, np.ndarray]:
    """float32 normalised grid ``(gy, gx)`` of the frame (``align_corners=False``)."""
    rows, cols = frame.native_grid()
    h, w = frame.native_shape
    # voxel index p sits at normalised (2p + 1) / n - 1
    gy = (2.0 * rows + 1.0) / h - 1.0
    gx = (2.0 * cols + 1.0) / w - 1.0
    return gy.astype(np.float32), gx.astype(np.float32)


def resample_slices(
    volume: np.ndarray, zs: np.ndarray, frame: Frame224, *, mode: str, fill: float
) -> np.ndarray:
    """Resample slices ``volume[zs]`` into the frame: float32 ``(len(zs), size, size)``.

    ``mode`` is ``"bilinear"`` (images) or ``"nearest"`` (labels); ``fill`` is the value
    outside the volume. Batches of :data:`RESAMPLE_BATCH` slices; the arithmetic is
    ``grid_sample``'s, in numpy (:mod:`.resample`).
    """

    sample = {"bilinear": sample_bilinear, "nearest": sample_nearest}[mode]
    zs = np.asarray(zs, dtype=np.int64)
    out = np.empty((len(zs), frame.size, frame.size), dtype=np.float32)
    if len(zs) == 0:
        return out
    gy, gx = _grid(frame)
    for start in range(0, len(zs), RESAMPLE_BATCH):
        chunk = zs[start : start + RESAMPLE_BATCH]
        out[start : start + len(chunk)] = sample(volume, chunk, gy, gx, fill)
    return out


@dataclass(frozen=True)
class SliceStats:
    """Per-slice organ statistics at native resolution.

    Attributes:
        area_px: ``(Z, 17)`` int64 pixel count of each label (column 0 = background).
        centroid_rc: ``(Z, 17, 2)`` float64 native (row, col) centroid; NaN where absent.
    """

    area_px: np.ndarray
    centroid_rc: np.ndarray


#: Slices per block of :func:`slice_stats` (bounds its index arrays to a few MB).
STATS_BLOCK = 16


def check_labels(case: Case, n_labels: int) -> None:
    """CaseError for a non-integer mask, negative ids, or ids >= ``n_labels`` (names the slice)."""
    mask = case.mask
    if mask.dtype.kind not in "ui":
        raise CaseError(
            case.case_id, None, f"mask must be an integer label map, got dtype {mask.dtype}"
        )
    if mask.dtype.kind == "i" and mask.size and int(mask.min()) < 0:
        raise CaseError(
            case.case_id,
            None,
            f"mask has negative label id {int(mask.min())}; canonical ids are 0..{N_ORGANS}",
        )
    if mask.size and int(mask.max()) >= n_labels:
        z = int(np.flatnonzero((mask >= n_labels).any(axis=(1, 2)))[0])
        raise CaseError(
            case.case_id,
            None,
            f"mask has label id {int(mask[z].max())} on slice z={z}; canonical ids are 0..{N_ORGANS}",
        )


def slice_stats(case: Case) -> SliceStats:
    """Areas and centroids of every label on every slice, from the labelled voxels only.

    Counts and coordinate sums are integers (exact in float64), so the centroids do not
    depend on the summation order. The background column (label 0) holds the pixel
    count and, on slices with an organ, the background's centroid (0 on empty slices).
    Per block of slices: the labelled voxels' flat indices (``nonzero`` of a boolean
    array, about 3x faster than of the uint8 mask; int32), then the voxel counts per (slice, row,
    label) and per (slice, column, label) (two unweighted ``bincount``), whose sums over
    rows and columns give the areas and the coordinate sums.
    """
    mask = case.mask
    n_labels = N_ORGANS + 1
    z_n, h, w = mask.shape
    check_labels(case, n_labels)
    area = np.zeros((z_n, n_labels), dtype=np.int64)
    sums = np.zeros((z_n, n_labels, 2), dtype=np.float64)
    rows, cols = np.arange(h, dtype=np.int64), np.arange(w, dtype=np.int64)
    for z0 in range(0, z_n, STATS_BLOCK):
        block = mask[z0 : z0 + STATS_BLOCK]
        nb = len(block)
        labelled = block != 0
        flat = np.flatnonzero(labelled)
        if labelled.size * n_labels < 2**31:  # int32 index arithmetic: about 1.5x faster
            flat = flat.astype(np.int32)
        values = block[labelled]  # in the order of flat
        zrow = flat // w  # z * h + row, z within the block
        zcol = (zrow // h) * w + (flat - zrow * w)  # z * w + col
        per_row = np.bincount(zrow * n_labels + values, minlength=nb * h * n_labels).reshape(nb, h, n_labels)
        per_col = np.bincount(zcol * n_labels + values, minlength=nb * w * n_labels).reshape(nb, w, n_labels)
        area[z0 : z0 + nb] = per_row.sum(axis=1)
        sums[z0 : z0 + nb, :, 0] = np.einsum("zrl,r->zl", per_row, rows)
        sums[z0 : z0 + nb, :, 1] = np.einsum("zcl,c->zl", per_col, cols)
    organ_px = area[:, 1:].sum(axis=1)
    area[:, 0] = h * w - organ_px
    has = organ_px > 0  # background sums = all pixels' coordinate sums minus the organs'
    sums[has, 0, 0] = w * (h * (h - 1) // 2) - sums[has, 1:, 0].sum(axis=1)
    sums[has, 0, 1] = h * (w * (w - 1) // 2) - sums[has, 1:, 1].sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        centroid = sums / area[..., None]
    centroid[area == 0] = np.nan
    return SliceStats(area_px=area, centroid_rc=centroid)


@dataclass(frozen=True)
class ResampledSlices:
    """The slices of one case needed by any level, resampled once into the frame.

    Attributes:
        zs: sorted slice indices.
        image: ``(n, size, size)`` uint8 windowed image.
        label: ``(n, size, size)`` uint8 canonical ids (nearest).
        lesion: ``(n, size, size)`` uint8 0/1 (all zero when the case has no lesion mask).
    """

    zs: np.ndarray
    image: np.ndarray
    label: np.ndarray
    lesion: np.ndarray

    def rows(self, z: np.ndarray) -> np.ndarray:
        """Row of each slice index ``z`` in the arrays (every ``z`` must have been resampled)."""
        return np.searchsorted(self.zs, np.asarray(z))


def resample_case(
    case: Case, frame: Frame224, zs: np.ndarray, level: float, width: float
) -> ResampledSlices:
    """Resample the image, labels and lesion of slices ``zs`` of ``case`` into ``frame``."""
    zs = np.unique(np.asarray(zs, dtype=np.int64))
    assert case.image is not None  # frame_for_case refused image-less cases
    hu = resample_slices(case.image, zs, frame, mode="bilinear", fill=AIR_HU)
    label = resample_slices(case.mask, zs, frame, mode="nearest", fill=0.0)
    if case.lesion is not None:
        lesion = resample_slices(case.lesion, zs, frame, mode="nearest", fill=0.0) > 0
    else:
        lesion = np.zeros(label.shape, dtype=bool)
    return ResampledSlices(
        zs=zs,
        image=window_to_uint8(hu, level, width),
        label=np.rint(label).astype(np.uint8),
        lesion=lesion.astype(np.uint8),
    )
