"""TotalSegmentator v2 layout: ``sXXXX/ct.nii.gz`` + ``sXXXX/segmentations/<class>.nii.gz``.

A case's masks are either one binary file per class (``segmentations/<class>.nii.gz``,
the dataset's layout) or TotalSegmentator's single multi-label file
(``segmentations.nii.gz`` written by ``TotalSegmentator --ml``), whose class table
(id -> class name) is read from its NIfTI header extension (the Caret XML ``LabelTable``
TotalSegmentator writes); ids outside that table are unknown labels (``--unknown-labels``).

The per-class binary masks named in ``manifests/labels/totalsegmentator.json`` are
united into canonical ids (``small_bowel`` -> intestine, both adrenal glands ->
adrenal, ``femur_left/right`` stand for the femoral heads, ...); only those files are
read. Rectum has no class: it is flagged not annotated. A mapped class whose file is
missing makes that organ not annotated for the case (recorded in provenance
``missing_classes``). Splits come from ``ROOT/meta.csv`` (``;``-separated, columns
``image_id`` and ``split``).
"""

from __future__ import annotations

import csv
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import ClassVar

import numpy as np

from spar_bench.errors import CaseError, ConfigError

from ..case import CaseRef
from ..ontology import LabelMap, map_labels, totalsegmentator_classes
from ..readers import as_integer_labels, read_volume
from ..schema import ORGAN_ID, ORGANS
from .volume import MaskFile, MaskRead, VolumeSource, check_unique, find_image


def _binary_top(raw: np.ndarray, *, case_id: str, path: Path) -> int:
    """The largest value of a binary class mask (0 or 1); CaseError for anything above 1."""
    top = int(raw.max()) if raw.size else 0
    if top > 1:
        raise CaseError(case_id, path, f"binary class mask has value {top}; expected 0/1 only")
    return top


def _paint_class(mask: np.ndarray, raw: np.ndarray, value: int) -> int:
    """Set ``mask`` to ``value`` where the 0/1 class mask ``raw`` is 1 (a later class
    overwrites an earlier one); return the class's voxel count. Whole-array passes in
    memory order (count, masked copy): no index arrays of the labelled voxels."""
    on = raw.view(np.bool_) if raw.dtype.itemsize == 1 else raw.astype(np.bool_)
    np.copyto(mask, value, where=on)
    return int(np.count_nonzero(on))


#: meta.csv split names -> canonical split.
SPLIT_NAMES = {"train": "train", "val": "val", "validation": "val", "test": "test"}


def _segmentations(case_dir: Path) -> Path | None:
    """``case_dir/segmentations/`` (one file per class), else ``segmentations.nii[.gz]`` (multi-label)."""
    for candidate in ("segmentations", "segmentations.nii.gz", "segmentations.nii"):
        path = case_dir / candidate
        if (path.is_dir() if candidate == "segmentations" else path.is_file()):
            return path
    return None


def read_class_table(path: Path, *, case_id: str) -> dict[int, str]:
    """``{id: class name}`` from the Caret XML ``LabelTable`` in a NIfTI header extension."""
    import nibabel as nib

    try:
        extensions = nib.load(str(path)).header.extensions
    except Exception as e:
        raise CaseError(case_id, path, f"unreadable NIfTI header ({type(e).__name__}: {e})") from None
    for ext in extensions:
        try:
            root = ET.fromstring(ext.get_content())
        except (ET.ParseError, TypeError, ValueError):
            continue
        table = {int(lab.get("Key")): (lab.text or "").strip() for lab in root.iter("Label") if lab.get("Key")}
        if table:
            return table
    raise CaseError(case_id, path, "multi-label file has no class table (TotalSegmentator --ml writes one "
                                   "in the NIfTI header extension); use the one-file-per-class folder instead")


