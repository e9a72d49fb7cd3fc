"""The organ-map encoder read out by geometry, as a :class:`~spar_bench.probes.runs.predictors.Predictor`.

An organ-map run (:mod:`.organmaps`) says where each organ is in every token cell. Its
readout answers the geometric Level 3 probes (:data:`READOUT_PROBES`) with nothing fitted to
answers: every organ's centre from the organ head's map and its area from the share head's
(:func:`.organmaps.predict_maps`, :func:`.organmaps.map_geometry`; one map where the run has
no Dice term), then the oracle's rule for the probe with what each prompt states
(:func:`spar_bench.probes.vqa.oracle.decide`). Computation by construction: what it gets
wrong, its perception got wrong. It is the calibration's computation model on those probes
(:mod:`spar_bench.experiments.calibration`). Its blind baseline is the probe's prior.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from spar_bench.builder.samples.pixels import Geometry, decide
from spar_bench.errors import ConfigError

from ..references.slice_oracle import question_index, split_questions, stated_cuts
from ..runs.predictors import ConstantPrior
from .organmaps import load_organ_map_model, map_geometry, predict_maps, slice_level

#: The Level 3 probes an organ-map encoder answers by geometry; the others (Levels 1-2, counting:
#: lesions are not in the maps) are frozen probes of it.
READOUT_PROBES = ("level3.relative_position", "level3.orientation", "level3.symmetry", "level3.size",
                  "level3.distance")


def readout_answers(q, centre: np.ndarray, area: np.ndarray) -> np.ndarray:
    """The class of every question of ``q`` (:func:`~spar_bench.probes.vqa.questions.load_questions`)
    from every slice's label centres ``(rows, labels, 2)`` and areas in pixels ``(rows, labels)``
    (label = organ id + 1), by the oracle's rule with what each prompt states."""

    pred = np.empty(len(q), dtype=np.int64)
    for i in range(len(q)):
        r, a, o = int(q.row[i]), int(q.organ_a[i]) + 1, max(int(q.organ_b[i]), -1) + 1  # -1: no organ B
        mpp = float(q.mm_per_pixel[i])
        g = Geometry(tuple(centre[r, a]), tuple(centre[r, o]), float(area[r, a]) * mpp**2,
                     float(area[r, o]) * mpp**2, 0, mpp)
        pred[i] = decide(q.probe, int(q.axis[i]), g, stated_cuts(q, i))
    return pred


def slice_geometry(rd: Path, build, device: str = "cpu") -> tuple[np.ndarray, np.ndarray]:
    """``(centres, areas)`` of every test slice of ``build`` read from organ-map run ``rd``'s maps
    (centres from the organ head's, areas from the share head's)."""

    model = load_organ_map_model(rd, device)
    level = slice_level()
    where, share = predict_maps(model, build.images(level, "test", np.arange(build.count(level, "test"))))
    return map_geometry(where, model.grid)[0], map_geometry(share, model.grid)[1]


@dataclass
class OrganMapReadout:
    """The geometric readout of organ-map run ``rd`` on one probe of ``build`` (see the module doc).
    ``geometry``: the test slices' ``(centres, areas)`` when already read (shared by the probes)."""

    spec: Any
    build: Any
    rd: Path
    device: str = "cpu"
    geometry: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)
    kind: str = "organ-map-readout"

    def __post_init__(self) -> None:
        if self.spec.name not in READOUT_PROBES:
            raise ConfigError(f"the organ-map readout answers {', '.join(READOUT_PROBES)}, not {self.spec.name}")

    def fit(self, train, val) -> None:
        return None

    def blind(self) -> ConstantPrior:
        return ConstantPrior(self.spec)

    def predict(self, t, split: str = "test") -> np.ndarray:
        if split != "test":
            raise ConfigError(f"the organ-map readout reads the test slices, not {split!r}")
        if self.geometry is None:
            self.geometry = slice_geometry(self.rd, self.build, self.device)
        q = split_questions(self.build, self.spec, split)
        return readout_answers(q, *self.geometry)[question_index(q, t)]
