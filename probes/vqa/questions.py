"""Level 3 questions of one probe on some splits, read through the probe's spec.

The answers, organs, axis, patients and mirror flags come from
:meth:`spar_bench.probes.tasks.QuestionSpec.load_targets` (the same reader ``fit`` uses);
here the question keys and splits are added, and each question's ``row`` is its
slice's row in its split (``Build.images(spec.level, split, row)``).

What the prompt states beside the organs (protocol 1.2, :class:`.prompts.PromptContext`)
comes from the build too: the slice's ``mm_per_pixel``, the manifest's symmetry band and
the size / distance thresholds of each question's organ or pair. The MLLM's answer to a
size or distance question is its stored measurement (``q_area_a_mm2``, ``q_distance_mm``)
classed by the thresholds AS STATED (one decimal), so the prompt decides it exactly; the
encoders' probes keep the stored ``q_answer`` (full-precision thresholds). The two differ
only for a measurement within 0.05 of a threshold.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from spar_bench.builder.samples.pixels import stated
from spar_bench.builder.samples.thresholds import cuts_for
from spar_bench.builder.schema import LEVEL_SPECS
from spar_bench.errors import ConfigError

from ..targets import Targets, concat
from .prompts import THRESHOLD_PROBES, PromptContext, VolumeContext

#: The stored measurement a size / distance question's stated thresholds class.
MEASURE_FIELD = {"size": "q_area_a_mm2", "distance": "q_distance_mm"}


@dataclass(frozen=True)
class VolumeFacts:
    """What a Level 4 prompt states from the build: the volumes' ``side`` S (voxels), each
    question's ``mm_per_voxel``, and the manifest's symmetry band, adjacency threshold (mm)
    and smallest counted lesion (voxels), each None where the probe states none."""

    side: int
    mm_per_voxel: np.ndarray
    band: float | None = None
    adjacency_mm: float | None = None
    min_voxels: int | None = None


@dataclass(frozen=True)
class Questions:
    """The questions of one probe (``t``: its Targets) with their keys and splits.

    ``mm_per_pixel`` (per question: its slice's), ``cuts`` (``(Q, 2)`` stated size /
    distance thresholds, or None), ``measure`` (the stored area / distance those classify),
    ``band`` (symmetry) and ``min_pixels`` (counting) fill each prompt's :class:`PromptContext`.
    """

    t: Targets
    key: np.ndarray
    split: np.ndarray
    mm_per_pixel: np.ndarray | None = None
    cuts: np.ndarray | None = None
    measure: np.ndarray | None = None
    band: float | None = None
    min_pixels: int | None = None
    #: Level 4 (volumes): what the prompt states beside the organs, see :class:`VolumeFacts`
    volume: VolumeFacts | None = None

    @property
    def spec(self):
        return self.t.spec

    @property
    def probe(self) -> str:
        """The Level 3 probe's short name (``relative_position``)."""
        return self.t.spec.name.split(".", 1)[1]

    def __len__(self) -> int:
        return len(self.t)

    @cached_property
    def answer(self) -> np.ndarray:
        """The answer the MLLM is scored against: size and distance by the stated thresholds
        (see the module doc), every other probe the stored answer. Computed once (it is read
        per answer: recomputing it made scoring quadratic in the number of questions)."""
        if self.cuts is None:
            return self.t.y["answer"]
        return np.array([np.searchsorted(c, m, side="right") for c, m in zip(self.cuts, self.measure, strict=True)],
                        dtype=self.t.y["answer"].dtype)

    def context(self, i: int, image_size: int = 224) -> PromptContext:
        """What the prompt of question ``i`` states beside its organs."""
        mpp = None if self.mm_per_pixel is None else float(self.mm_per_pixel[i])
        cuts = None if self.cuts is None else (float(self.cuts[i, 0]), float(self.cuts[i, 1]))
        return PromptContext(mpp, int(image_size), cuts, self.band, self.min_pixels)

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
        """The left-right mirrored counterfactual questions."""
        return np.asarray(self.t.is_mirror, bool)

    @property
    def is_flipped(self) -> np.ndarray:
        """The superior-inferior flipped counterfactual questions (Level 4; all False else)."""
        f = getattr(self.t, "is_flipped", None)
        return np.zeros(len(self), bool) if f is None else np.asarray(f, bool)

    @property
    def original(self) -> np.ndarray:
        """The questions of no counterfactual copy (neither mirrored nor flipped)."""
        return ~(self.is_mirror | self.is_flipped)

    @property
    def organ_c(self) -> np.ndarray:
        """Organ C (Level 4 distance; -1 elsewhere)."""
        c = self.t.y.get("organ_c")
        return np.full(len(self), -1, np.int64) if c is None else c

    def volume_context(self, i: int, volume_as: str, size: int) -> VolumeContext:
        """What the Level 4 prompt of question ``i`` states: how its volume is shown, its scale
        and the probe's threshold."""
        v = self.volume
        if v is None:
            raise ConfigError(f"{self.spec.name}: not a Level 4 (volume) probe")
        return VolumeContext(volume_as, int(size), v.side, float(v.mm_per_voxel[i]), v.band, v.adjacency_mm,
                             v.min_voxels)


