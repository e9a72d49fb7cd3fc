"""Map each source's labels to the canonical organs (by name), from manifests/labels/*.json.

A :class:`LabelMap` turns a raw label array into canonical ``uint8`` organ ids
(``spar_bench.builder.schema.ORGAN_ID``) plus an optional binary lesion channel, and says which
canonical organs the source annotates at all. Raw values the map does not know raise
a :class:`~spar_bench.errors.CaseError` naming the case, the file and the values: a label
is never dropped or renamed silently.

Manifests (``manifests/labels/<name>.json``):

* ``word.json``, ``lits.json`` (``"kind": "ids"``): ``labels`` maps raw id -> canonical
  organ; ``lesion_labels`` lists raw ids that also form the lesion channel;
  ``annotated`` (optional) lists the organs the source annotates (default: the mapped ones).
* ``totalsegmentator.json`` (``"kind": "classes"``): ``classes`` maps a per-class mask
  file name -> canonical organ (several classes may unite into one organ).
* ``nnunet.json`` (``"kind": "synonyms"``): canonical organ -> label names, matched
  after :func:`normalise_name`.

Every approximation is listed in the manifest's ``approximations`` and copied into the
label map recorded with each build.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from spar_bench.errors import CaseError, ConfigError

from .schema import N_ORGANS, ORGAN_ID, ORGANS

#: The shipped label maps (package data of ``spar_bench.manifests``; works from a wheel).
LABELS_DIR = resources.files("spar_bench.manifests") / "labels"

#: A label naming both members of a bilateral pair, by stem: split by side after reorientation.
SIDED_PAIRS: dict[str, tuple[str, str]] = {"kidney": ("kidney_left", "kidney_right")}
#: Temporary id of sided voxels in a raw-grid mask, until :func:`split_sided`.
SIDED_ID = 255

_SIDE_WORDS = {"r": "right", "rt": "right", "l": "left", "lt": "left"}


@cache
def load_manifest(name: str) -> dict[str, Any]:
    """The parsed ``manifests/labels/<name>.json``; ConfigError if missing or invalid."""
    path = LABELS_DIR / f"{name}.json"
    if not path.is_file():
        known = sorted(p.name[:-5] for p in LABELS_DIR.iterdir() if p.name.endswith(".json"))
        raise ConfigError(f"no label manifest {name!r}; known label maps: {', '.join(known)}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from None


def normalise_name(name: str) -> str:
    """Canonical spelling of a label name: ``"Kidney (R)"`` == ``"right kidney"`` == ``"kidney_right"``."""
    words = re.sub(r"[^a-z0-9]+", " ", name.lower()).split()
    return " ".join(sorted(_SIDE_WORDS.get(w, w) for w in words))


def _check_organ(organ: str, where: str) -> int:
    if organ not in ORGAN_ID:
        raise ConfigError(f"{where}: {organ!r} is not a canonical organ ({', '.join(ORGANS)})")
    return ORGAN_ID[organ]


@dataclass(frozen=True)
class LabelMap:
    """Raw label id -> canonical organ, and which raw ids are lesions.

    Attributes:
        name: label map name (recorded in provenance).
        ids: raw id -> canonical organ name, or ``None`` for a known label that maps to
            background (e.g. aorta in an nnU-Net dataset). Raw 0 is always background.
        lesion_ids: raw ids whose voxels form the lesion channel.
        annotated: per canonical organ, whether the source annotates it.
        has_lesions: whether the source annotates lesions at all (lesion channel or None).
        approximations, notes: documentation copied from the manifest.
    """

    name: str
    ids: dict[int, str | None]
    lesion_ids: tuple[int, ...] = ()
    annotated: tuple[bool, ...] = (True,) * N_ORGANS
    has_lesions: bool = False
    approximations: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    ignored: tuple[str, ...] = field(default=())
    #: raw id -> sided stem (``"kidney"``): one label for both members of a bilateral pair,
    #: written as :data:`SIDED_ID` and split by side after reorientation (:func:`split_sided`).
    sided: dict[int, str] = field(default_factory=dict)

    @property
    def max_id(self) -> int:
        return max([0, *self.ids, *self.lesion_ids])

    def lut(self) -> np.ndarray:
        """uint8 lookup table raw id -> canonical id (unknown ids map to 0; check first)."""
        table = np.zeros(self.max_id + 1, dtype=np.uint8)
        for raw, organ in self.ids.items():
            table[raw] = SIDED_ID if organ in SIDED_PAIRS else ORGAN_ID[organ] if organ else 0
        return table

    def known(self) -> np.ndarray:
        table = np.zeros(self.max_id + 1, dtype=bool)
        table[0] = True
        table[list(self.ids)] = True
        table[list(self.lesion_ids)] = True
        return table

    def is_identity(self) -> bool:
        return self.ids == {i + 1: o for i, o in enumerate(ORGANS)} and not self.lesion_ids

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable description (for build manifests and provenance)."""
        return {
            "name": self.name,
            "ids": {str(k): v for k, v in sorted(self.ids.items())},
            "lesion_ids": list(self.lesion_ids),
            "annotated": [o for o, a in zip(ORGANS, self.annotated, strict=True) if a],
            "not_annotated": [o for o, a in zip(ORGANS, self.annotated, strict=True) if not a],
            "has_lesions": self.has_lesions,
            "approximations": list(self.approximations),
            "ignored": list(self.ignored),
            "notes": list(self.notes),
            **({"sided": {str(k): v for k, v in sorted(self.sided.items())}} if self.sided else {}),
        }


