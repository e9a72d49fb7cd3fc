"""The pixel reader: a Level 3 question's answer as a perfect reader of the stored 224 x 224
masks gives it (protocol 1.4, docs/PROTOCOL.md §5).

The sampler measures at the scan's own resolution; the image a model is shown is the 224
frame. Where the two disagree (a measurement within the frame's resampling error of a
decision boundary, an organ too thin to survive the nearest-neighbour resampling) the label
depends on what the image does not show. The build therefore answers every question again
from the stored 224 label and lesion masks alone, with the thresholds AS THE PROMPT STATES
THEM (one decimal; the band in %), stores that answer as ``q_pixel_answer`` and drops every
question whose pixel answer differs from its label or is undecidable (an organ asked about
has no pixel in the 224 label map). ``--model oracle:pixels``
(:mod:`spar_bench.probes.vqa.oracle`) calls :func:`pixel_class` too, with the numbers it reads
from the prompt's text, so it scores 100 % on every stored question.

Measurements on the masks (image x grows towards the patient's left, y towards the back):

* organ centre: the mean (x, y) of the organ's pixels; area: pixel count x ``mm_per_pixel``^2;
* distance: centre distance in pixels x ``mm_per_pixel``;
* lesions: 8-connected components of the 224 lesion mask with at least ``lesion_min_pixels``
  pixels (the counting label itself is measured this way since protocol 1.4, so counting is
  never dropped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..schema import LEVEL3_PROBES
from .thresholds import cuts_for

#: What :func:`pixel_class` answers when a question cannot be answered from the masks.
UNDECIDABLE = -1


def stated(value: float) -> float:
    """A threshold as the prompt states it (mm^2 or mm, one decimal)."""
    return round(float(value), 1)


def stated_band(band: float) -> float:
    """The symmetry band as the prompt states it, in % (``f"{100 * band:g}"``)."""
    return float(f"{100 * float(band):g}")


@dataclass(frozen=True)
class Geometry:
    """One question's measurements: centres (x, y) in pixels of the 224 frame, areas in
    mm^2, lesion count, and the slice's pixel size."""

    a: tuple[float, float]
    b: tuple[float, float]
    area_a: float
    area_b: float
    count: int
    mm_per_pixel: float


def sector(d_left: float, d_ant: float) -> int:
    """Compass sector 0..7 (0 left, 2 anterior, 4 right, 6 posterior) of a direction."""
    return int(round(math.atan2(d_ant, d_left) / (math.pi / 4))) % 8


def _tertile(value: float, cuts: tuple[float, ...]) -> int:
    return int(value >= cuts[0]) + int(value >= cuts[1])


def decide(probe: str, axis: int, g: Geometry, numbers: tuple[float, ...]) -> int:
    """The class of a question from its geometry and the numbers its prompt states
    (size / distance: the two cuts; symmetry: the band in %; others: nothing)."""
    (xa, ya), (xb, yb) = g.a, g.b
    if probe == "relative_position":
        return int(xa > xb) if axis == 0 else int(ya < yb)
    if probe == "orientation":
        return sector(xb - xa, ya - yb)
    if probe == "symmetry":  # the organ whose centre lies further to the patient's left is "left"
        left, right = (g.area_a, g.area_b) if xa > xb else (g.area_b, g.area_a)
        d, band = (left - right) / ((left + right) / 2.0), numbers[0] / 100.0
        return 0 if d > band else (2 if d < -band else 1)
    if probe == "size":
        return _tertile(g.area_a, numbers)
    if probe == "distance":
        return _tertile(math.hypot(xa - xb, ya - yb) * g.mm_per_pixel, numbers)
    if probe == "counting":
        return min(int(g.count), 3)
    raise ValueError(f"pixel reader: no rule for probe {probe!r}")


def count_components(lesion: np.ndarray, min_pixels: int) -> int:
    """8-connected components of a 2-D mask with at least ``min_pixels`` pixels."""
    from scipy import ndimage

    labels, n = ndimage.label(np.asarray(lesion) > 0, structure=np.ones((3, 3), dtype=bool))
    if n == 0:
        return 0
    return int((np.bincount(labels.ravel())[1:] >= int(min_pixels)).sum())


@dataclass(frozen=True)
class SliceReading:
    """What the pixel reader reads of one slice, once: per label id (0..K-1) its pixel count
    ``n`` and centre ``(x, y)`` (NaN where absent), the counted lesion components, the pixel size."""

    n: np.ndarray
    x: np.ndarray
    y: np.ndarray
    lesions: int
    mm_per_pixel: float

    def shows(self, organ: int) -> bool:
        """Whether organ index ``organ`` (label id ``organ + 1``) has a pixel on the slice."""
        return organ + 1 < len(self.n) and self.n[organ + 1] > 0

    def geometry(self, a: int, b: int) -> Geometry:
        """:class:`Geometry` of organs ``a`` and ``b`` (-1: none)."""
        mpp = self.mm_per_pixel

        def organ(o: int) -> tuple[tuple[float, float], float]:
            if o < 0:
                return (math.nan, math.nan), math.nan
            return (float(self.x[o + 1]), float(self.y[o + 1])), float(self.n[o + 1]) * mpp * mpp

        (ca, area_a), (cb, area_b) = organ(a), organ(b)
        return Geometry(ca, cb, area_a, area_b, self.lesions, mpp)