def read_meta_csv(path: Path) -> dict[str, str]:
    """``image_id -> canonical split`` from a TotalSegmentator ``meta.csv`` (``;``-separated)."""
    if not path.is_file():
        raise ConfigError(f"{path} not found: TotalSegmentator needs meta.csv (image_id;split) for splits")
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh, delimiter=";")
        fields = reader.fieldnames or []
        if "image_id" not in fields or "split" not in fields:
            raise ConfigError(
                f"{path}: needs ';'-separated columns image_id and split, found {fields or 'none'}"
            )
        splits: dict[str, str] = {}
        for line, row in enumerate(reader, start=2):
            name = (row["split"] or "").strip().lower()
            if name not in SPLIT_NAMES:
                raise ConfigError(
                    f"{path} line {line}: unknown split {row['split']!r} for {row['image_id']!r}; "
                    f"expected one of {sorted(SPLIT_NAMES)}"
                )
            image_id = (row["image_id"] or "").strip()
            if image_id in ("", ".", "..") or "/" in image_id or "\\" in image_id:
                raise ConfigError(f"{path} line {line}: image_id {image_id!r} is not a case folder name "
                                  "(empty, '.', '..' or a path: unsafe, it would name a folder outside "
                                  "ROOT/<image_id>); fix or remove the row")  # fmt: skip
            splits[image_id] = SPLIT_NAMES[name]
    return splits


