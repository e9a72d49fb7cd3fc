"""Level 4: the isotropic cube around a case's organs, resampled once (docs/PROTOCOL.md "Level 4").

Grid
----
The cube encloses the bounding box of every labelled voxel (``mask > 0``) in the canonical
frame: native voxel ``i`` of an axis with spacing ``s`` covers ``[(i - 0.5) s, (i + 0.5) s]``
mm, so the box runs from the first labelled voxel's lower edge to the last one's upper edge
on each axis. Side ``L`` = the largest of the three box extents + 2 x ``fov_margin_mm``;
``mm_per_voxel = L / S``; the cube is centred on the box's centre. Cube voxel ``(z, row,
col)`` follows the canonical axes (z inferior -> superior, row anterior -> posterior, col
patient right -> left); its centre lies at native mm ``origin_mm + index x mm_per_voxel``.
Nothing labelled is cut.

Resampling (separable along the three axes, so it is exactly trilinear / nearest):

* image: linear interpolation of HU between native voxel centres, clamped to the edge voxel
  within the scan's extent (``-0.5 .. n - 0.5`` voxels), ``-1024`` HU outside it; then
  windowed to uint8 as Levels 1-3 (:func:`.frame224.window_to_uint8`);
* label and lesion: nearest native voxel (``floor(c + 0.5)``), 0 outside the scan.

The mirrored / flipped copies of the counterfactuals are the stored cube reversed along
col / z (:func:`reflect`): the cube of the mirrored case is the mirrored cube, so the copy
is exactly the reflection of the stored original (no resampling tie can differ).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..case import Case
from .frame224 import window_to_uint8

#: HU outside the scan.
OUTSIDE_HU = -1024.0
#: Output z-planes interpolated per block (bounds the float32 temporaries of a block).
PLANE_BLOCK = 8


@dataclass(frozen=True)
class VolumeGrid:
    """The cube's placement in the native canonical frame.

    Attributes:
        origin_mm: native mm ``(z, row, col)`` of voxel ``(0, 0, 0)``'s centre.
        mm_per_voxel: isotropic voxel size in mm.
        size: voxels per side ``S``.
    """

    origin_mm: tuple[float, float, float]
    mm_per_voxel: float
    size: int

    def native_coords(self, axis: int, spacing: float) -> np.ndarray:
        """Native voxel coordinates (float64) of the cube's voxel centres along ``axis``."""
        mm = self.origin_mm[axis] + np.arange(self.size, dtype=np.float64) * self.mm_per_voxel
        return mm / float(spacing)


