"""Level 3 questions of one probe, read from a build, with their slices' images on demand."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from spar_bench.builder.schema import LEVEL3_PROBES

from spar_bench.errors import ConfigError, IntegrityError

Q_FIELDS = ("q_key", "q_slice", "q_probe", "q_axis", "q_organ_a", "q_organ_b", "q_answer")


@dataclass(frozen=True)
class Questions:
    """The questions of one probe on some splits (arrays of equal length, sorted by key).

    ``split`` and ``row`` locate each question's slice (``Build.images("level3", split, row)``).
    """

    probe: str
    key: np.ndarray
    split: np.ndarray
    row: np.ndarray
    patient: np.ndarray
    is_mirror: np.ndarray
    answer: np.ndarray
    organ_a: np.ndarray
    organ_b: np.ndarray
    axis: np.ndarray

    def __len__(self) -> int:
        return int(self.key.shape[0])

    def subset(self, mask: np.ndarray) -> Questions:
        return Questions(self.probe, *(getattr(self, f)[mask] for f in _ARRAYS))


_ARRAYS = ("key", "split", "row", "patient", "is_mirror", "answer", "organ_a", "organ_b", "axis")


def _one_split(build, probe: str, split: str) -> dict[str, np.ndarray]:
    have = set(build.fields("level3", split))
    s = build.read("level3", split, ["patient_id", *(["is_mirror"] if "is_mirror" in have else [])])
    q = build.read("level3", split, list(Q_FIELDS))
    keep = q["q_probe"].astype(np.int64) == LEVEL3_PROBES.index(probe)
    rows = q["q_slice"][keep].astype(np.int64)
    mirror = s["is_mirror"].astype(bool) if "is_mirror" in s else np.zeros(len(s["patient_id"]), bool)
    return {
        "key": q["q_key"][keep].astype(str),
        "split": np.full(rows.shape, split, dtype=object).astype(str),
        "row": rows,
        "patient": s["patient_id"].astype(str)[rows],
        "is_mirror": mirror[rows],
        "answer": q["q_answer"][keep].astype(np.int64),
        "organ_a": q["q_organ_a"][keep].astype(np.int64),
        "organ_b": q["q_organ_b"][keep].astype(np.int64),
        "axis": q["q_axis"][keep].astype(np.int64),
    }


def load_questions(build, probe: str, splits: list[str], n_classes: int) -> Questions:
    """Every question of ``probe`` on ``splits``, ordered by question key (deterministic)."""
    if "level3" not in build.levels():
        raise ConfigError(f"{build.root}: build has no level3; levels: {', '.join(build.levels())}")
    parts = [_one_split(build, probe, s) for s in splits]
    cat = {f: np.concatenate([p[f] for p in parts]) for f in _ARRAYS}
    a = cat["answer"]
    if a.size and (a.min() < 0 or a.max() >= n_classes):
        raise IntegrityError(f"{build.root}: {probe} answers outside 0..{n_classes - 1}; shards corrupt")
    order = np.argsort(cat["key"], kind="stable")
    return Questions(probe, *(cat[f][order] for f in _ARRAYS))


def train_answers(build, probe: str) -> np.ndarray | None:
    """Answers of the probe's original training questions (for the majority control)."""
    if "train" not in build.splits("level3"):
        return None
    d = _one_split(build, probe, "train")
    return d["answer"][~d["is_mirror"]]
