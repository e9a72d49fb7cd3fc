"""Reorient volumes into the canonical frame and check that image and mask share a grid.

The canonical frame (see :mod:`spar_bench.builder.schema`) is the voxel orientation
``("L", "P", "S")`` for axes ``(i, j, k)``, transposed to ``[z, row, col]``: z inferior to
superior, row 0 anterior, column 0 the patient's right. The reorientation is decided
from the affine alone (``nibabel.orientations``), only flips and permutes axes (no
resampling), and is recorded so that it can be reported and re-applied: an image and
its mask are always canonicalised with the SAME transform.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from spar_bench.errors import CaseError

from .schema import CANONICAL_AXCODES

#: Default tolerance of :func:`check_same_geometry` (mm for spacing and origin).
GEOMETRY_ATOL_MM = 1e-3
#: Default tolerance on direction cosines.
DIRECTION_ATOL = 1e-4


def voxel_spacing(affine: np.ndarray) -> tuple[float, float, float]:
    """Voxel size in mm along the array axes ``(i, j, k)`` (column norms of the 3x3 part)."""
    a = np.asarray(affine, dtype=np.float64)[:3, :3]
    return tuple(float(v) for v in np.sqrt((a * a).sum(axis=0)))  # type: ignore[return-value]


def _direction(affine: np.ndarray) -> np.ndarray:
    a = np.asarray(affine, dtype=np.float64)[:3, :3]
    norms = np.sqrt((a * a).sum(axis=0))
    norms[norms == 0] = 1.0
    return a / norms


def canonical_transform(affine: np.ndarray) -> dict[str, Any]:
    """How to bring an array with this affine to the canonical frame.

    Returns a JSON-serialisable dict: ``axcodes`` found (e.g. ``"RAS"``), the nibabel
    orientation ``transform`` (rows ``[output axis, flip]``) to ``L,P,S``, the final
    ``transpose`` (2, 1, 0), and ``obliquity_deg`` (0 for axis-aligned volumes; oblique
    volumes are snapped to the nearest axes, never resampled).
    """
    import nibabel as nib
    from nibabel import orientations as nio

    affine = np.asarray(affine, dtype=np.float64)
    ornt = nio.io_orientation(affine)
    target = nio.axcodes2ornt(CANONICAL_AXCODES)
    transform = nio.ornt_transform(ornt, target)
    found = "".join(str(c) for c in nio.ornt2axcodes(ornt))
    obliquity = float(np.degrees(np.max(nib.affines.obliquity(affine))))
    return {
        "axcodes": found,
        "target_axcodes": "".join(CANONICAL_AXCODES),
        "transform": transform.astype(int).tolist(),
        "transpose": [2, 1, 0],
        "obliquity_deg": round(obliquity, 4),
    }


def describe_transform(info: dict[str, Any]) -> str:
    """``"i->col flipped, j->row flipped, k->z"``: where each file axis lands, in words."""
    names = {0: "col", 1: "row", 2: "z"}  # axes after apply_orientation, before the transpose
    parts = []
    for in_axis, (out_axis, flip) in zip("ijk", info["transform"], strict=True):
        parts.append(f"{in_axis}->{names[int(out_axis)]}{' flipped' if int(flip) < 0 else ''}")
    return ", ".join(parts)


def apply_canonical(data: np.ndarray, info: dict[str, Any]) -> np.ndarray:
    """Apply a transform from :func:`canonical_transform`: a view of ``data`` (flips and a
    transpose; no copy, so a read-only ``data`` gives a read-only view)."""
    from nibabel import orientations as nio

    transform = np.asarray(info["transform"], dtype=np.float64)
    return nio.apply_orientation(data, transform).transpose(info["transpose"])


def canonical_spacing(affine: np.ndarray, info: dict[str, Any]) -> tuple[float, float, float]:
    """Voxel spacing ``(z, row, col)`` in mm after :func:`apply_canonical`."""
    spacing_ijk = voxel_spacing(affine)
    out = [0.0, 0.0, 0.0]
    for in_axis, (out_axis, _flip) in enumerate(info["transform"]):
        out[int(out_axis)] = spacing_ijk[in_axis]
    return tuple(out[a] for a in info["transpose"])  # type: ignore[return-value]


def to_canonical(
    data: np.ndarray, affine: np.ndarray
) -> tuple[np.ndarray, tuple[float, float, float], dict[str, Any]]:
    """``(array [z, row, col], spacing (z, row, col) mm, info)`` for a volume ``(i, j, k)``.

    ``info`` records the axcodes found and the transform applied (see
    :func:`canonical_transform`); pass it to :func:`apply_canonical` to transform a mask
    on the same grid identically.
    """
    if data.ndim != 3:
        raise ValueError(f"to_canonical needs a 3-D array, got shape {data.shape}")
    info = canonical_transform(affine)
    return apply_canonical(data, info), canonical_spacing(affine, info), info


def is_degenerate_affine(affine: np.ndarray) -> bool:
    """True for a header without real geometry.

    Degenerate means: the identity matrix, a zero-length voxel axis, or an axis-aligned
    (signed permutation) matrix with exactly 1 mm on every axis, whatever its origin
    (nibabel's fallback when a NIfTI file has neither sform nor qform, and the header of
    several LiTS volumes). Orientation and spacing of such a file are then unknown.
    A real scan with exactly 1.000 mm isotropic axis-aligned voxels is also flagged:
    sources call this only where such headers are known to occur (LiTS).
    """
    a = np.asarray(affine, dtype=np.float64)
    lin = a[:3, :3]
    if np.allclose(a, np.eye(4)):
        return True
    spacing = np.sqrt((lin * lin).sum(axis=0))
    if np.any(spacing < 1e-6):
        return True
    return bool(np.allclose(np.abs(lin).sum(axis=0), 1.0) and np.allclose(np.abs(lin).max(axis=0), 1.0))


def canonical_grid(affine: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, tuple[int, int, int]]:
    """``(affine, shape)`` of a volume AFTER :func:`apply_canonical`: voxel ``[z, row, col]`` -> world (RAS mm).

    Two files that store the same voxels in a different axis order (flips, permutations)
    have the same canonical grid.
    """
    from nibabel import orientations as nio

    info = canonical_transform(affine)
    transform = np.asarray(info["transform"], dtype=np.float64)
    reoriented = np.asarray(affine, dtype=np.float64) @ nio.inv_ornt_aff(transform, tuple(shape[:3]))
    shape_o = [0, 0, 0]
    for in_axis, (out_axis, _flip) in enumerate(transform):
        shape_o[int(out_axis)] = int(shape[in_axis])
    perm = list(info["transpose"])
    out = reoriented.copy()
    out[:3, :3] = reoriented[:3, perm]
    return out, tuple(shape_o[a] for a in perm)  # type: ignore[return-value]


def check_same_geometry(
    image_affine: np.ndarray,
    image_shape: tuple[int, ...],
    mask_affine: np.ndarray,
    mask_shape: tuple[int, ...],
    *,
    case_id: str,
    image_path: str | Path,
    mask_path: str | Path,
    atol_mm: float = GEOMETRY_ATOL_MM,
    direction_atol: float = DIRECTION_ATOL,
) -> None:
    """Raise :class:`CaseError` naming BOTH files unless image and mask describe one voxel grid.

    Both grids are first brought into the canonical frame (:func:`canonical_grid`), so a
    mask that stores the image's voxels in another axis order (an axis flipped, axes
    permuted: same spacing and extent) is the same grid. Then shape (``[z, row, col]``),
    spacing (``atol_mm``), origin of the canonical first voxel (``atol_mm``) and direction
    cosines (``direction_atol``: a different obliquity) are compared. Tolerances are
    absolute, in mm.
    """
    image_c, image_shape_c = canonical_grid(image_affine, image_shape)
    mask_c, mask_shape_c = canonical_grid(mask_affine, mask_shape)
    problems: list[str] = []
    if image_shape_c != mask_shape_c:
        problems.append(f"shape [z,row,col] {image_shape_c} vs {mask_shape_c}")
    si, sm = np.array(voxel_spacing(image_c)), np.array(voxel_spacing(mask_c))
    if not np.allclose(si, sm, rtol=0, atol=atol_mm):
        problems.append(f"spacing [z,row,col] {np.round(si, 4).tolist()} vs {np.round(sm, 4).tolist()} mm")
    oi, om = image_c[:3, 3], mask_c[:3, 3]
    if not np.allclose(oi, om, rtol=0, atol=atol_mm):
        problems.append(
            f"origin {np.round(oi, 3).tolist()} vs {np.round(om, 3).tolist()} mm "
            f"(differs by {float(np.abs(oi - om).max()):.3g} mm)"
        )
    di, dm = _direction(image_c), _direction(mask_c)
    if not np.allclose(di, dm, rtol=0, atol=direction_atol):
        problems.append(
            f"direction {np.round(di, 4).tolist()} vs {np.round(dm, 4).tolist()}"
        )
    if problems:
        raise CaseError(
            case_id,
            None,
            f"image {image_path} and mask {mask_path} are not on the same voxel grid: "
            + "; ".join(problems)
            + " (image vs mask, compared in the canonical frame). Resample the mask onto the image grid, "
            "or fix the header.",
        )