def read_slice(label: np.ndarray, lesion: np.ndarray | None, mpp: float, min_pixels: int) -> SliceReading:
    """Read one slice's 224 masks: every organ's pixel count and centre (the mean column and
    row of its pixels, exact: sums of integers), and the lesions of >= ``min_pixels`` pixels."""
    lab = np.asarray(label).astype(np.int64)
    rows, cols = np.indices(lab.shape)
    k = int(lab.max()) + 1 if lab.size else 1
    n = np.bincount(lab.ravel(), minlength=k)
    with np.errstate(invalid="ignore", divide="ignore"):
        x = np.bincount(lab.ravel(), weights=cols.ravel().astype(np.float64), minlength=k) / n
        y = np.bincount(lab.ravel(), weights=rows.ravel().astype(np.float64), minlength=k) / n
    count = count_components(lesion, min_pixels) if lesion is not None else 0
    return SliceReading(n, x, y, count, float(mpp))


def answer(reading: SliceReading, probe: str, axis: int, organs: tuple[int, int],
           numbers: tuple[float, ...]) -> int | None:
    """The pixel reader's class of one question on a read slice, or None when an organ asked
    about has no pixel there (no reader of the image could answer)."""
    a, b = organs
    if any(o >= 0 and not reading.shows(o) for o in (a, b)):
        return None
    return decide(probe, axis, reading.geometry(a, b), numbers)


def pixel_class(probe: str, axis: int, label: np.ndarray, lesion: np.ndarray, organs: tuple[int, int],
                mpp: float, numbers: tuple[float, ...], min_pixels: int) -> int | None:
    """:func:`answer` of one question on its slice's masks (``--model oracle:pixels``)."""
    return answer(read_slice(label, lesion, mpp, min_pixels), probe, axis, organs, numbers)


def stated_numbers(probe: str, a: int, b: int, thresholds: dict[str, Any] | None, band: float) -> tuple[float, ...]:
    """The numbers the prompt of a question states (see :func:`decide`), from the build's
    thresholds and sample config."""
    if probe in ("size", "distance"):
        if thresholds is None:
            raise ValueError(f"pixel reader: a {probe} question needs the build's thresholds")
        return tuple(stated(c) for c in cuts_for(thresholds, probe, a, b))
    if probe == "symmetry":
        return (stated_band(band),)
    return ()


def pixel_answers(rows: dict[str, np.ndarray], questions: dict[str, np.ndarray],
                  thresholds: dict[str, Any] | None, band: float, min_pixels: int) -> np.ndarray:
    """``(Q,)`` int8: each question's pixel answer on its slice's stored masks (``rows``:
    the case's ``level3`` arrays, indexed by ``q_slice``); :data:`UNDECIDABLE` where none."""
    out = np.full(len(questions["q_key"]), UNDECIDABLE, dtype=np.int8)
    read: dict[int, SliceReading] = {}
    for i in range(len(out)):
        s = int(questions["q_slice"][i])
        if s not in read:
            read[s] = read_slice(rows["label"][s], rows["lesion"][s], float(rows["mm_per_pixel"][s]), min_pixels)
        probe = LEVEL3_PROBES[int(questions["q_probe"][i])]
        a, b = int(questions["q_organ_a"][i]), int(questions["q_organ_b"][i])
        cls = answer(read[s], probe, int(questions["q_axis"][i]), (a, b), stated_numbers(probe, a, b, thresholds, band))
        out[i] = UNDECIDABLE if cls is None else cls
    return out


#: The stored native measurement a size / distance label classes (its prompt states the cuts).
MEASURED = {"size": "q_area_a_mm2", "distance": "q_distance_mm"}


def answerable(questions: dict[str, np.ndarray], thresholds: dict[str, Any] | None) -> np.ndarray:
    """The questions the build keeps: the pixel answer is the label and, for size and
    distance, the stored measurement classed by the cuts AS STATED (one decimal; what the
    MLLM track scores against) gives the label too (it differs only within 0.05 of a cut)."""
    keep = np.asarray(questions["q_pixel_answer"]) == np.asarray(questions["q_answer"])
    probe = np.asarray(questions["q_probe"]).astype(np.int64)
    for name, field in MEASURED.items():
        for i in np.flatnonzero(keep & (probe == LEVEL3_PROBES.index(name))):
            a, b = int(questions["q_organ_a"][i]), int(questions["q_organ_b"][i])
            cuts = stated_numbers(name, a, b, thresholds, 0.0)
            keep[i] = _tertile(float(questions[field][i]), cuts) == int(questions["q_answer"][i])
    return keep
