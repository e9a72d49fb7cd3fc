"""A procedural abdominal phantom, deterministic from a seed.

Two steps, TorchIO-style: :func:`sample_phantom_params` draws a plain JSON-serialisable
record from an explicit ``np.random.Generator``; :func:`render_phantom` is a pure
function of that record. The record is stored with every written case
(``phantom.json``), so any case can be regenerated alone.

Frame and coordinates
---------------------
Everything is in the canonical frame of :mod:`spar_bench.builder.schema`: arrays ``[z, row, col]``,
z inferior -> superior, row 0 anterior, column 0 the PATIENT'S RIGHT. The record holds
millimetre positions ``(z, row, col)`` measured from the centre of voxel ``[0, 0, 0]``.

Subject
-------
* Field of view: ``in_plane`` x ``in_plane`` voxels (small: 160, medium: 256, large:
  512) and 40-60 slices of 4.5-5.5 mm (medium: 80-120 of 2.5-3.0 mm; large: 160-240 of
  1.25-1.75 mm). The in-plane spacing follows from the body width: the body fills
  77-89% of the field of view laterally (~1.9-2.4 mm per voxel at 160).
* Body: per slice an ellipse (lateral half-axis 125-155 mm, antero-posterior 65-80% of
  that) with a low-frequency radial deformation (harmonics 2-4 of the polar angle, up
  to 4% each) and a slow variation along z. The renderer turns its outer 8-22 mm into
  subcutaneous fat and the next 8-14 mm into a muscle ring.
* Spine: a vertebral body (ellipse ~30 x 38 mm) on the midline, 60-70 mm in front of
  the back, through every slice. Organs never overlap it.
* Organs: the 16 canonical organs, each a union of one to four "lobes". A lobe is an
  ellipsoid with a low-frequency radial deformation (three sinusoids of the direction,
  amplitude 3-10% each), rotated (in-plane -15..15 degrees, tilts -8..8 degrees).
  Positions are given in body-relative coordinates (z as a fraction of the anatomy's
  craniocaudal extent, row and column as fractions of the body half-axes), so they
  scale with the subject. Per subject and organ: size x0.85-1.15, shift N(0, 6 mm)
  per axis. The colon is four lobes (ascending on the right, transverse anterior,
  descending on the left, sigmoid); the adrenal label covers two glands above the
  kidneys, as in WORD.
* Canonical anatomy (:data:`ANATOMY`): liver in the upper abdomen on the patient's
  right (small columns) with a left lobe crossing the midline; spleen posterior on
  the left; stomach anterior on the left; gallbladder under the liver; kidneys
  posterior either side of the spine, the right one lower; adrenals above them;
  pancreas transverse in front of the left kidney; duodenum right of the pancreas;
  esophagus superior, just left of the spine; small intestine centrally below; bladder
  anterior and rectum posterior in the pelvis, femoral heads lateral at the bottom.
* Organs are painted in :data:`PAINT_ORDER` (small and solid organs first); a voxel
  keeps the first organ painted there, so organs never overlap (the liver is carved by
  the gallbladder, the intestine fills what the colon leaves). Organs stay 20 mm
  inside the body outline. An organ can be partly cut by the field of view.
* Lesions (``lesions=True``): 0-4 deformed spheres of 4-14 mm radius whose centres lie
  inside the liver's main lobe; the lesion channel is their union intersected with
  the liver voxels (so a lesion never leaves the liver; a blob landing where the
  liver was carved is lost, and the record keeps what was drawn).

Layouts
-------
* ``canonical``: the anatomy above.
* ``mirrored``: situs inversus. Every organ's column is mirrored about the body midline
  (and its shape with it). Names are identities, not positions: the organ named
  ``kidney_left`` ends up on the patient's RIGHT, the liver on the left.
* ``random``: organ positions are shuffled among the 16 canonical organ positions
  ("slots"), and each organ goes to the slot's left or right side at random (its
  shape mirrored to match), so recall of canonical anatomy cannot help: the liver is
  left of the spleen in about half of the subjects.

Intensities
-----------
From :func:`spar_bench.builder.synth.render.render_pseudo_ct`. ``intensities="ct"`` (the
default) keeps its CT-like organ means, under which several organs are within a few HU
of each other and left/right pairs are identical: in a ``random`` layout "which one is
the left kidney" is then not answerable from the image. ``intensities="distinct"`` gives
each organ its own mean (:func:`distinct_organ_hu`: 16 levels 17 HU apart, -35..220 HU,
plus a per-case N(0, 3 HU) jitter), drawn after everything else and stored in the record
as ``intensities`` and ``organ_hu``; with the same seed the anatomy, gas, noise and blur
are those of the ``ct`` case. A ``ct`` record has neither key (as before the option).
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from spar_bench.errors import ConfigError, SparError
from spar_bench.fields import check_fields, limited
from spar_bench.outputs import check_target, claim, remove
from spar_bench.procs import process_pool
from spar_bench.seeding import derive_seed

from ..schema import ORGAN_ID, ORGANS
from ..sources.word import SPLIT_DIRS as WORD_SPLIT_DIRS
from ..synth.render import (
    DISTINCT_HU_LEVELS,
    DISTINCT_JITTER_HU,
    DISTINCT_ORDER,
    inplane_depth,
    render_pseudo_ct,
)

PHANTOM_VERSION = "1.0"
LAYOUTS: tuple[str, ...] = ("canonical", "mirrored", "random")
#: ``ct``: CT-like organ means (similar organs look alike; left/right pairs are identical);
#: ``distinct``: every organ its own mean HU (see :func:`distinct_organ_hu`).
INTENSITIES: tuple[str, ...] = ("ct", "distinct")


@dataclass(frozen=True)
class SizePreset:
    in_plane: int
    n_slices: tuple[int, int]
    slice_mm: tuple[float, float]


SIZES: dict[str, SizePreset] = {
    "small": SizePreset(160, (40, 60), (4.5, 5.5)),
    "medium": SizePreset(256, (80, 120), (2.5, 3.0)),
    "large": SizePreset(512, (160, 240), (1.25, 1.75)),
}

#: Reference body used to express lobe sizes: half-axes (lateral, antero-posterior) and
#: craniocaudal extent, in mm. Lobe semi-axes scale with the subject's body.
REF_HALF_LR_MM, REF_HALF_AP_MM, REF_EXTENT_MM = 150.0, 105.0, 300.0

#: Canonical anatomy: organ -> lobes ``(t, y, x, semi_z, semi_row, semi_col)``. ``t`` in
#: [0, 1] is the craniocaudal position (0 inferior); ``y`` in [-1, 1] the
#: antero-posterior position as a fraction of the body half-axis (-1 anterior); ``x``
#: in [-1, 1] the left-right position (-1 = patient's RIGHT, i.e. small columns).
#: Semi-axes are mm for the reference body.
ANATOMY: dict[str, tuple[tuple[float, float, float, float, float, float], ...]] = {
    "liver": ((0.80, -0.05, -0.42, 75, 75, 80), (0.83, -0.30, 0.05, 40, 35, 50)),
    "spleen": ((0.80, 0.45, 0.66, 48, 38, 24),),
    "kidney_left": ((0.58, 0.50, 0.42, 50, 26, 22),),
    "kidney_right": ((0.53, 0.50, -0.42, 50, 26, 22),),
    "stomach": ((0.78, -0.30, 0.40, 48, 38, 42),),
    "gallbladder": ((0.66, -0.45, -0.36, 28, 14, 14),),
    "esophagus": ((0.95, 0.30, 0.10, 30, 9, 9),),
    "pancreas": ((0.64, 0.12, 0.14, 13, 13, 55),),
    "duodenum": ((0.57, 0.00, -0.20, 32, 14, 15),),
    "colon": (
        (0.42, -0.05, -0.70, 50, 20, 20),
        (0.62, -0.62, 0.00, 16, 20, 90),
        (0.45, -0.05, 0.70, 50, 20, 20),
        (0.22, 0.05, 0.30, 20, 20, 38),
    ),
    "intestine": ((0.38, -0.35, 0.00, 50, 42, 75),),
    "adrenal": ((0.69, 0.40, -0.28, 14, 6, 9), (0.71, 0.40, 0.28, 14, 6, 9)),
    "rectum": ((0.15, 0.50, 0.00, 38, 17, 17),),
    "bladder": ((0.12, -0.40, 0.00, 28, 32, 38),),
    "head_of_femur_left": ((0.07, 0.10, 0.66, 23, 23, 23),),
    "head_of_femur_right": ((0.07, 0.10, -0.66, 23, 23, 23),),
}
#: Organs are painted in this order; a voxel keeps the first organ painted there.
PAINT_ORDER: tuple[str, ...] = (
    "head_of_femur_left",
    "head_of_femur_right",
    "kidney_left",
    "kidney_right",
    "adrenal",
    "spleen",
    "gallbladder",
    "esophagus",
    "pancreas",
    "bladder",
    "rectum",
    "duodenum",
    "stomach",
    "liver",
    "colon",
    "intestine",
)
WALL_MM = 20.0  # organs stay this far inside the body outline
SPINE_SEMI_MM = (15.0, 19.0)  # (row, col) half-axes of the vertebral body, reference body


@dataclass
class PhantomVolume:
    """A rendered phantom in the canonical frame.

    Attributes:
        mask: uint8 ``[z, row, col]`` canonical organ ids (0 background).
        lesion: uint8 0/1 lesion channel (all zero without lesions).
        image: int16 pseudo-CT in HU.
        spacing: ``(z, row, col)`` mm.
        body: bool body mask; bone: bool spine mask.
        params: the record it was rendered from.
    """

    mask: np.ndarray
    lesion: np.ndarray
    image: np.ndarray
    spacing: tuple[float, float, float]
    body: np.ndarray
    bone: np.ndarray
    params: dict[str, Any]


# ---------------------------------------------------------------------------------------
# sampling
# ---------------------------------------------------------------------------------------
def _harmonics(rng: np.random.Generator, n: int, amp: tuple[float, float]) -> list[list[float]]:
    """``n`` terms ``[w_z, w_row, w_col, phase, amplitude]``: amp * sin(w . direction + phase)."""
    out = []
    for _ in range(n):
        w = rng.normal(size=3)
        w *= rng.uniform(1.5, 3.5) / max(float(np.linalg.norm(w)), 1e-9)
        out.append(
            [*(float(v) for v in w), float(rng.uniform(0, 2 * np.pi)), float(rng.uniform(*amp))]
        )
    return out


def _rotation(angles_deg: Sequence[float]) -> np.ndarray:
    """Rotation matrix acting on (z, row, col): in-plane yaw, then two tilts."""
    yaw, pitch, roll = (math.radians(a) for a in angles_deg)
    cy, sy, cp, spp, cr, sr = (
        math.cos(yaw),
        math.sin(yaw),
        math.cos(pitch),
        math.sin(pitch),
        math.cos(roll),
        math.sin(roll),
    )
    r_yaw = np.array([[1, 0, 0], [0, cy, -sy], [0, sy, cy]])  # about z (in-plane)
    r_pitch = np.array([[cp, -spp, 0], [spp, cp, 0], [0, 0, 1]])  # tilts z toward row
    r_roll = np.array([[cr, 0, -sr], [0, 1, 0], [sr, 0, cr]])  # tilts z toward col
    return r_yaw @ r_pitch @ r_roll


def _anchor(lobes) -> np.ndarray:
    """Volume-weighted centre (t, y, x) of an organ's lobes."""
    arr = np.asarray(lobes, dtype=np.float64)
    w = arr[:, 3] * arr[:, 4] * arr[:, 5]
    return (arr[:, :3] * w[:, None]).sum(0) / w.sum()


