"""Probe targets read from a build's shards, aligned row by row to a feature cache.

A feature cache stores one feature row per Level 1/2 sample or per Level 3 slice, in
the split's canonical order, with the sample/slice keys. :func:`load_targets` reads
the targets of one probe and one split from the build (what it reads is the probe
spec's business: :meth:`spar_bench.probes.tasks.ProbeSpec.load_targets`, which builds on
this module's :class:`Targets`, :func:`cache_rows` and :func:`read_fields`; this module
imports no probe) and maps every
item (a mosaic sample, or a Level 3 question) to its cache row BY KEY, so a cache
written in another order, or holding only part of a split, can never silently pair
features with the wrong labels: a key the cache lacks raises
:class:`~spar_bench.errors.IntegrityError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from spar_bench.builder.schema import LEVEL_SPECS
from spar_bench.errors import ConfigError, IntegrityError

if TYPE_CHECKING:  # annotations only: tasks imports this module
    from .tasks import ProbeSpec


@dataclass
class Targets:
    """The items of one probe on one split.

    Attributes:
        spec: the probe (a :class:`~spar_bench.probes.tasks.ProbeSpec`).
        split: split name.
        rows: ``(N,)`` int64 cache row of each item's features.
        patient: ``(N,)`` str patient id (the bootstrap unit).
        is_mirror: ``(N,)`` bool, item comes from a left-right mirrored counterfactual.
        y: the spec's arrays: Level 1 ``centroid`` (N,16,2), ``present`` (N,16),
            ``mm_per_pixel`` (N,); Level 2 additionally ``target_slot``, ``present_pos``
            and ``perm`` (N,16); Level 3 ``answer``, ``organ_a``, ``organ_b``, ``axis``,
            ``probe`` (N,) int64; Level 4 the same with ``organ_c`` and ``mm_per_voxel``
            (questions), or ``centroid`` (N,16,3), ``present``, ``mm_per_voxel`` and ``size``
            (the volume's side S in voxels) (localisation).
        is_flipped: ``(N,)`` bool, item comes from a superior-inferior flipped counterfactual
            (Level 4), or None when the level's rows have no such field (Levels 1-3):
            :attr:`flipped` is then all False and no flipped block is reported.
    """

    spec: ProbeSpec
    split: str
    rows: np.ndarray
    patient: np.ndarray
    is_mirror: np.ndarray
    y: dict[str, np.ndarray] = field(default_factory=dict)
    is_flipped: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    @property
    def flipped(self) -> np.ndarray:
        """``(N,)`` bool: the flipped counterfactual items (all False without the field)."""
        return self.is_flipped if self.is_flipped is not None else np.zeros(len(self), bool)

    @property
    def original(self) -> np.ndarray:
        """``(N,)`` bool: the items that are no counterfactual copy (neither mirrored nor flipped)."""
        return ~(np.asarray(self.is_mirror, bool) | self.flipped)

    def subset(self, mask_or_index: np.ndarray) -> Targets:
        """The items selected by a boolean mask or an index array."""
        s = mask_or_index
        return Targets(
            self.spec,
            self.split,
            self.rows[s],
            self.patient[s],
            self.is_mirror[s],
            {k: v[s] for k, v in self.y.items()},
            None if self.is_flipped is None else self.is_flipped[s],
        )


def concat(ts: list[Targets]) -> Targets:
    """The items of several :class:`Targets` of one probe, in order."""
    if len(ts) == 1:
        return ts[0]
    return Targets(
        ts[0].spec,
        "+".join(t.split for t in ts),
        np.concatenate([t.rows for t in ts]),
        np.concatenate([t.patient for t in ts]),
        np.concatenate([t.is_mirror for t in ts]),
        {k: np.concatenate([t.y[k] for t in ts]) for k in ts[0].y},
        None if ts[0].is_flipped is None else np.concatenate([t.flipped for t in ts]),
    )


def cache_rows(cache_keys: np.ndarray, build_keys: np.ndarray, where: str) -> np.ndarray:
    """The cache row of every build key; a key the cache lacks is an :class:`IntegrityError`."""
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


class ProbeUnavailable(ConfigError):
    """The build has no items of this probe (e.g. counting without lesion masks, or a Level 4
    probe on a build made without the opt-in Level 4)."""


def no_lesions(manifest: dict, probe: str) -> str | None:
    """Why a counting probe has no items: ``"no lesions in this source (word)"`` when ``probe``
    counts lesions and no source of the build (its ``manifest``) annotates any; else None."""
    if probe.rsplit(".", 1)[-1] != "counting":
        return None
    sources = manifest.get("sources") or {}
    if any(isinstance(v, dict) and (v.get("label_map") or {}).get("has_lesions") for v in sources.values()):
        return None
    named = ", ".join(sorted(sources)) or "no source recorded"
    return f"no lesions in this source ({named}: no lesion masks, nothing to count)"


def missing_level(what: str, level: str, levels) -> ConfigError:
    """``"<what> has no <level>; levels: ..."`` (``what``: ``"<path>: build"`` or ``"<path>:
    cache"``): a :class:`ProbeUnavailable` for an opt-in level (Level 4, volumes: ``spar-probe
    fit --probes all`` skips its probes on a build or cache without it), a plain
    :class:`ConfigError` for the default levels."""

    spec = LEVEL_SPECS.get(level)
    cls = ProbeUnavailable if spec is not None and spec.volume else ConfigError
    return cls(f"{what} has no {level}; levels: {', '.join(levels)}")


def read_fields(build, level: str, split: str, names: list[str]) -> dict[str, np.ndarray]:
    """``names`` of ``level``/``split`` of ``build``; a missing level or field is one line."""
    if level not in build.levels():
        raise missing_level(f"{build.root}: build", level, build.levels())
    missing = sorted(set(names) - set(build.fields(level, split)))
    if missing:
        raise ConfigError(
            f"{build.root}/{level}/{split}: shards lack field(s) {missing}; rebuild with this version"
        )
    return build.read(level, split, names)


class TargetReader(Protocol):
    """What :func:`load_targets` needs of a probe: a :class:`~spar_bench.probes.tasks.ProbeSpec`
    (this module knows no probe: ``tasks`` builds on it, never the other way)."""

    def load_targets(self, build, split: str, cache_keys: np.ndarray) -> Targets: ...


def load_targets(build, spec: TargetReader, split: str, cache_keys: np.ndarray) -> Targets:
    """Targets of probe ``spec`` (a spec; resolve a name with ``tasks.get_probe``) on ``split``
    of ``build``.

    ``build`` is a ``spar_bench.builder.shards.Build``; ``cache_keys`` are the cache's
    keys for ``(spec.level, split)``.
    """
    return spec.load_targets(build, split, cache_keys)


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