class TotalSegmentatorSource(VolumeSource):
    """TotalSegmentator: ``ROOT/meta.csv`` and ``ROOT/<image_id>/{ct.nii.gz,segmentations/}``."""

    name = "totalsegmentator"
    needs = "ROOT/meta.csv (image_id;split) and ROOT/<image_id>/ct.nii.gz + ROOT/<image_id>/segmentations/<class>.nii.gz"
    labels_manifest: ClassVar[str] = "totalsegmentator"
    split_rule: ClassVar[str] = "meta.csv"

    def get_label_map(self) -> LabelMap:
        if not hasattr(self, "_label_map_cache"):
            classes, annotated, m = totalsegmentator_classes()
            self._classes = classes
            self._label_map_cache = LabelMap(
                name="totalsegmentator",
                ids={},
                annotated=annotated,
                approximations=tuple(m.get("approximations", [])),
                notes=tuple(m.get("notes", [])),
            )
        return self._label_map_cache

    def label_map(self) -> dict:
        d = self.get_label_map().to_dict()
        d["classes"] = dict(self._classes)
        return d

    def find(self) -> list[CaseRef]:
        if not self.root.is_dir():
            raise ConfigError(f"totalsegmentator root {self.root} is not a folder; expected {self.needs}")
        case_dirs = sorted(p for p in self.root.iterdir() if p.is_dir() and _segmentations(p) is not None)
        if not case_dirs:
            raise ConfigError(f"no totalsegmentator cases found in {self.root}; expected {self.needs}")
        splits = read_meta_csv(self.root / "meta.csv")
        refs = []
        for d in case_dirs:
            if d.name not in splits:
                raise ConfigError(f"{self.root / 'meta.csv'} has no row for case folder {d}; add image_id {d.name}")
            files = {"segmentations": _segmentations(d)}
            image = find_image(d, "ct")
            if image is not None:
                files["image"] = image
            refs.append(CaseRef(self.name, d.name, splits[d.name], files))
        refs += self._listed_without_folder(splits, {d.name for d in case_dirs})
        return check_unique(refs, self.root)

    def _listed_without_folder(self, splits: dict[str, str], found: set[str]) -> list[CaseRef]:
        """meta.csv rows whose case folder (or its segmentations/) is missing: cases with a problem."""
        meta = self.root / "meta.csv"
        refs = []
        for image_id in sorted(set(splits) - found):
            folder = self.root / image_id
            if folder.is_dir():
                image = find_image(folder, "ct")
                files = {"image": image} if image is not None else {"meta": meta}
                problem = f"listed in {meta} but {folder} has no segmentations/ folder (nor segmentations.nii.gz)"
            else:
                files, problem = {"meta": meta}, f"listed in meta.csv but there is no case folder {folder}"
            refs.append(CaseRef(self.name, image_id, splits[image_id], files, problem=problem))
        return refs

    def read_mask(self, ref: CaseRef) -> MaskRead:
        self.get_label_map()
        seg_dir = Path(ref.files["segmentations"])
        if seg_dir.is_file():
            return self.read_multilabel(ref, seg_dir)
        mask: np.ndarray | None = None
        affine = None
        geometry: list[MaskFile] = []
        missing: list[str] = []
        hits = 0  # class voxels; minus the labelled voxels at the end = voxels claimed twice
        # Write classes in canonical organ order so the result does not depend on the manifest order.
        order = sorted(self._classes.items(), key=lambda kv: (ORGANS.index(kv[1]), kv[0]))
        for cls, organ in order:
            path = seg_dir / f"{cls}.nii.gz"
            if not path.exists():
                path = seg_dir / f"{cls}.nii"
            if not path.exists():
                missing.append(cls)
                continue
            raw, aff = read_volume(path, case_id=ref.case_id)
            raw = as_integer_labels(raw, case_id=ref.case_id, path=path)
            top = _binary_top(raw, case_id=ref.case_id, path=path)
            if mask is None:  # the file's memory order (NIfTI: Fortran): no strided passes below
                mask, affine = np.zeros_like(raw, dtype=np.uint8), aff
            elif raw.shape != mask.shape or not np.allclose(aff, affine, rtol=0, atol=1e-3):
                raise CaseError(
                    ref.case_id, path, f"shape {raw.shape} or affine differs from the other class masks "
                    f"(shape {mask.shape}); every class mask must share one voxel grid and axis order"
                )
            if top:
                hits += _paint_class(mask, raw, ORGAN_ID[organ])
            geometry.append(MaskFile(path, aff, tuple(raw.shape)))
        if mask is None:
            raise CaseError(
                ref.case_id, seg_dir, f"none of the mapped class masks is present ({', '.join(sorted(self._classes))})"
            )
        labelled = int(np.count_nonzero(mask))
        if not labelled:
            raise CaseError(ref.case_id, seg_dir, "mask is empty: no mapped class has a labelled voxel")
        overlap = hits - labelled  # = sum over classes of voxels an earlier class had labelled
        missing_organs = {o for c, o in self._classes.items() if c in missing}
        missing_organs -= {o for c, o in self._classes.items() if c not in missing}
        annotated = tuple(
            a and o not in missing_organs for o, a in zip(ORGANS, self.get_label_map().annotated, strict=True)
        )
        extra = {"missing_classes": missing, "overlap_voxels": overlap, "annotated": annotated}
        return MaskRead(mask, None, affine, geometry, extra)

    def read_multilabel(self, ref: CaseRef, path: Path) -> MaskRead:
        """The single multi-label file: ids mapped through its own class table."""
        table = read_class_table(path, case_id=ref.case_id)
        raw, affine = read_volume(path, case_id=ref.case_id)
        raw = as_integer_labels(raw, case_id=ref.case_id, path=path)
        ids = {i: self._classes.get(name) for i, name in table.items() if i > 0}
        base = self.get_label_map()
        lm = LabelMap(name="totalsegmentator:multilabel", ids=ids, annotated=base.annotated)
        mask, _lesion, ignored = map_labels(raw, lm, case_id=ref.case_id, path=path, unknown=self.unknown_labels)
        missing = sorted(c for c in self._classes if c not in set(table.values()))
        missing_organs = {self._classes[c] for c in missing} - {o for o in ids.values() if o}
        annotated = tuple(a and o not in missing_organs for o, a in zip(ORGANS, base.annotated, strict=True))
        extra = {"missing_classes": missing, "overlap_voxels": 0, "annotated": annotated,
                 "class_table": {str(k): v for k, v in sorted(table.items()) if v in self._classes}}
        if ignored:
            extra["ignored_label_ids"] = {str(k): v for k, v in ignored.items()}
        return MaskRead(mask, None, affine, [MaskFile(path, affine, tuple(raw.shape))], extra)
