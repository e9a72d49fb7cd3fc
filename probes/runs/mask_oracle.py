"""The Level 4 mask oracle: every answer recomputed from the build's STORED label and lesion
volumes (never from the stored ``q_answer``), as a :class:`~.predictors.Predictor`.

Level 4 measures everything on the stored isotropic volumes (docs/PROTOCOL.md "Level 4"), so
a reader of those volumes answers every question exactly: the oracle must score 100 % on
every Level 4 probe, on the original, mirrored and flipped items alike, and localisation's
MED must be 0 (up to float32 rounding of the stored centroids). Anything less is a
labelling bug. It measures with the sampler's own functions
(:mod:`spar_bench.builder.samples.level4`: ``organ_measures``, ``exact_gap``,
``lesion_components``), applied to the stored arrays, and reads the rules' parameters
(``symmetry_band``, ``adjacency_mm``, ``lesion_min_voxels``) from the build's ``sample_config``.
The MLLM track's ``oracle`` (:mod:`spar_bench.probes.vqa.oracle`) uses :class:`Volume` and
:func:`answer` too.

* localisation: each organ's voxel centroid ((col + 0.5) / S, (row + 0.5) / S, (z + 0.5) / S);
  an absent organ is put at the centre (it is not scored);
* relative position (axis 0: A to the patient's left, larger col; 1: A anterior, smaller row;
  2: A superior, larger z), distance (|AB| < |AC|), volume (vA > vB), symmetry (left member:
  larger col), adjacency (surface gap <= ``adjacency_mm``), containment (the largest 3-D lesion
  component's organ) and counting (3-D components, 26-connectivity, of at least
  ``lesion_min_voxels``).

Its blind baseline abstains: -1 (no answer: a miss) for a question, the volume's centre for
localisation. The items must have been loaded on the build's own rows
(:class:`~.inputs.BuildKeys`: :class:`~.build_job.BuildJob` does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from spar_bench.builder.samples.level4 import (
    exact_gap,
    lesion_components,
    normalised_centroid,
    organ_measures,
)
from spar_bench.builder.schema import BILATERAL_PAIRS, LEVEL4_PROBES, LEVEL_SPECS, N_ORGANS, ORGANS
from spar_bench.errors import ConfigError

from .build_job import OnBuild

#: the rules' parameters and their defaults (docs/PROTOCOL.md "Level 4"), read from the build
RULES = {"symmetry_band": 0.15, "adjacency_mm": 3.0, "lesion_min_voxels": 3}


@dataclass
class Volume:
    """One stored volume: its label (S, S, S) canonical ids, lesion (S, S, S) 0/1, voxel size and
    the rules' parameters, measured with the sampler's own functions
    (:mod:`spar_bench.builder.samples.level4`) on these stored arrays."""

    label: np.ndarray
    lesion: np.ndarray
    mm: float
    rules: dict[str, float]

    @cached_property
    def organs(self):
        """Voxel counts, centroids (voxels and mm), volumes of the 16 organs (``VolumeOrgans``)."""

        return organ_measures(self.label, self.mm, 1)

    def normalised_centroid(self) -> np.ndarray:
        """(16, 3) normalised (x, y, z) = ((col + 0.5) / S, (row + 0.5) / S, (z + 0.5) / S); 0.5 when absent."""

        c = normalised_centroid(self.organs, self.label.shape[0])
        return np.where(np.isfinite(c), c, np.float32(0.5))

    def gap(self, a: int, b: int) -> float:
        """mm between the surfaces of organs a and b (0-based): the least distance between a voxel
        centre of each, less one voxel (face-touching voxels: 0)."""

        return exact_gap(self.label, a, b, self.mm, self.organs)  # boxes measured once per volume

    @cached_property
    def components(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The 3-D lesion components: (labels, the counted ids, their voxel counts)."""

        return lesion_components(self.lesion, int(self.rules["lesion_min_voxels"]))

    def container(self) -> int:
        """The 0-based organ holding > 50 % of the largest counted lesion component, or -1."""
        labels, counted, sizes = self.components
        if len(counted) == 0:
            return -1
        largest = counted[int(np.argmax(sizes))]  # ties: the first in label order
        inside = np.bincount(self.label[labels == largest], minlength=N_ORGANS + 1)[1:]
        best = int(np.argmax(inside))
        return best if 2 * int(inside[best]) > int(sizes.max()) else -1


