"""The fixed vocabulary of SPAR-Bench: canonical organs, frame, probes, shard schema.

Everything that two parts of the toolkit must agree on lives here, once.
See docs/PROTOCOL.md for the prose spec and docs/FORMATS.md for the file layouts.

Canonical frame
---------------
Every canonical array is indexed ``[z, row, col]``:

* ``z``   increases from inferior to superior (slice 0 is the most caudal);
* ``row`` increases from anterior to posterior (row 0 is anterior);
* ``col`` increases from the patient's RIGHT to the patient's LEFT (column 0 is the
  patient's right), i.e. the radiological display convention.

In nibabel terms this is the voxel orientation ``("L", "P", "S")`` for array axes
``(i, j, k)``, transposed to ``(k, j, i)``. ``spacing`` is ``(z, row, col)`` in mm.
Every "left/right" in a label, question or doc is the PATIENT's left/right: an
organ on the patient's left has a LARGER column index.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMA_VERSION = "1.0"
# The protocol's version, PROTOCOL_VERSION, is the core's (spar_bench/provenance.py): runs
# record it too, and the core imports nothing from the builder.

#: The 16 WORD organs; canonical id = index + 1 (0 is background).
ORGANS: tuple[str, ...] = (
    "liver",
    "spleen",
    "kidney_left",
    "kidney_right",
    "stomach",
    "gallbladder",
    "esophagus",
    "pancreas",
    "duodenum",
    "colon",
    "intestine",
    "adrenal",
    "rectum",
    "bladder",
    "head_of_femur_left",
    "head_of_femur_right",
)
N_ORGANS = len(ORGANS)
ORGAN_ID: dict[str, int] = {name: i + 1 for i, name in enumerate(ORGANS)}

#: Bilateral pairs (left member, right member), by canonical name.
BILATERAL_PAIRS: tuple[tuple[str, str], ...] = (
    ("kidney_left", "kidney_right"),
    ("head_of_femur_left", "head_of_femur_right"),
)

#: Orientation of canonical voxel axes (i, j, k) before the transpose to [z, row, col].
CANONICAL_AXCODES = ("L", "P", "S")


@dataclass(frozen=True)
class LevelSpec:
    """What the builder does differently for one level: the one place it looks that up.

    Attributes:
        name: the level's name (``"level1"``): its folder, shard ``level`` attr and key part.
        unit: what one row is, the key of its row count in the manifest's ``counts``:
            ``"samples"`` (a mosaic) or ``"slices"`` (a whole axial slice).
        mosaic: rows are 4x4 mosaics of organ tiles with per-organ ``present`` /
            ``centroid`` fields (Level 1 and 2); False for whole-slice levels (Level 3).
        shuffled: the mosaic's tiles are permuted per sample (``perm``, ``target_slot``,
            ``present_pos``), with targets in ``SampleConfig.arrangement``, which the shard
            attrs record (Level 2).
        questions: name of the per-case questions part whose rows point at this level's rows
            (``"level3_questions"``: ``q_*`` fields in the same shards), or None.
        probes: the probes of its questions, in ``q_probe`` order (:data:`LEVEL3_PROBES`).
        classes: each probe's answer class names, in the order of ``probes``.

    What the build does with a level's rows after the sampler (fit thresholds, finish the
    answers left open) are the level's hooks,
    :func:`spar_bench.builder.samples.levels.level_hooks` (they use the sampler's code, which
    imports this module, so they live beside it).
    """

    name: str
    unit: str
    mosaic: bool
    shuffled: bool = False
    questions: str | None = None
    probes: tuple[str, ...] = ()
    classes: tuple[tuple[str, ...], ...] = ()
    #: the questions table's field that points at this level's rows (``q_slice``, ``q_volume``)
    row_field: str = "q_slice"
    #: rows are whole 3-D volumes (``image``/``label``/``lesion`` of shape (S, S, S)): Level 4
    volume: bool = False


#: The six Level 3 probes, then all eight probes.
LEVEL3_PROBES: tuple[str, ...] = (
    "relative_position",
    "orientation",
    "symmetry",
    "size",
    "distance",
    "counting",
)
PROBES: tuple[str, ...] = (
    "level1.localisation",
    "level2.arrangement",
    *(f"level3.{p}" for p in LEVEL3_PROBES),
)
#: Number of answer classes of each Level 3 probe.
LEVEL3_N_CLASSES: dict[str, int] = {
    "relative_position": 2,
    "orientation": 8,
    "symmetry": 3,
    "size": 3,
    "distance": 3,
    "counting": 4,
}
#: Human-readable class names of each Level 3 probe (index = answer).
LEVEL3_CLASS_NAMES: dict[str, tuple[str, ...]] = {
    # axis 0 (left/right): 1 = A lies to the patient's LEFT of B.
    # axis 1 (anterior/posterior): 1 = A lies ANTERIOR of B.
    "relative_position": ("no", "yes"),
    # direction from A's centroid to B's, in the patient frame, counter-clockwise
    # starting at the patient's left: 0 left, 1 left-anterior, 2 anterior, ...
    "orientation": (
        "left",
        "left-anterior",
        "anterior",
        "right-anterior",
        "right",
        "right-posterior",
        "posterior",
        "left-posterior",
    ),
    # A = the member on the patient's left side, B = the member on the right side.
    "symmetry": ("left_larger", "similar", "right_larger"),
    "size": ("small", "medium", "large"),
    "distance": ("near", "medium", "far"),
    "counting": ("0", "1", "2", "3+"),
}
RELATIVE_POSITION_AXES = ("left_right", "anterior_posterior")

#: The Level 4 (volume) question probes, in ``q_probe`` order; Level 4 also has a
#: localisation probe read from the rows (``centroid``, (x, y, z) per organ). See
#: docs/PROTOCOL.md "Level 4".
LEVEL4_PROBES: tuple[str, ...] = (
    "relative_position",
    "distance",
    "volume",
    "symmetry",
    "adjacency",
    "containment",
    "counting",
)
LEVEL4_CLASS_NAMES: dict[str, tuple[str, ...]] = {
    # axis 0: 1 = A lies to the patient's LEFT of B; axis 1: A ANTERIOR of B;
    # axis 2: A SUPERIOR of B (centroids, mm).
    "relative_position": ("no", "yes"),
    # organ A's centroid is closer to organ B's (0) or to organ C's (1).
    "distance": ("B", "C"),
    # 1 = organ A's volume is larger than organ B's.
    "volume": ("no", "yes"),
    # A = the member on the patient's left side, B = the right side; by volume.
    "symmetry": ("left_larger", "similar", "right_larger"),
    # 1 = A and B touch: the gap between their surfaces is at most ``adjacency_mm``.
    "adjacency": ("no", "yes"),
    # 1 = the largest lesion lies inside organ A.
    "containment": ("no", "yes"),
    # 3-D lesion components (26-connectivity).
    "counting": ("0", "1", "2", "3+"),
}
LEVEL4_N_CLASSES: dict[str, int] = {p: len(c) for p, c in LEVEL4_CLASS_NAMES.items()}
VOLUME_AXES = ("left_right", "anterior_posterior", "superior_inferior")

#: Every level, in build order: names, row units and features (see :class:`LevelSpec`).
LEVEL_SPECS: dict[str, LevelSpec] = {
    spec.name: spec
    for spec in (
        LevelSpec("level1", unit="samples", mosaic=True),
        LevelSpec("level2", unit="samples", mosaic=True, shuffled=True),
        LevelSpec("level3", unit="slices", mosaic=False, questions="level3_questions", probes=LEVEL3_PROBES,
                  classes=tuple(LEVEL3_CLASS_NAMES[p] for p in LEVEL3_PROBES)),
        LevelSpec("level4", unit="volumes", mosaic=False, questions="level4_questions",
                  probes=LEVEL4_PROBES, classes=tuple(LEVEL4_CLASS_NAMES[p] for p in LEVEL4_PROBES),
                  row_field="q_volume", volume=True),
    )
}
#: Level names, in build order.
LEVELS = tuple(LEVEL_SPECS)
#: Every per-case result part: the levels' rows, then their questions tables.
LEVEL_PARTS: tuple[str, ...] = (
    *LEVELS, *(s.questions for s in LEVEL_SPECS.values() if s.questions)
)

IMAGE_SIZE = 224
TILE_GRID = 4
TILE_SIZE = IMAGE_SIZE // TILE_GRID  # 56
SPLITS = ("train", "val", "test")
#: Per-sample 2-D image fields (HDF5: one sample per chunk, compressed; Parquet: PNG images).
IMAGE_FIELDS = ("image", "label", "lesion")
ARRANGEMENTS = ("rows-by-y", "rank-x", "rank-y")


def ordered_splits(names) -> list[str]:
    """``train``, ``val``, ``test`` first (those present), then any other split alphabetically:
    the one split order of shards, manifests, the dataset card and readers."""
    names = set(names)
    return [s for s in SPLITS if s in names] + sorted(names - set(SPLITS))


def organ_index(name: str) -> int:
    """0-based index of a canonical organ name (raises with the valid names)."""
    try:
        return ORGANS.index(name)
    except ValueError:
        raise KeyError(f"unknown organ {name!r}; canonical organs: {', '.join(ORGANS)}") from None