def _targets(build, spec, split: str) -> tuple[Targets, np.ndarray, dict[str, np.ndarray]]:
    """The probe's targets on ``split``, its question keys, and per question the slice's
    ``mm_per_pixel`` and the stored size / distance measurement (``measure``; NaN else)."""
    slices = build.read(spec.level, split, ["key", "mm_per_pixel"])
    t = spec.load_targets(build, split, slices["key"])  # rows = the slices' rows in the split
    probe = spec.name.split(".", 1)[1]
    fields = ["q_key", "q_probe"] + ([MEASURE_FIELD[probe]] if probe in MEASURE_FIELD else [])
    q = build.read(spec.level, split, fields)
    mine = q["q_probe"].astype(np.int64) == spec.index
    keys = q["q_key"][mine].astype(str)
    measure = q[MEASURE_FIELD[probe]][mine].astype(np.float64) if probe in MEASURE_FIELD \
        else np.full(len(keys), np.nan)
    extra = {"mm_per_pixel": slices["mm_per_pixel"].astype(np.float64)[t.rows], "measure": measure}
    return t, keys, extra


def _stated_cuts(build, probe: str, t: Targets) -> np.ndarray | None:
    """``(Q, 2)`` the thresholds each size / distance prompt states; None for other probes."""
    if probe not in THRESHOLD_PROBES:
        return None
    if len(t) == 0:  # no such question here (a LiTS-only build records no thresholds)
        return np.empty((0, 2), dtype=np.float64)

    values = (build.manifest.get("thresholds") or {}).get("values") or {}
    if probe not in values:
        raise ConfigError(f"{build.root}: the build records no {probe} thresholds; the {probe} prompt "
                          "states them (rebuild, or take them with --thresholds-from)")
    a, b = t.y["organ_a"], t.y["organ_b"]
    return np.array([[stated(c) for c in cuts_for(values, probe, int(a[i]), int(b[i]))] for i in range(len(t))],
                    dtype=np.float64).reshape(len(t), 2)


def is_volume_probe(spec) -> bool:
    """The probe asks about whole volumes (Level 4)."""

    level = LEVEL_SPECS.get(spec.level)
    return bool(level is not None and level.volume)


#: Per Level 4 probe, the manifest's sample-config value its prompt states (``VolumeContext``).
VOLUME_STATED = {"symmetry": ("band", "symmetry_band"), "adjacency": ("adjacency_mm", "adjacency_mm"),
                 "counting": ("min_voxels", "lesion_min_voxels")}