def label_map_from_ids(name: str) -> LabelMap:
    """The :class:`LabelMap` of an ``"ids"`` manifest (``word``, ``lits``, ``phantom``, ...)."""
    m = load_manifest(name)
    where = str(LABELS_DIR / f"{name}.json")
    if "labels" not in m:
        raise ConfigError(f"{where}: needs a 'labels' object mapping raw id -> canonical organ")
    ids: dict[int, str | None] = {}
    for raw, organ in m["labels"].items():
        if organ is not None:
            _check_organ(organ, where)
        ids[int(raw)] = organ
    lesion = tuple(int(v) for v in m.get("lesion_labels", []))
    annotated_names = m.get("annotated")
    if annotated_names is None:
        annotated_names = [o for o in ids.values() if o]
    for o in annotated_names:
        _check_organ(o, where)
    annotated = tuple(o in set(annotated_names) for o in ORGANS)
    return LabelMap(
        name=name,
        ids=ids,
        lesion_ids=lesion,
        annotated=annotated,
        has_lesions=bool(lesion) or bool(m.get("has_lesions", False)),
        approximations=tuple(m.get("approximations", [])),
        notes=tuple(m.get("notes", [])),
    )


def totalsegmentator_classes() -> tuple[dict[str, str], tuple[bool, ...], dict[str, Any]]:
    """``(class file stem -> canonical organ, annotated flags, manifest)`` for TotalSegmentator."""
    m = load_manifest("totalsegmentator")
    where = str(LABELS_DIR / "totalsegmentator.json")
    classes = dict(m["classes"])
    for organ in classes.values():
        _check_organ(organ, where)
    mapped = set(classes.values())
    annotated = tuple(o in mapped for o in ORGANS)
    return classes, annotated, m


def _synonym_tables(m: dict[str, Any], where: str) -> tuple[dict[str, str], dict[str, str | None]]:
    """(normalised name -> organ or sided stem, normalised lesion name -> host or None) of nnunet.json."""
    synonyms: dict[str, str] = {}
    for organ, names in m["synonyms"].items():
        _check_organ(organ, where)
        synonyms.update({normalise_name(n): organ for n in names})
    for stem, names in m.get("sided_synonyms", {}).items():
        if stem not in SIDED_PAIRS:
            raise ConfigError(f"{where}: sided stem {stem!r} unknown; known: {', '.join(SIDED_PAIRS)}")
        synonyms.update({normalise_name(n): stem for n in names})
    lesions = {normalise_name(k): v for k, v in m.get("lesion_synonyms", {}).items()}
    for host in lesions.values():
        if host is not None and host not in SIDED_PAIRS:
            _check_organ(host, where)
    return synonyms, lesions


def _organs_of(value: str | None) -> set[str]:
    return set(SIDED_PAIRS[value]) if value in SIDED_PAIRS else {value} if value else set()


def label_map_from_names(name: str, labels: dict[str, int]) -> LabelMap:
    """A :class:`LabelMap` for a dataset whose labels are given by name (nnU-Net ``dataset.json``).

    ``labels`` maps label name -> raw id (background included or not). Names are
    matched to canonical organs through ``manifests/labels/nnunet.json``; names that
    match nothing become background and are listed in ``ignored``. A lesion name
    without an organ (``tumor``, ``cancer``) belongs to the dataset's only organ label
    when there is exactly one (MSD Liver, MSD Pancreas, KiTS); a lesion alone never makes
    its organ annotated.
    """
    m = load_manifest("nnunet")
    synonyms, lesions = _synonym_tables(m, str(LABELS_DIR / "nnunet.json"))
    ids: dict[int, str | None] = {}
    lesion_ids: list[int] = []
    ignored: list[str] = []
    for label_name, raw in labels.items():
        key = normalise_name(label_name)
        if raw == 0 or key == "background":
            continue
        if key in synonyms:
            ids[raw] = synonyms[key]
        elif key in lesions:
            lesion_ids.append(raw)
            ids[raw] = lesions[key]
        else:
            ids[raw] = None
            ignored.append(label_name)
    organ_values = {o for raw, o in ids.items() if o and raw not in lesion_ids}
    only_host = next(iter(organ_values)) if len(organ_values) == 1 else None
    for raw in lesion_ids:  # a lesion alone does not annotate its organ: keep it background
        host = ids[raw] or only_host
        ids[raw] = host if host in organ_values else None
    mapped = set().union(*(_organs_of(o) for o in organ_values)) if organ_values else set()
    return LabelMap(
        name=f"nnunet:{name}",
        ids=ids,
        lesion_ids=tuple(sorted(lesion_ids)),
        annotated=tuple(o in mapped for o in ORGANS),
        has_lesions=bool(lesion_ids),
        approximations=tuple(m.get("approximations", [])),
        notes=tuple(m.get("notes", [])),
        ignored=tuple(ignored),
        sided={raw: o for raw, o in ids.items() if o in SIDED_PAIRS},
    )


