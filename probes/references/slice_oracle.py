"""The slice oracle: Levels 1-3 answered from the build's masks, as a
:class:`~.predictors.Predictor` (run kind ``slice-oracle``; Level 4's is :mod:`.mask_oracle`).

* Level 3: every question recomputed from the 224 label / lesion masks of its slice
  (``vqa --model oracle:pixels``'s rule, :func:`spar_bench.probes.vqa.oracle.decide` with
  what the prompt states: :func:`stated_cuts`); -1, a miss, where an organ asked about is not
  visible in the slice.
* Levels 1-2: the centroids the targets are measured from, on the source slice's mask (a
  mosaic's tiles carry no position, so only the mask answers them): exact by construction.

It is the ceiling row of the calibration table (:mod:`spar_bench.experiments.calibration`).
Its blind baseline is the probe's prior (the question-only optimum). A Level 3 item is
answered by its slice, organs and axis alone, so items are matched to the build's questions
by ``(row, organ A, organ B, axis)`` (:func:`question_index`): any subset of a split's
items (its mirrored counterfactuals, say) is answered as in the whole split.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spar_bench.builder.samples.pixels import pixel_class, stated_band
from spar_bench.builder.schema import LEVEL_SPECS
from spar_bench.errors import ConfigError

from ..runs.build_job import OnBuild
from ..runs.predictors import ConstantPrior
from ..vqa.questions import load_questions


def stated_cuts(q, i: int) -> tuple[float, ...]:
    """What question ``i`` of ``q`` (:class:`~spar_bench.probes.vqa.questions.Questions`) states
    in its prompt: its size or distance cuts, or the symmetry band in %."""

    return tuple(q.cuts[i]) if q.cuts is not None else ((stated_band(q.band),) if q.band is not None else ())


def item_keys(t) -> list[tuple[int, int, int, int]]:
    """``(row, organ A, organ B, axis)`` of every Level 3 item of ``t``: what answers it."""
    y = t.y
    return list(zip(t.rows.tolist(), y["organ_a"].tolist(), y["organ_b"].tolist(), y["axis"].tolist(), strict=True))


def question_index(q, t) -> np.ndarray:
    """For every item of ``t``, the index of a question of ``q`` with its row, organs and axis
    (the items of a split and its questions are read from the same build rows)."""
    where = {k: i for i, k in enumerate(item_keys(q.t))}
    try:
        return np.array([where[k] for k in item_keys(t)], dtype=np.int64)
    except KeyError as e:
        raise ConfigError(f"{t.spec.name}: item {e.args[0]} has no question in the build's {t.split} "
                          "split (items and questions must come from the same build)") from None


def split_questions(build, spec, split: str):
    """The probe's questions of one split of ``build`` (:func:`~spar_bench.probes.vqa.questions.load_questions`)."""

    return load_questions(build, spec, [split])


def pixel_answer(q, i: int, label: np.ndarray, lesion: np.ndarray) -> int:
    """Question ``i``'s class measured on its slice's 224 masks (the build's pixel reader,
    :func:`spar_bench.builder.samples.pixels.pixel_class`); -1 when it cannot be answered."""

    cls = pixel_class(q.probe, int(q.axis[i]), label, lesion, (int(q.organ_a[i]), int(q.organ_b[i])),
                      float(q.mm_per_pixel[i]), stated_cuts(q, i), q.min_pixels or 1)
    return -1 if cls is None else cls


@dataclass
class SliceOracle(OnBuild):
    """The slice oracle of one Level 1-3 probe on ``build`` (see the module doc)."""

    spec: Any
    build: Any
    kind: str = "slice-oracle"
    answers: dict[str, tuple[Any, np.ndarray]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if LEVEL_SPECS[self.spec.level].volume:
            raise ConfigError(f"the slice oracle answers Levels 1-3, not {self.spec.name} (Level 4: the "
                              "mask oracle, kind 'oracle')")

    @classmethod
    def on_build(cls, spec, build) -> SliceOracle:
        return cls(spec, build)

    def fit(self, train, val) -> None:
        return None

    def blind(self) -> ConstantPrior:
        return ConstantPrior(self.spec)

    def split_answers(self, split: str) -> tuple[Any, np.ndarray]:
        """``(questions, answers)`` of every Level 3 question of ``split`` (computed once)."""
        if split not in self.answers:
            q = split_questions(self.build, self.spec, split)
            rows = np.unique(q.row)
            read = lambda f: dict(zip(rows.tolist(), self.build.images(self.spec.level, split, rows, field=f),  # noqa: E731
                                      strict=True))
            label, lesion = read("label"), read("lesion")
            pred = [pixel_answer(q, i, label[int(q.row[i])], lesion[int(q.row[i])]) for i in range(len(q))]
            self.answers[split] = (q, np.array(pred, dtype=np.int64))
        return self.answers[split]

    def predict(self, t, split: str = "test") -> np.ndarray:
        if self.spec.output == "points":  # Level 1: the organ's own centroid
            return np.nan_to_num(t.y["centroid"], nan=0.5)
        if self.spec.output == "assignment":  # Level 2: the true arrangement
            return t.y["target_slot"].copy()
        q, pred = self.split_answers(split)
        return pred[question_index(q, t)]