def _volume_questions(build, spec, split: str) -> tuple[Targets, np.ndarray, np.ndarray, int]:
    """Level 4: the probe's targets on ``split`` (rows = the volumes' rows), its question keys,
    each question's ``mm_per_voxel`` and the volumes' side S."""
    level = spec.level
    rows = build.read(level, split, ["key", "mm_per_voxel"])
    t = spec.load_targets(build, split, rows["key"])
    q = build.read(level, split, ["q_key", "q_probe"])
    keys = q["q_key"][q["q_probe"].astype(np.int64) == spec.index].astype(str)
    if len(keys) != len(t):
        raise ConfigError(f"{build.root}/{level}/{split}: {spec.name} has {len(t)} targets for {len(keys)} "
                          "questions; the shards and the probe spec disagree")
    side = int(build.images(level, split, np.array([0]))[0].shape[0]) if len(rows["key"]) else 0
    return t, keys, rows["mm_per_voxel"].astype(np.float64)[t.rows], side


def load_volume_questions(build, spec, splits: list[str]) -> Questions:
    """Every Level 4 question of ``spec`` on ``splits``, with what its prompt states
    (:class:`VolumeFacts`: the manifest's band / adjacency threshold / smallest lesion)."""
    parts = [_volume_questions(build, spec, s) for s in splits]
    t = concat([p[0] for p in parts])
    keys = np.concatenate([p[1] for p in parts])
    split = np.concatenate([np.full(len(p[1]), s) for p, s in zip(parts, splits, strict=True)]).astype(str)
    probe = spec.name.split(".", 1)[1]
    stated: dict[str, float | int | None] = {}
    if probe in VOLUME_STATED and len(t):
        name, field = VOLUME_STATED[probe]
        value = (build.manifest.get("sample_config") or {}).get(field)
        if value is None:
            raise ConfigError(f"{build.root}: the manifest's sample_config records no {field}; the level4 "
                              f"{probe} prompt states it (rebuild with this version)")
        stated[name] = int(value) if name == "min_voxels" else float(value)
    side = max(p[3] for p in parts)
    facts = VolumeFacts(side, np.concatenate([p[2] for p in parts]), **stated)
    return Questions(t, keys, split, volume=facts)


def load_questions(build, spec, splits: list[str]) -> Questions:
    """Every question of ``spec`` on ``splits``, in the splits' canonical order."""
    if spec.level not in build.levels():
        raise ConfigError(f"{build.root}: build has no {spec.level}; levels: {', '.join(build.levels())}")
    if is_volume_probe(spec):
        return load_volume_questions(build, spec, splits)
    parts = [(_targets(build, spec, s), s) for s in splits]
    t = concat([p[0][0] for p in parts])
    keys = np.concatenate([p[0][1] for p in parts])
    split = np.concatenate([np.full(len(p[0][1]), p[1]) for p in parts]).astype(str)
    mpp = np.concatenate([p[0][2]["mm_per_pixel"] for p in parts])
    measure = np.concatenate([p[0][2]["measure"] for p in parts])
    probe = spec.name.split(".", 1)[1]
    sample = build.manifest.get("sample_config") or {}
    band = sample.get("symmetry_band") if probe == "symmetry" else None
    return Questions(t, keys, split, mpp, _stated_cuts(build, probe, t), measure,
                     None if band is None else float(band), _min_pixels(build, probe))


def _min_pixels(build, probe: str) -> int | None:
    """The smallest lesion the counting prompt states (pixels of the 224 image; protocol 1.4).
    A build made before counted native voxels, which the image does not show: refused."""
    if probe != "counting":
        return None
    value = (build.manifest.get("sample_config") or {}).get("lesion_min_pixels")
    if value is None:
        raise ConfigError(f"{build.root}: built under protocol {build.manifest.get('protocol_version') or '<1.2'}, "
                          "whose counting labels count lesions of the original scan, not of the image shown; "
                          "rebuild it with this version (protocol 1.4) to ask counting questions")
    return int(value)


def train_targets(build, spec) -> Targets | None:
    """The probe's original training questions (majority and prior controls), or None."""
    if "train" not in build.splits(spec.level):
        return None
    t = _volume_questions(build, spec, "train")[0] if is_volume_probe(spec) else _targets(build, spec, "train")[0]
    flipped = getattr(t, "is_flipped", None)
    return t.subset(~(np.asarray(t.is_mirror, bool) | (False if flipped is None else np.asarray(flipped, bool))))