def split_sided(mask: np.ndarray, image: np.ndarray | None) -> dict[str, Any] | None:
    """Split :data:`SIDED_ID` voxels of a CANONICAL mask by side, in place; return the record.

    The midline is the centre column of the body (image voxels > -500 HU) when there is
    an image, else of every labelled voxel. Voxels at a larger column (the patient's left)
    become the left member of the pair. Returns None when no voxel is sided.
    """
    sided = mask == SIDED_ID
    if not sided.any():
        return None
    body = (image > -500) if image is not None else (mask > 0)
    cols = np.flatnonzero(body.any(axis=(0, 1)))
    midline = (cols[0] + cols[-1]) / 2.0 if cols.size else (mask.shape[2] - 1) / 2.0
    left, right = SIDED_PAIRS["kidney"]
    on_left = np.arange(mask.shape[2]) > midline
    mask[sided & on_left[None, None, :]] = ORGAN_ID[left]
    mask[sided & ~on_left[None, None, :]] = ORGAN_ID[right]
    return {"stem": "kidney", "midline_col": float(midline),
            "midline_from": "body (image > -500 HU)" if image is not None else "labelled voxels"}


def label_counts(raw: np.ndarray, *, chunk: int = 1 << 20) -> np.ndarray:
    """Voxel count per raw label value (raw: non-negative integers).

    ``np.bincount`` over 1 M-voxel chunks in memory order: no copy of the volume and no
    volume-sized int64 temporary (about 10x faster than one call on a 50 M-voxel map).
    """
    flat = raw.ravel(order="K")
    if flat.dtype.kind != "u" or flat.dtype.itemsize > 2:
        flat = flat.astype(np.int64, copy=False)
    counts = np.zeros(0, dtype=np.int64)
    for start in range(0, flat.size, chunk):
        part = np.bincount(flat[start : start + chunk])
        if part.size > counts.size:
            part[: counts.size] += counts
            counts = part
        else:
            counts[: part.size] += part
    return counts


def apply_label_map(
    raw: np.ndarray, label_map: LabelMap, *, case_id: str, path: str | Path
) -> tuple[np.ndarray, np.ndarray | None]:
    """``(canonical uint8 ids, uint8 lesion channel or None)``; unknown label values raise.

    The strict form of :func:`map_labels` (``unknown="fail"``).
    """
    mask, lesion, _ = map_labels(raw, label_map, case_id=case_id, path=path)
    return mask, lesion


def map_labels(
    raw: np.ndarray, label_map: LabelMap, *, case_id: str, path: str | Path, unknown: str = "fail"
) -> tuple[np.ndarray, np.ndarray | None, dict[int, int]]:
    """``(canonical uint8 ids, uint8 lesion channel or None, {ignored raw id: voxels})``.

    A label value the map does not know raises :class:`CaseError` (``unknown="fail"``) or
    becomes background and is returned in the ignored table (``unknown="ignore"``). A
    mask without any labelled voxel always raises.
    """
    counts = label_counts(raw)
    known = label_map.known()
    present = np.flatnonzero(counts)
    unknown_ids = [int(v) for v in present if v >= known.size or not known[v]]
    if unknown_ids and unknown != "ignore":
        known_ids = sorted(int(v) for v in np.flatnonzero(known))
        raise CaseError(
            case_id,
            path,
            f"unknown label value(s) {unknown_ids[:10]} for label map {label_map.name!r} "
            f"(known ids: {known_ids}); fix the mask, use the right --source, "
            "or pass --unknown-labels ignore to treat them as background (recorded)",
        )
    if present.size == 0 or (present.size == 1 and present[0] == 0):
        raise CaseError(case_id, path, "mask is empty: no labelled voxel")
    if label_map.is_identity() and raw.dtype == np.uint8 and not unknown_ids:
        mask = raw
    elif label_map.is_identity() and not unknown_ids:
        mask = raw.astype(np.uint8)
    else:
        lut = label_map.lut()
        if counts.size > lut.size:  # ignored ids above the map's largest id: background
            lut = np.concatenate([lut, np.zeros(counts.size - lut.size, np.uint8)])
        mask = lut[raw]
    lesion = None
    if label_map.has_lesions:
        lesion = np.zeros_like(raw, dtype=np.uint8)  # raw's memory order (NIfTI: Fortran)
        for v in label_map.lesion_ids:
            if v < counts.size and counts[v]:
                lesion |= (raw == v).view(np.uint8)
    return mask, lesion, {v: int(counts[v]) for v in unknown_ids}