def left_right(v: Volume, a: int, b: int) -> tuple[int, int]:
    """(left member, right member) of a bilateral pair: the larger centroid col is on the patient's
    left; on a tie the left-named member."""
    ca, cb = v.organs.centroid_vox[a, 2], v.organs.centroid_vox[b, 2]
    if ca != cb:
        return (a, b) if ca > cb else (b, a)
    named = {ORGANS.index(left) for left, _ in BILATERAL_PAIRS}
    return (a, b) if a in named else (b, a)


def answer(probe: str, v: Volume, a: int, b: int, c: int, axis: int) -> int:
    """The class of one Level 4 question, measured on volume ``v`` (organs 0-based)."""
    g = v.organs
    if probe == "relative_position":  # (z, row, col): left = larger col, anterior = smaller row, superior = larger z
        k = (2, 1, 0)[axis]
        ca, cb = g.centroid_mm[a, k], g.centroid_mm[b, k]
        return int(ca < cb) if axis == 1 else int(ca > cb)
    if probe == "distance":
        return int(g.dist_mm(a, c) < g.dist_mm(a, b))
    if probe == "volume":
        return int(g.volume_mm3[a] > g.volume_mm3[b])
    if probe == "symmetry":
        left, right = left_right(v, a, b)
        vl, vr = g.volume_mm3[left], g.volume_mm3[right]
        d, band = (vl - vr) / ((vl + vr) / 2.0), v.rules["symmetry_band"]
        return 0 if d > band else 2 if d < -band else 1
    if probe == "adjacency":
        return int(v.gap(a, b) <= v.rules["adjacency_mm"])
    if probe == "containment":
        return int(a >= 0 and v.container() == a)
    if probe == "counting":
        return min(len(v.components[1]), 3)
    raise ConfigError(f"mask oracle: no rule for Level 4 probe {probe!r}")


@dataclass
class MaskOracle(OnBuild):
    """The mask oracle of one Level 4 probe on ``build`` (see the module doc); ``sees`` False: its
    blind baseline, which abstains."""

    spec: Any
    build: Any
    sees: bool = True
    kind: str = "oracle"
    mm_per_voxel: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not LEVEL_SPECS[self.spec.level].volume:
            raise ConfigError(f"the mask oracle answers Level 4 (volume) probes only, not {self.spec.name}")

    @classmethod
    def on_build(cls, spec, build) -> MaskOracle:
        return cls(spec, build)

    def fit(self, train, val) -> None:
        return None

    def blind(self) -> MaskOracle:
        return MaskOracle(self.spec, self.build, sees=False)

    def rules(self) -> dict[str, float]:
        cfg = self.build.manifest.get("sample_config") or {}
        return {k: cfg.get(k, default) for k, default in RULES.items()}

    def volume(self, split: str, row: int, rules: dict) -> Volume:
        """The stored label and lesion volumes of build row ``row`` of ``split``, and its voxel size."""
        if split not in self.mm_per_voxel:
            self.mm_per_voxel[split] = self.build.read(self.spec.level, split, ["mm_per_voxel"])["mm_per_voxel"]
        read = lambda f: self.build.images(self.spec.level, split, np.array([row]), field=f)[0]  # noqa: E731
        return Volume(read("label"), read("lesion"), float(self.mm_per_voxel[split][row]), rules)

    def predict(self, t, split: str = "test") -> np.ndarray:
        points = self.spec.output == "points"
        if not self.sees:
            return np.full((len(t), *self.spec.output_shape), 0.5, np.float32) if points \
                else np.full(len(t), -1, np.int64)
        out = np.zeros((len(t), *self.spec.output_shape), np.float32) if points else np.zeros(len(t), np.int64)
        rules = self.rules()
        for row in np.unique(t.rows).tolist():
            v = self.volume(split, row, rules)
            items = np.flatnonzero(t.rows == row)
            if points:
                out[items] = v.normalised_centroid()
                continue
            probe = LEVEL4_PROBES[self.spec.index]
            y = t.y
            for i in items.tolist():
                out[i] = answer(probe, v, int(y["organ_a"][i]), int(y["organ_b"][i]), int(y["organ_c"][i]),
                                int(y["axis"][i]))  # fmt: skip
        return out
