"""A Level 4 volume as an MLLM is shown it (``spar-probe vqa --volume-as``).

A stored volume is ``(S, S, S)`` uint8 in the canonical frame: axis 0 ``z`` runs from
inferior to superior, axis 1 (``row``) from anterior to posterior, axis 2 (``col``) from
the patient's right to the patient's left (docs/PROTOCOL.md "Level 4"). An axial slice
``volume[z]`` is therefore already in the radiological display convention: anterior at
the top, the patient's left on the image's right.

* ``video``: :func:`axial_frames` -- ``n = min(16, S)`` axial slices at the centres of ``n``
  equal slabs (``z_i = ((2 i + 1) S) // (2 n)``), inferior to superior, one frame each,
  every frame resized (bicubic) to ``size`` x ``size``;
* ``montage``: :func:`montage` -- the same frames in one image, a grid of ``ceil(sqrt(n))``
  columns read row by row from the top left (most inferior) to the bottom right (most
  superior), cells ``size`` px separated by :data:`GAP` px white lines;
* ``views``: :func:`views` -- three orthogonal slices through the volume's centre
  (index ``S // 2`` on each axis), side by side in one image separated by :data:`GAP` px
  white lines: axial (anterior up, patient's left on the right), coronal (superior up,
  patient's left on the right), sagittal (superior up, anterior on the left).

All are pure functions of the stored voxels and ``size``: the same volume gives the same
pixels (the response cache keys them by the volume's sha256 and ``--volume-as``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from spar_bench.errors import ConfigError

from .base import to_pil

#: How a volume is sent; ``auto``: ``video`` where the model takes video, else ``montage``.
VOLUME_AS = ("video", "montage", "views")
VOLUME_AS_CHOICES = ("auto", *VOLUME_AS)
#: Axial frames of a video or montage (fewer when the volume has fewer slices).
N_FRAMES = 16
#: White separating lines between montage cells and between views (pixels).
GAP = 2
VIEW_NAMES = ("axial", "coronal", "sagittal")


def check_volume_as(value: str) -> str:
    """``value`` when it is one of :data:`VOLUME_AS_CHOICES`, else a one-line ConfigError."""
    if value not in VOLUME_AS_CHOICES:
        raise ConfigError(f"--volume-as {value}: expected one of {', '.join(VOLUME_AS_CHOICES)}")
    return value


def n_frames(side: int) -> int:
    """Axial frames shown of a volume with ``side`` slices."""
    return min(N_FRAMES, int(side))


def frame_indices(side: int, n: int | None = None) -> np.ndarray:
    """The ``z`` of each shown frame: the centre slices of ``n`` equal slabs, inferior first."""
    n = n_frames(side) if n is None else int(n)
    i = np.arange(n, dtype=np.int64)
    return ((2 * i + 1) * int(side)) // (2 * n)


def grid_shape(n: int) -> tuple[int, int]:
    """(rows, columns) of a montage of ``n`` frames: ``ceil(sqrt(n))`` columns."""
    cols = math.ceil(math.sqrt(n))
    return math.ceil(n / cols), cols


def _check(volume: np.ndarray) -> np.ndarray:
    v = np.asarray(volume)
    if v.ndim != 3 or v.dtype != np.uint8 or len(set(v.shape)) != 1:
        raise ValueError(f"a Level 4 volume is a (S, S, S) uint8 cube, got {v.dtype} {v.shape}")
    return v


def axial_frames(volume: np.ndarray, size: int) -> tuple:
    """The video: :func:`frame_indices` axial slices as RGB PIL images of ``size`` px."""
    v = _check(volume)
    return tuple(to_pil(v[z], size) for z in frame_indices(v.shape[0]))


def _paste(cells: list, rows: int, cols: int, size: int):
    from PIL import Image

    canvas = Image.new("RGB", (cols * size + (cols - 1) * GAP, rows * size + (rows - 1) * GAP), (255, 255, 255))
    for k, cell in enumerate(cells):
        r, c = divmod(k, cols)
        canvas.paste(cell, (c * (size + GAP), r * (size + GAP)))
    return canvas


def montage(volume: np.ndarray, size: int):
    """The montage: the video's frames in one grid image (:func:`grid_shape`), row by row
    from the top left; cells left over at the end stay white."""
    frames = list(axial_frames(volume, size))
    rows, cols = grid_shape(len(frames))
    return _paste(frames, rows, cols, size)


def view_slices(volume: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The three central slices, display-oriented: axial ``v[c]`` (rows anterior to
    posterior, columns patient's right to left), coronal ``v[::-1, c, :]`` (rows superior to
    inferior, columns right to left), sagittal ``v[::-1, :, c]`` (rows superior to inferior,
    columns anterior to posterior); ``c = S // 2``."""
    v = _check(volume)
    c = v.shape[0] // 2
    return v[c], v[::-1, c, :], v[::-1, :, c]


def views(volume: np.ndarray, size: int):
    """The views: axial, coronal and sagittal (:func:`view_slices`) side by side, ``size`` px each."""
    return _paste([to_pil(s, size) for s in view_slices(volume)], 1, 3, size)


@dataclass(frozen=True)
class Shown:
    """What a request sends of a volume: one ``image`` (montage, views) or ``frames`` (video)."""

    image: Any = None
    frames: tuple | None = None


def show(volume: np.ndarray, volume_as: str, size: int) -> Shown:
    """The volume as ``volume_as`` (``video``, ``montage`` or ``views``) at ``size`` px per slice."""
    if volume_as == "video":
        return Shown(frames=axial_frames(volume, size))
    if volume_as == "montage":
        return Shown(image=montage(volume, size))
    if volume_as == "views":
        return Shown(image=views(volume, size))
    raise ConfigError(f"--volume-as {volume_as}: expected one of {', '.join(VOLUME_AS)}")
