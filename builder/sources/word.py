"""WORD layout (Luo et al., MedIA 2022).

WORD ships ``imagesTr/labelsTr`` (train), ``imagesVal/labelsVal`` (val) and
``imagesTs/labelsTs`` (test), one ``<case>.nii.gz`` per case in each folder. An image may
also be a folder of DICOM slices named ``<case>/``. A folder with labels but no images
(the public WORD label maps) is read with ``images="synthesize"`` (see
:mod:`spar_bench.builder.sources.volume`).
"""

from __future__ import annotations

from typing import ClassVar

from ..case import CaseRef
from .volume import VolumeSource

#: The WORD folders, ``(image folder, label folder, split)``; the phantom is written in them.
SPLIT_DIRS: tuple[tuple[str, str, str], ...] = (
    ("imagesTr", "labelsTr", "train"),
    ("imagesVal", "labelsVal", "val"),
    ("imagesTs", "labelsTs", "test"),
)


class WordSource(VolumeSource):
    """WORD: ``imagesTr|imagesVal|imagesTs`` + ``labelsTr|labelsVal|labelsTs``, any ``*.nii[.gz]``."""

    name = "word"
    needs = (
        "ROOT/labelsTr|labelsVal|labelsTs/<case>.nii.gz and the matching imagesTr|imagesVal|imagesTs "
        "(NIfTI or DICOM folder <case>/); masks-only folders need --images synthesize"
    )
    labels_manifest: ClassVar[str] = "word"
    split_rule: ClassVar[str] = "official split (folders Tr = train, Val = val, Ts = test)"
    #: (image folder, label folder, split).
    split_dirs: ClassVar[tuple[tuple[str, str, str], ...]] = SPLIT_DIRS

    def find(self) -> list[CaseRef]:
        return self.find_pairs(self.split_dirs)
