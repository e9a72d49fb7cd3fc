"""nnU-Net raw-data layout (AMOS, BTCV, FLARE, MSD, ... converted for nnU-Net).

``ROOT/dataset.json`` names the labels, either nnU-Net v2 style
``{"labels": {"background": 0, "liver": 1, ...}}`` or v1 style
``{"labels": {"0": "background", "1": "liver", ...}}``. Names are mapped to canonical
organs through ``manifests/labels/nnunet.json`` (synonyms, order- and case-insensitive:
``"right kidney"``, ``"kidney_right"`` and ``"Kidney (R)"`` are one name). Images are
``imagesTr/<case>_0000.nii.gz`` (channel 0 only; a DICOM folder ``<case>_0000/`` also
works), labels ``labelsTr/<case>.nii.gz``; ``Tr`` is the split train, ``Ts`` test.
"""

from __future__ import annotations

import json
from pathlib import Path

from spar_bench.errors import ConfigError

from ..case import CaseRef
from ..ontology import LabelMap, label_map_from_names
from .volume import VolumeSource


def read_dataset_labels(path: Path) -> dict[str, int]:
    """``label name -> raw id`` from an nnU-Net ``dataset.json`` (v1 or v2 style)."""
    if not path.is_file():
        raise ConfigError(f"{path} not found: an nnU-Net dataset needs dataset.json with 'labels'")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from None
    labels = meta.get("labels")
    if not isinstance(labels, dict) or not labels:
        raise ConfigError(f"{path}: needs a non-empty 'labels' object")
    out: dict[str, int] = {}
    for key, value in labels.items():
        if isinstance(value, int) and not isinstance(value, bool):  # v2: name -> id
            out[key] = value
        elif isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            raise ConfigError(f"{path}: label {key!r} is a region (list of ids); regions are not supported")
        elif isinstance(value, str) and key.strip().isdigit():  # v1: "id" -> name
            out[value] = int(key)
        else:
            raise ConfigError(f"{path}: cannot read label entry {key!r}: {value!r} (expected name->id or 'id'->name)")
    ids = list(out.values())
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{path}: two label names share one id ({sorted(ids)})")
    return out


class NnUNetSource(VolumeSource):
    """nnU-Net raw layout: ``dataset.json``, ``imagesTr/labelsTr`` (train), ``imagesTs/labelsTs`` (test)."""

    name = "nnunet"
    split_rule = "folders (Tr = train, Ts = test)"
    #: nnU-Net's imagesTs usually has no labelsTs: without that folder the images are unused.
    unlabelled_image_dirs = ("imagesTs",)
    needs = "ROOT/dataset.json ('labels' by name), ROOT/labelsTr|labelsTs/<case>.nii.gz, ROOT/imagesTr|imagesTs/<case>_0000.nii.gz"

    def get_label_map(self) -> LabelMap:
        if not hasattr(self, "_label_map_cache"):
            labels = read_dataset_labels(self.root / "dataset.json")
            self._label_map_cache = label_map_from_names(self.root.name, labels)
        return self._label_map_cache

    def find(self) -> list[CaseRef]:
        if not self.root.is_dir():
            raise ConfigError(f"nnunet root {self.root} is not a folder; expected {self.needs}")
        # Fail early on a missing or bad dataset.json; lesions only if a label names them.
        self.has_lesions = self.get_label_map().has_lesions  # type: ignore[misc]
        return self.find_pairs(
            (("imagesTr", "labelsTr", "train"), ("imagesTs", "labelsTs", "test")), image_suffix="_0000"
        )
