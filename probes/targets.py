"""Probe targets read from a build's shards, aligned row by row to a feature cache.

A feature cache stores one feature row per Level 1/2 sample or per Level 3 slice, in
the split's canonical order, with the sample/slice keys. :func:`load_targets` reads
the targets of one probe and one split from the build and maps every item (a mosaic
sample, or a Level 3 question) to its cache row BY KEY, so a cache written in another
order, or holding only part of a split, can never silently pair features with the
wrong labels: a key the cache lacks raises :class:`~spar_bench.errors.IntegrityError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from spar_bench.errors import ConfigError, IntegrityError

from .heads import Task

L12_FIELDS = ("key", "patient_id", "present", "centroid", "mm_per_pixel")
L2_FIELDS = ("target_slot", "present_pos")
L3_SLICE_FIELDS = ("key", "patient_id", "mm_per_pixel")
L3_Q_FIELDS = ("q_slice", "q_probe", "q_axis", "q_organ_a", "q_organ_b", "q_answer")


@dataclass
class Targets:
    """The items of one probe on one split.

    Attributes:
        task: the probe.
        split: split name.
        rows: ``(N,)`` int64 cache row of each item's features.
        patient: ``(N,)`` str patient id (the bootstrap unit).
        is_mirror: ``(N,)`` bool, item comes from a left-right mirrored counterfactual.
        y: per-level arrays: Level 1 ``centroid`` (N,16,2), ``present`` (N,16),
            ``mm_per_pixel`` (N,); Level 2 additionally ``target_slot`` (N,16) and
            ``present_pos`` (N,16); Level 3 ``answer``, ``organ_a``, ``organ_b``,
            ``axis``, ``probe`` (N,) int64.
    """

    task: Task
    split: str
    rows: np.ndarray
    patient: np.ndarray
    is_mirror: np.ndarray
    y: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def subset(self, mask_or_index: np.ndarray) -> Targets:
        """The items selected by a boolean mask or an index array."""
        s = mask_or_index
        return Targets(
            self.task,
            self.split,
            self.rows[s],
            self.patient[s],
            self.is_mirror[s],
            {k: v[s] for k, v in self.y.items()},
        )


def _cache_index(cache_keys: np.ndarray, build_keys: np.ndarray, where: str) -> np.ndarray:
    index = {str(k): i for i, k in enumerate(cache_keys)}
    rows = np.fromiter(
        (index.get(str(k), -1) for k in build_keys), dtype=np.int64, count=len(build_keys)
    )
    if (rows < 0).any():
        missing = build_keys[rows < 0]
        raise IntegrityError(
            f"{where}: the feature cache lacks {missing.size} of {len(build_keys)} keys "
            f"(first: {missing[0]!s}); re-run `spar-probe cache` on this build"
        )
    return rows


def load_targets(build, task: Task, split: str, cache_keys: np.ndarray) -> Targets:
    """Targets of ``task`` on ``split`` of ``build`` (a ``spar_bench.builder.shards.Build``).

    ``cache_keys`` are the cache's keys for ``(task.level, split)``.
    """
    level = task.level
    if level not in build.levels():
        raise ConfigError(
            f"{build.root}: build has no {level}; levels: {', '.join(build.levels())}"
        )
    where = f"{build.root}/{level}/{split}"
    have = set(build.fields(level, split))
    mirror_field = ["is_mirror"] if "is_mirror" in have else []
    if level in ("level1", "level2"):
        names = [*L12_FIELDS, *(L2_FIELDS if level == "level2" else ()), *mirror_field]
        d = build.read(level, split, names)
        n = len(d["key"])
        y = {
            "centroid": d["centroid"].astype(np.float32),
            "present": d["present"].astype(bool),
            "mm_per_pixel": d["mm_per_pixel"].astype(np.float32),
        }
        if level == "level2":
            y["target_slot"] = d["target_slot"].astype(np.int64)
            y["present_pos"] = d["present_pos"].astype(bool)
        return Targets(
            task,
            split,
            _cache_index(cache_keys, d["key"], where),
            d["patient_id"].astype(str),
            d["is_mirror"].astype(bool) if mirror_field else np.zeros(n, bool),
            y,
        )
    s = build.read(level, split, [*L3_SLICE_FIELDS, *mirror_field])
    q = build.read(level, split, list(L3_Q_FIELDS))
    keep = q["q_probe"].astype(np.int64) == task.probe_index
    qs = q["q_slice"][keep].astype(np.int64)
    slice_rows = _cache_index(cache_keys, s["key"], where)
    is_mirror = s["is_mirror"].astype(bool) if mirror_field else np.zeros(len(s["key"]), bool)
    answer = q["q_answer"][keep].astype(np.int64)
    if answer.size and (answer.min() < 0 or answer.max() >= task.n_classes):
        raise IntegrityError(
            f"{where}: {task.probe} answers outside 0..{task.n_classes - 1}; the shards are corrupt"
        )
    return Targets(
        task,
        split,
        slice_rows[qs],
        s["patient_id"].astype(str)[qs],
        is_mirror[qs],
        {
            "answer": answer,
            "organ_a": q["q_organ_a"][keep].astype(np.int64),
            "organ_b": q["q_organ_b"][keep].astype(np.int64),
            "axis": q["q_axis"][keep].astype(np.int64),
            "probe": np.full(answer.shape, task.probe_index, dtype=np.int64),
            "mm_per_pixel": s["mm_per_pixel"].astype(np.float32)[qs],
        },
    )


def holdout_patients(patient: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Boolean mask of the items of a seeded ``fraction`` of patients (at least one, never all).

    Used as the validation set when a cache has no ``val`` split.
    """
    uniq = np.unique(patient)
    if uniq.size < 2:
        raise ConfigError(
            "no val split and fewer than 2 training patients: cannot hold out a validation set"
        )
    k = int(np.clip(round(fraction * uniq.size), 1, uniq.size - 1))
    chosen = rng.choice(uniq, size=k, replace=False)
    return np.isin(patient, chosen)