def labelled_box(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``(lo, hi)`` voxel indices (inclusive, ``(z, row, col)``) of the labelled voxels; None if none."""
    per_z = mask.reshape(mask.shape[0], -1).any(axis=1)
    if not per_z.any():
        return None
    zs = np.flatnonzero(per_z)
    block = mask[zs[0] : zs[-1] + 1]
    rows = np.flatnonzero(block.any(axis=(0, 2)))
    cols = np.flatnonzero(block.any(axis=(0, 1)))
    lo = np.array([zs[0], rows[0], cols[0]], dtype=np.int64)
    hi = np.array([zs[-1], rows[-1], cols[-1]], dtype=np.int64)
    return lo, hi


def grid_for_case(case: Case, size: int, margin_mm: float) -> VolumeGrid | None:
    """The cube of ``case`` (module docstring); None when the case has no labelled voxel."""
    box = labelled_box(case.mask)
    if box is None:
        return None
    sp = np.asarray(case.spacing, dtype=np.float64)
    lo_mm = (box[0] - 0.5) * sp - margin_mm
    hi_mm = (box[1] + 0.5) * sp + margin_mm
    side = float((hi_mm - lo_mm).max())
    mpv = side / size
    origin = (lo_mm + hi_mm) / 2.0 - side / 2.0 + mpv / 2.0
    return VolumeGrid(tuple(float(o) for o in origin), float(mpv), int(size))


def nearest_index(coords: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Nearest native index of each coordinate and whether it lies inside ``[-0.5, n - 0.5)``."""
    idx = np.floor(coords + 0.5).astype(np.int64)
    inside = (idx >= 0) & (idx < n)
    return np.clip(idx, 0, n - 1), inside


def linear_weights(coords: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(i0, i1, w, inside)``: value = ``(1 - w) v[i0] + w v[i1]``, clamped at the edge voxels."""
    inside = (coords >= -0.5) & (coords < n - 0.5)
    c = np.clip(coords, 0.0, n - 1.0)
    i0 = np.minimum(np.floor(c).astype(np.int64), max(n - 2, 0))
    i1 = np.minimum(i0 + 1, n - 1)
    w = (c - i0).astype(np.float32)
    return i0, i1, w, inside


def resample_nearest(volume: np.ndarray, grid: VolumeGrid, spacing: tuple[float, float, float]) -> np.ndarray:
    """``volume`` sampled at the cube's voxel centres, nearest voxel, 0 outside: uint8 (S, S, S)."""
    idx, inside = zip(
        *(nearest_index(grid.native_coords(ax, spacing[ax]), volume.shape[ax]) for ax in range(3)),
        strict=True,
    )
    out = np.zeros((grid.size,) * 3, dtype=np.uint8)
    sel = [np.flatnonzero(m) for m in inside]
    if all(len(s) for s in sel):
        vals = volume[np.ix_(idx[0][sel[0]], idx[1][sel[1]], idx[2][sel[2]])]
        out[np.ix_(*sel)] = vals
    return out


def _lerp(arr: np.ndarray, axis: int, i0: np.ndarray, i1: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Linear interpolation of ``arr`` (float32) along ``axis`` at ``(i0, i1, w)``."""
    shape = [1] * arr.ndim
    shape[axis] = len(w)
    wb = w.reshape(shape)
    a = np.take(arr, i0, axis=axis)
    a *= 1.0 - wb
    a += np.take(arr, i1, axis=axis) * wb
    return a


def resample_linear(
    image: np.ndarray, grid: VolumeGrid, spacing: tuple[float, float, float], fill: float = OUTSIDE_HU
) -> np.ndarray:
    """``image`` linearly interpolated at the cube's voxel centres, ``fill`` outside: float32 (S, S, S).

    Separable: along z on blocks of :data:`PLANE_BLOCK` output planes of the native in-plane
    crop the cube covers, then along rows, then columns (exactly trilinear).
    """
    w3 = [linear_weights(grid.native_coords(ax, spacing[ax]), image.shape[ax]) for ax in range(3)]
    out = np.full((grid.size,) * 3, fill, dtype=np.float32)
    keep = [np.flatnonzero(w[3]) for w in w3]
    if not all(len(k) for k in keep):
        return out
    (r0, r1, rw, _), (c0, c1, cw, _) = w3[1], w3[2]
    rk, ck = keep[1], keep[2]
    rlo, rhi = int(r0[rk].min()), int(r1[rk].max()) + 1  # the native rows/cols the cube reads
    clo, chi = int(c0[ck].min()), int(c1[ck].max()) + 1
    z0, z1, zw, _ = w3[0]
    for start in range(0, len(keep[0]), PLANE_BLOCK):
        ks = keep[0][start : start + PLANE_BLOCK]
        lo = image[z0[ks], rlo:rhi, clo:chi].astype(np.float32)
        hi = image[z1[ks], rlo:rhi, clo:chi].astype(np.float32)
        planes = lo * (1.0 - zw[ks, None, None]) + hi * zw[ks, None, None]
        planes = _lerp(planes, 1, r0[rk] - rlo, r1[rk] - rlo, rw[rk])
        planes = _lerp(planes, 2, c0[ck] - clo, c1[ck] - clo, cw[ck])
        out[np.ix_(ks, rk, ck)] = planes
    return out


@dataclass(frozen=True)
class Volume:
    """One stored Level 4 cube and its placement.

    Attributes:
        image: uint8 (S, S, S) windowed image.
        label: uint8 (S, S, S) canonical organ ids.
        lesion: uint8 (S, S, S) 0/1 (zeros when the case has no lesion channel).
        has_lesion: whether the case has a lesion channel.
        grid: the cube's placement in the native canonical frame of THIS copy.
    """

    image: np.ndarray
    label: np.ndarray
    lesion: np.ndarray
    has_lesion: bool
    grid: VolumeGrid


def volume_for_case(case: Case, size: int, margin_mm: float, level: float, width: float) -> Volume | None:
    """The stored cube of ``case`` (image windowed with ``level``/``width``); None without organs."""
    grid = grid_for_case(case, size, margin_mm)
    if grid is None:
        return None
    assert case.image is not None  # the caller checked
    hu = resample_linear(case.image, grid, case.spacing)
    label = resample_nearest(case.mask, grid, case.spacing)
    if case.lesion is not None:
        lesion = (resample_nearest(case.lesion, grid, case.spacing) > 0).astype(np.uint8)
    else:
        lesion = np.zeros_like(label)
    return Volume(window_to_uint8(hu, level, width), label, lesion, case.lesion is not None, grid)


def reflect(vol: Volume, axis: int, native_extent_mm: float) -> Volume:
    """``vol`` reversed along cube ``axis`` (2: left-right mirror, 0: superior-inferior flip).

    ``native_extent_mm`` = (n - 1) x spacing of the native axis: the reflected case's native
    position of a point at ``p`` mm is ``native_extent_mm - p``, so the copy's ``origin_mm``
    on that axis is ``native_extent_mm - (origin + (S - 1) x mm_per_voxel)``.
    """

    def rev(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(np.flip(a, axis=axis))

    g = vol.grid
    origin = list(g.origin_mm)
    origin[axis] = float(native_extent_mm - (origin[axis] + (g.size - 1) * g.mm_per_voxel))
    return replace(
        vol,
        image=rev(vol.image),
        label=rev(vol.label),
        lesion=rev(vol.lesion),
        grid=replace(g, origin_mm=tuple(origin)),
    )
