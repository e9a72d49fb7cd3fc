"""Level 3 questions of one probe on some splits, read through the probe's spec.

The answers, organs, axis, patients and mirror flags come from
:meth:`spar_bench.probes.tasks.QuestionSpec.load_targets` (the same reader ``fit`` uses);
here the question keys and splits are added, and each question's ``row`` is its
slice's row in its split (``Build.images(spec.level, split, row)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spar_bench.errors import ConfigError

from ..targets import Targets, concat


@dataclass(frozen=True)
class Questions:
    """The questions of one probe (``t``: its Targets) with their keys and splits."""

    t: Targets
    key: np.ndarray
    split: np.ndarray

    @property
    def spec(self):
        return self.t.spec

    @property
    def probe(self) -> str:
        """The Level 3 probe's short name (``relative_position``)."""
        return self.t.spec.name.split(".", 1)[1]

    def __len__(self) -> int:
        return len(self.t)

    @property
    def answer(self) -> np.ndarray:
        return self.t.y["answer"]

    @property
    def organ_a(self) -> np.ndarray:
        return self.t.y["organ_a"]

    @property
    def organ_b(self) -> np.ndarray:
        return self.t.y["organ_b"]

    @property
    def axis(self) -> np.ndarray:
        return self.t.y["axis"]

    @property
    def row(self) -> np.ndarray:
        return self.t.rows

    @property
    def patient(self) -> np.ndarray:
        return self.t.patient

    @property
    def is_mirror(self) -> np.ndarray:
        return self.t.is_mirror


def _targets(build, spec, split: str) -> tuple[Targets, np.ndarray]:
    slice_keys = build.read(spec.level, split, ["key"])["key"]
    t = spec.load_targets(build, split, slice_keys)  # rows = the slices' rows in the split
    q = build.read(spec.level, split, ["q_key", "q_probe"])
    keys = q["q_key"][q["q_probe"].astype(np.int64) == spec.index].astype(str)
    return t, keys


def load_questions(build, spec, splits: list[str]) -> Questions:
    """Every question of ``spec`` on ``splits``, in the splits' canonical order."""
    if spec.level not in build.levels():
        raise ConfigError(f"{build.root}: build has no {spec.level}; levels: {', '.join(build.levels())}")
    parts = [(_targets(build, spec, s), s) for s in splits]
    t = concat([p[0][0] for p in parts])
    keys = np.concatenate([p[0][1] for p in parts])
    split = np.concatenate([np.full(len(p[0][1]), p[1]) for p in parts]).astype(str)
    return Questions(t, keys, split)


def train_targets(build, spec) -> Targets | None:
    """The probe's original training questions (majority and prior controls), or None."""
    if "train" not in build.splits(spec.level):
        return None
    t, _ = _targets(build, spec, "train")
    return t.subset(~t.is_mirror)