def _layout_lobes(layout: str, rng: np.random.Generator) -> dict[str, tuple[list, bool]]:
    """Organ -> (lobes (t, y, x, sz, sr, sc) after the layout, shape mirrored?)."""
    out: dict[str, tuple[list, bool]] = {}
    if layout == "canonical":
        return {o: ([list(lb) for lb in ANATOMY[o]], False) for o in ORGANS}
    if layout == "mirrored":
        return {o: ([[lb[0], lb[1], -lb[2], *lb[3:]] for lb in ANATOMY[o]], True) for o in ORGANS}
    if layout != "random":
        raise ConfigError(f"unknown phantom layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    slots = [_anchor(ANATOMY[o]) for o in ORGANS]
    perm = rng.permutation(len(ORGANS))
    for i, organ in enumerate(ORGANS):
        own = _anchor(ANATOMY[organ])
        slot = slots[int(perm[i])]
        side = 1.0 if rng.random() < 0.5 else -1.0
        own_side = 1.0 if own[2] >= 0 else -1.0
        flip = side != own_side
        lobes = []
        for lb in ANATOMY[organ]:
            dt, dy, dx = lb[0] - own[0], lb[1] - own[1], lb[2] - own[2]
            if flip:
                dx = -dx
            lobes.append([slot[0] + dt, slot[1] + dy, side * abs(slot[2]) + dx, *lb[3:]])
        out[organ] = (lobes, flip)
    return out


@dataclass(frozen=True)
class _Frame:
    """Where one subject sits in its grid: maps anatomy units (t, y, x) to mm (z, row, col)."""

    z_start: float  # mm of t = 0
    extent: float  # mm from t = 0 to t = 1
    center_r: float
    center_c: float
    half_ap: float
    half_lr: float

    def to_mm(self, t: float, y: float, x: float) -> list[float]:
        """World mm (z, row, col) of the anatomy point (t, y, x)."""
        return [
            self.z_start + t * self.extent,
            self.center_r + y * self.half_ap,
            self.center_c + x * self.half_lr,
        ]

    def scales(self) -> tuple[float, float, float, float]:
        """(left-right, antero-posterior, z, mean in-plane) scale to the reference body."""
        s_lr, s_ap = self.half_lr / REF_HALF_LR_MM, self.half_ap / REF_HALF_AP_MM
        s_z = self.extent / REF_EXTENT_MM
        return s_lr, s_ap, s_z, (s_lr + s_ap) / 2


def _sample_grid(
    rng: np.random.Generator, preset: SizePreset, in_plane: int | None, n_slices: int | None
) -> tuple[int, int, float, float, _Frame]:
    """Draw the grid and body size: (nz, n, slice mm, in-plane mm, frame)."""
    n = int(in_plane or preset.in_plane)
    nz = (
        int(n_slices) if n_slices else int(rng.integers(preset.n_slices[0], preset.n_slices[1] + 1))
    )
    if n < 32 or nz < 8:
        raise ConfigError(
            f"phantom grid too small ({nz} slices of {n}x{n}); use >= 8 slices of >= 32x32"
        )
    dz = float(rng.uniform(*preset.slice_mm))
    half_lr = float(rng.uniform(125.0, 155.0))
    half_ap = half_lr * float(rng.uniform(0.65, 0.80))
    dxy = 2.0 * half_lr * float(rng.uniform(1.12, 1.30)) / n
    fov_z = nz * dz
    extent = fov_z * float(rng.uniform(0.88, 0.97))
    z_start = float(rng.uniform(0.0, fov_z - extent)) - dz / 2  # mm of t = 0
    center_r = (n - 1) * dxy / 2 + float(rng.uniform(-0.04, 0.04)) * n * dxy
    center_c = (n - 1) * dxy / 2  # the body midline is the middle column
    frame = _Frame(z_start, extent, center_r, center_c, half_ap, half_lr)
    return nz, n, dz, dxy, frame


def _sample_body(rng: np.random.Generator, frame: _Frame) -> dict[str, Any]:
    """The body outline: an ellipse with 3 in-plane harmonics and a slow wave along z."""
    return {
        "center_mm": [frame.center_r, frame.center_c],
        "half_ap_mm": frame.half_ap,
        "half_lr_mm": frame.half_lr,
        "harmonics": [
            [k, float(rng.uniform(0.0, 0.04)), float(rng.uniform(0, 2 * np.pi))] for k in (2, 3, 4)
        ],
        "z_wave": [
            float(rng.uniform(0.0, 0.05)),
            float(rng.uniform(0.5, 1.5)),
            float(rng.uniform(0, 2 * np.pi)),
        ],
    }


def _sample_spine(rng: np.random.Generator, frame: _Frame) -> dict[str, Any]:
    """The vertebral body: 60-70 mm in front of the back, on the midline."""
    s_xy = frame.scales()[3]
    return {
        "center_mm": [
            frame.center_r + frame.half_ap - float(rng.uniform(60.0, 70.0)),
            frame.center_c,
        ],
        "semi_mm": [SPINE_SEMI_MM[0] * s_xy, SPINE_SEMI_MM[1] * s_xy],
    }


def _sample_organs(
    rng: np.random.Generator, placed: dict[str, tuple[list, bool]], frame: _Frame
) -> list[dict[str, Any]]:
    """Every organ in :data:`PAINT_ORDER`: per organ a scale and shift, per lobe a pose and shape."""
    s_lr, s_ap, s_z, _ = frame.scales()
    organs = []
    for organ in PAINT_ORDER:
        lobes_rel, mirror = placed[organ]
        scale = float(rng.uniform(0.85, 1.15))
        shift = rng.normal(0.0, 6.0, size=3)
        lobes = []
        for t, y, x, sz, sr, sc in lobes_rel:
            center = np.asarray(frame.to_mm(t, y, x)) + shift
            lobes.append(
                {
                    "center_mm": [float(v) for v in center],
                    "semi_mm": [sz * s_z * scale, sr * s_ap * scale, sc * s_lr * scale],
                    "angles_deg": [
                        float(rng.uniform(-15, 15)),
                        float(rng.uniform(-8, 8)),
                        float(rng.uniform(-8, 8)),
                    ],
                    "mirror": bool(mirror),
                    "harmonics": _harmonics(rng, 3, (0.03, 0.10)),
                }
            )
        organs.append({"name": organ, "id": ORGAN_ID[organ], "lobes": lobes})
    return organs


def _sample_lesions(
    rng: np.random.Generator, organs: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """0-4 round lesions, 4-14 mm in radius, inside the first liver lobe."""
    liver = next(o for o in organs if o["name"] == "liver")["lobes"][0]
    lesion_list = []
    for _ in range(int(rng.integers(0, 5))):
        u = rng.normal(size=3)
        u *= rng.uniform(0.0, 1.0) ** (1 / 3) * 0.6 / max(float(np.linalg.norm(u)), 1e-9)
        center = _lobe_to_world(liver, u)
        lesion_list.append(
            {
                "center_mm": [float(v) for v in center],
                "radius_mm": float(rng.uniform(4.0, 14.0)),
                "harmonics": _harmonics(rng, 2, (0.05, 0.15)),
            }
        )
    return lesion_list


def sample_phantom_params(
    rng: np.random.Generator,
    layout: str = "canonical",
    *,
    size: str = "small",
    lesions: bool = True,
    in_plane: int | None = None,
    n_slices: int | None = None,
    intensities: str = "ct",
) -> dict[str, Any]:
    """Draw one phantom subject: a JSON-serialisable record for :func:`render_phantom`.

    Args:
        rng: the only source of randomness (seed it with ``spar_bench.seeding.derive_seed``).
        layout: ``canonical``, ``mirrored`` or ``random`` (see the module docstring).
        size: a :data:`SIZES` preset (``small``, ``medium``, ``large``).
        lesions: draw 0-4 liver lesions.
        in_plane, n_slices: override the preset's in-plane size / number of slices.
        intensities: ``ct`` or ``distinct`` (see the module docstring).

    Raises:
        ConfigError: unknown layout, size or intensities, or a too-small grid.
    """
    _check_choices(layout, size, intensities)
    # The draws happen in this order (grid, body, spine, layout, organs, lesions, render
    # seed, distinct HU): changing it changes every phantom of a given seed.
    nz, n, dz, dxy, frame = _sample_grid(rng, SIZES[size], in_plane, n_slices)
    body = _sample_body(rng, frame)
    spine = _sample_spine(rng, frame)
    organs = _sample_organs(rng, _layout_lobes(layout, rng), frame)
    lesion_list = _sample_lesions(rng, organs) if lesions else []
    return {
        "version": PHANTOM_VERSION,
        "layout": layout,
        "size": size,
        "shape": [nz, n, n],
        "spacing": [dz, dxy, dxy],
        "body": body,
        "spine": spine,
        "wall_mm": WALL_MM,
        "organs": organs,
        "lesions": lesion_list,
        "render_seed": int(rng.integers(0, 2**62)),
        **({"intensities": "distinct", "organ_hu": distinct_organ_hu(rng)} if intensities == "distinct" else {}),
    }


def _check_choices(layout: str, size: str, intensities: str) -> None:
    """ConfigError naming the bad choice and the valid ones."""
    for what, value, valid in (("layout", layout, LAYOUTS), ("size", size, tuple(SIZES)),
                               ("intensities", intensities, INTENSITIES)):
        if value not in valid:
            raise ConfigError(f"unknown phantom {what} {value!r}; choose one of {', '.join(valid)}")


@dataclass(frozen=True)
class PhantomOptions:
    """What every case of a phantom dataset is drawn with; ``phantom.json`` records it.

    ``layout`` (:data:`LAYOUTS`), the dataset ``seed``, ``lesions`` (liver lesions in some
    cases), ``size`` (:data:`SIZES`) or an explicit grid (``in_plane`` voxels, ``n_slices``),
    and ``intensities`` (:data:`INTENSITIES`). A bad choice is a one-line ConfigError.
    """

    layout: str = "canonical"
    seed: int = 0
    lesions: bool = True
    size: str = "small"
    in_plane: int | None = limited(None, lo=32, flag="--in-plane")
    n_slices: int | None = limited(None, lo=8, flag="--slices")
    intensities: str = "ct"

    def __post_init__(self) -> None:
        _check_choices(self.layout, self.size, self.intensities)
        check_fields(self)

    def case_options(self) -> dict[str, Any]:
        """The keyword arguments of :func:`sample_phantom_params` every case shares."""
        return dict(size=self.size, lesions=self.lesions, in_plane=self.in_plane, n_slices=self.n_slices,
                    intensities=self.intensities)


def distinct_organ_hu(rng: np.random.Generator) -> dict[str, float]:
    """Organ -> mean HU of the ``distinct`` intensities: its fixed level plus N(0, 3 HU).

    The levels (:data:`~spar_bench.builder.synth.render.DISTINCT_HU_LEVELS`, in the order
    of :data:`~spar_bench.builder.synth.render.DISTINCT_ORDER`) are the same for every
    case, so an organ can be recognised by its intensity in any layout.
    """
    jitter = rng.normal(0.0, DISTINCT_JITTER_HU, size=len(DISTINCT_ORDER))
    return {o: round(float(DISTINCT_HU_LEVELS[k] + jitter[k]), 3) for k, o in enumerate(DISTINCT_ORDER)}


def _lobe_to_world(lobe: dict[str, Any], u: np.ndarray) -> np.ndarray:
    """World mm of the lobe-local normalised point ``u`` (inverse of :func:`_lobe_local`)."""
    p = _rotation(lobe["angles_deg"]) @ (np.asarray(u) * np.asarray(lobe["semi_mm"]))
    if lobe["mirror"]:
        p[2] = -p[2]
    return np.asarray(lobe["center_mm"]) + p


# ---------------------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------------------
def _blob(
    center, semi, angles, mirror: bool, harmonics, shape, spacing
) -> tuple[tuple[slice, slice, slice], np.ndarray] | None:
    """Voxels of one deformed, rotated ellipsoid: (bounding-box slices, bool array)."""
    center = np.asarray(center, dtype=np.float64)
    semi = np.asarray(semi, dtype=np.float64)
    sp = np.asarray(spacing, dtype=np.float64)
    reach = semi.max() * (1.0 + sum(abs(h[4]) for h in harmonics))
    lo = np.maximum(np.floor((center - reach) / sp).astype(int), 0)
    hi = np.minimum(np.ceil((center + reach) / sp).astype(int) + 1, shape)
    if np.any(hi <= lo):
        return None
    box = tuple(slice(int(a), int(b)) for a, b in zip(lo, hi, strict=True))
    grids = np.meshgrid(
        *(np.arange(a, b) * s - c for a, b, s, c in zip(lo, hi, sp, center, strict=True)),
        indexing="ij",
    )
    p = np.stack(grids, axis=-1)  # (..., 3) mm relative to the centre
    if mirror:
        p[..., 2] = -p[..., 2]
    rot = _rotation(angles)
    u = (p @ rot) / semi  # rot.T @ p for each point
    rho = np.linalg.norm(u, axis=-1)
    d = u / np.maximum(rho, 1e-9)[..., None]
    radius = np.ones_like(rho)
    for wz, wr, wc, phase, amp in harmonics:
        radius += amp * np.sin(d @ np.array([wz, wr, wc]) + phase)
    return box, rho <= radius


def _body_mask(params: dict[str, Any]) -> np.ndarray:
    nz, nr, nc = params["shape"]
    dz, dr, dc = params["spacing"]
    b = params["body"]
    rows = np.arange(nr)[:, None] * dr - b["center_mm"][0]
    cols = np.arange(nc)[None, :] * dc - b["center_mm"][1]
    theta = np.arctan2(rows, cols)
    deform = np.ones_like(theta)
    for k, amp, phase in b["harmonics"]:
        deform += amp * np.cos(k * theta + phase)
    amp_z, freq_z, phase_z = b["z_wave"]
    out = np.empty((nz, nr, nc), dtype=bool)
    for z in range(nz):
        s = 1.0 + amp_z * math.sin(2 * math.pi * freq_z * z / max(nz - 1, 1) + phase_z)
        rho = np.hypot(rows / (b["half_ap_mm"] * s), cols / (b["half_lr_mm"] * s))
        out[z] = rho <= deform
    return out


def organ_shape(organ: dict, shape: tuple[int, int, int], spacing) -> np.ndarray:
    """The union of an organ's lobes (its params record), before carving by other organs."""
    region = np.zeros(shape, dtype=bool)
    for lb in organ["lobes"]:
        got = _blob(
            lb["center_mm"], lb["semi_mm"], lb["angles_deg"], lb["mirror"], lb["harmonics"], shape, spacing
        )
        if got is not None:
            region[got[0]] |= got[1]
    return region


def render_phantom(params: dict[str, Any]) -> PhantomVolume:
    """Render the subject described by ``params`` (from :func:`sample_phantom_params`).

    A pure function: the same record gives the same arrays, byte for byte.
    """
    try:
        shape = tuple(int(v) for v in params["shape"])
        spacing = tuple(float(v) for v in params["spacing"])
        organs, lesions = params["organs"], params["lesions"]
    except (KeyError, TypeError) as e:
        raise SparError(
            f"phantom params record is incomplete or malformed ({e!r}); re-sample it"
        ) from None
    nz, nr, nc = shape
    body = _body_mask(params)
    s = params["spine"]
    rows = np.arange(nr)[:, None] * spacing[1] - s["center_mm"][0]
    cols = np.arange(nc)[None, :] * spacing[2] - s["center_mm"][1]
    spine2d = (rows / s["semi_mm"][0]) ** 2 + (cols / s["semi_mm"][1]) ** 2 <= 1.0
    bone = np.broadcast_to(spine2d, shape) & body
    interior = (inplane_depth(body, spacing) > params["wall_mm"]) & ~bone

    mask = np.zeros(shape, dtype=np.uint8)
    for organ in organs:
        region = organ_shape(organ, shape, spacing)
        region &= interior & (mask == 0)
        mask[region] = organ["id"]

    lesion = np.zeros(shape, dtype=np.uint8)
    liver = mask == ORGAN_ID["liver"]
    for les in lesions:
        r = float(les["radius_mm"])
        got = _blob(
            les["center_mm"], [r, r, r], [0.0, 0.0, 0.0], False, les["harmonics"], shape, spacing
        )
        if got is not None:
            lesion[got[0]] |= got[1].astype(np.uint8)
    lesion &= liver.astype(np.uint8)

    image = render_pseudo_ct(
        mask, spacing, lesion=lesion, seed=int(params["render_seed"]), body=body, bone=bone,
        organ_hu=params.get("organ_hu"),
    )
    return PhantomVolume(mask, lesion, image, spacing, body, np.ascontiguousarray(bone), params)


def make_phantom(seed: int, layout: str = "canonical", **kwargs: Any) -> PhantomVolume:
    """Sample and render one subject from an integer seed (``kwargs`` as for sampling)."""
    params = sample_phantom_params(np.random.default_rng(int(seed)), layout, **kwargs)
    return render_phantom(params)


# ---------------------------------------------------------------------------------------
# writing a WORD-layout dataset
# ---------------------------------------------------------------------------------------
#: split -> (image folder, label folder): the WORD layout (:mod:`spar_bench.builder.sources.word`).
SPLIT_DIRS = {split: (images, labels) for images, labels, split in WORD_SPLIT_DIRS}
LESION_LABEL = 17


def split_counts(n: int) -> dict[str, int]:
    """WORD's 100/20/30 proportions for ``n`` cases, at least one per split when n >= 3."""
    if n < 1:
        raise ConfigError(f"need at least one phantom case, got n={n}")
    if n < 3:
        return {"train": n - (n == 2), "val": 0, "test": int(n == 2)}
    val = max(1, round(n * 20 / 150))
    test = max(1, round(n * 30 / 150))
    return {"train": n - val - test, "val": val, "test": test}


def assign_splits(n: int, seed: int) -> list[str]:
    """Split of each case index: :func:`split_counts` shuffled by ``seed`` (deterministic)."""

    counts = split_counts(n)
    labels = [s for s in ("train", "val", "test") for _ in range(counts[s])]
    rng = np.random.default_rng(derive_seed(seed, "phantom", "splits", n))
    return [labels[i] for i in rng.permutation(n)]


def lps_affine(spacing: Sequence[float], shape: Sequence[int]) -> np.ndarray:
    """NIfTI affine of a canonical volume stored as ``canonical.transpose(2, 1, 0)``.

    Voxel axes (i, j, k) = (column, row, z) point to the patient's Left, Posterior and
    Superior (axis codes L,P,S, like the WORD files); the volume is centred on the
    world origin.
    """
    dz, dr, dc = (float(v) for v in spacing)
    nz, nr, nc = shape
    aff = np.diag([-dc, -dr, dz, 1.0])
    aff[:3, 3] = [(nc - 1) * dc / 2, (nr - 1) * dr / 2, -(nz - 1) * dz / 2]
    return aff


def _save_nifti(path: Path, canonical: np.ndarray, spacing, dtype) -> None:
    import nibabel as nib

    data = np.ascontiguousarray(canonical.transpose(2, 1, 0)).astype(dtype, copy=False)
    img = nib.Nifti1Image(data, lps_affine(spacing, canonical.shape))
    img.set_qform(img.affine, code=1)
    img.set_sform(img.affine, code=1)
    img.header.set_xyzt_units("mm")
    img.header.set_data_dtype(dtype)
    nib.save(img, str(path))


def owned_phantom(out_dir: Path) -> set[str] | None:
    """The files of the phantom dataset at ``out_dir``, or None if it is not one."""
    try:
        record = json.loads((Path(out_dir) / "phantom.json").read_text(encoding="utf-8"))
        cases = record["cases"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    files = {"phantom.json"}
    for case_id, case in cases.items():
        dirs = SPLIT_DIRS.get(case.get("split")) if isinstance(case, dict) else None
        if dirs is None:
            return None
        files |= {f"{d}/{case_id}.nii.gz" for d in dirs}
    return files


def _prepare_out(out_dir: Path, overwrite: bool) -> bool:
    """True when ``out_dir`` holds an earlier phantom dataset that may be replaced."""

    check_target(out_dir)
    return claim(out_dir, overwrite=overwrite, owned=owned_phantom, what="phantom dataset")


def _write_case(
    tmp: Path, case_id: str, split: str, case_seed: int, layout: str, sample: dict[str, Any]
) -> dict[str, Any]:
    """Sample, render and save one case under ``tmp``; its entry of ``phantom.json``.

    ``sample`` holds the keyword arguments of :func:`sample_phantom_params`.
    """
    params = sample_phantom_params(np.random.default_rng(case_seed), layout, **sample)
    vol = render_phantom(params)
    labels = vol.mask.copy()
    labels[vol.lesion.astype(bool)] = LESION_LABEL
    images_dir, labels_dir = SPLIT_DIRS[split]
    _save_nifti(tmp / images_dir / f"{case_id}.nii.gz", vol.image, vol.spacing, np.int16)
    _save_nifti(tmp / labels_dir / f"{case_id}.nii.gz", labels, vol.spacing, np.uint8)
    present = [o for o in ORGANS if np.any(vol.mask == ORGAN_ID[o])]
    return {
        "split": split,
        "seed": case_seed,
        "shape": list(vol.mask.shape),
        "spacing": list(vol.spacing),
        "organs_present": len(present),
        "lesion_voxels": int(vol.lesion.sum()),
        "params": params,
    }


def _write_cases(tmp: Path, opts: PhantomOptions, splits: list[str], progress: bool,
                 workers: int = 1) -> dict[str, Any]:
    """Write every case (``phantom_NNNN``, split ``splits[i]``) under ``tmp``; their records.

    With ``workers > 1`` the cases are rendered in that many processes. Each case depends only
    on its own derived seed and is written to its own file, and the records are gathered in
    case order, so the dataset is byte-identical whatever ``workers``.
    """
    from tqdm.auto import tqdm

    for d in SPLIT_DIRS.values():
        for sub in d:
            (tmp / sub).mkdir()
    n = len(splits)
    width = max(4, len(str(n - 1)))
    ids = [f"phantom_{i:0{width}d}" for i in range(n)]
    layout, sample = opts.layout, opts.case_options()
    jobs = [(tmp, cid, splits[i], derive_seed(opts.seed, "phantom", cid, layout), layout, sample)
            for i, cid in enumerate(ids)]
    bar = tqdm(total=n, desc=f"phantom ({layout})", unit="case", disable=not progress)
    with bar:
        if workers <= 1 or n <= 1:
            return _gather(ids, (_write_case(*job) for job in jobs), bar)
        with process_pool(min(workers, n)) as pool:
            futures = [pool.submit(_write_case, *job) for job in jobs]
            return _gather(ids, (f.result() for f in futures), bar)


def _gather(ids: list[str], records: Iterable[dict[str, Any]], bar) -> dict[str, Any]:
    """``{case_id: record}`` in case order, ticking the progress bar per finished case."""
    out: dict[str, Any] = {}
    for case_id, record in zip(ids, records, strict=True):
        out[case_id] = record
        bar.update()
    return out


def _dataset_record(opts: PhantomOptions, n: int, splits: list[str], cases: dict[str, Any]) -> dict[str, Any]:
    """The ``phantom.json`` record (``intensities`` only when not ``ct``, and a grid that
    overrides the size preset last: default records are unchanged)."""
    return {
        "generator": "spar-bench phantom (spar_bench.builder.phantom.generate)",
        "generator_version": PHANTOM_VERSION,
        "seed": int(opts.seed),
        "layout": opts.layout,
        "n": int(n),
        "size": opts.size,
        "lesions": bool(opts.lesions),
        **({"intensities": opts.intensities} if opts.intensities != "ct" else {}),
        "label_manifest": "phantom",
        "lesion_label": LESION_LABEL,
        "file_axcodes": "LPS",
        "splits": {s: sum(1 for x in splits if x == s) for s in SPLIT_DIRS},
        "cases": cases,
        **{k: int(v) for k, v in (("in_plane", opts.in_plane), ("n_slices", opts.n_slices)) if v},
    }


def _move_into_place(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished ``tmp`` folder to ``out``, replacing an earlier phantom dataset."""

    if out.exists():
        _prepare_out(out, overwrite)  # still only what an earlier phantom run wrote
        remove(out)
    tmp.rename(out)


def write_phantom_dataset(
    out_dir: str | Path,
    n: int,
    options: PhantomOptions | None = None,
    *,
    overwrite: bool = False,
    progress: bool = True,
    workers: int = 1,
) -> dict[str, Any]:
    """Write ``n`` phantom cases drawn with ``options`` (:class:`PhantomOptions`; default:
    canonical, seed 0, lesions, ``small``, ``ct``) as a WORD-layout folder and return its
    ``phantom.json`` record.

    Layout: ``imagesTr/labelsTr`` (train), ``imagesVal/labelsVal`` (val),
    ``imagesTs/labelsTs`` (test), files ``phantom_NNNN.nii.gz``; the split is
    :func:`assign_splits`. Images are int16 HU, labels uint8 with the ids of
    ``manifests/labels/phantom.json`` (1..16 WORD organs, 17 = liver lesion). Arrays are
    stored in L,P,S voxel order like the real WORD files (:func:`lps_affine`), so reading
    them back exercises the same reorientation as users' data. Case ``phantom_NNNN``
    is sampled from ``derive_seed(seed, "phantom", case_id, layout)``.

    ``out_dir/phantom.json`` records the generator version, seed, layout, n, size,
    ``intensities`` (only when not ``ct``, so default records are unchanged) and each
    case's split and full params. The folder is written in a temporary sibling and
    renamed into place, so an interrupted run leaves no partial dataset. ``workers``
    processes render the cases; the bytes do not depend on it.

    Raises:
        ConfigError: ``out_dir`` is non-empty without ``overwrite`` (or is not a
            phantom dataset), or a bad layout, size or ``n``.
    """

    out, opts = Path(out_dir), options or PhantomOptions()
    splits = assign_splits(int(n), int(opts.seed))
    _prepare_out(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        cases = _write_cases(tmp, opts, splits, progress, workers)
        record = _dataset_record(opts, n, splits, cases)
        (tmp / "phantom.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        _move_into_place(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record
